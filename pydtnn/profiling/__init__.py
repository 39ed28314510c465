"""Timelines and timers: a Chrome-trace tracer for per-layer and per-phase timing."""

from pydtnn.profiling.tracer import Tracer

__all__ = ["Tracer"]
