"""Timelines and timers: a Chrome-trace tracer for per-layer and per-phase timing."""

from pydtnn.profiling.tracer import Tracer, trace_paths, written

__all__ = ["Tracer", "trace_paths", "written"]
