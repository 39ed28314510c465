"""What a training run reports, and where: progress bars or lines, one summary line per epoch, the metrics file.

Only the root process reports. The metrics file's format is a public contract (docs/architecture.md).
"""

import json
import math
import os
import sys
import time

import numpy as np
from tqdm import tqdm

from pydtnn.errors import ConfigError
from pydtnn.files import check_writable, is_terminal


class Reporting:
    """Where a run's progress goes, decided once from the Trainer's options.

    Bars only on a terminal (redirected to a file they would fill it with carriage returns); elsewhere (a log
    file, mpirun's pipes) a progress line every `progress_every` seconds; the one summary line per epoch (on
    stdout) is on wherever progress is, or as epoch_lines says. log: where lines go (default stderr).
    Everything is off on a process that is not the root.
    """

    def __init__(self, progress=True, epoch_lines=None, metrics_file=None, log=None, progress_every=10.0,
                 is_root=True):
        self.bars = progress and is_root and is_terminal(sys.stderr)
        self.progress_every = progress_every if progress and is_root and not self.bars else None
        self.epoch_lines = (progress if epoch_lines is None else epoch_lines) and is_root
        self.metrics_file = metrics_file if is_root else None
        say = log or (lambda msg: print(msg, file=sys.stderr))
        self.log = say if is_root else (lambda msg: None)

    def bar(self, slices, epoch, epochs):
        """The epoch's progress bar over its global batches `slices` (disabled where no bars show)."""
        return tqdm(slices, desc=f"epoch {epoch + 1}/{epochs}", unit="batch", file=sys.stderr,
                    disable=not self.bars, dynamic_ncols=True, mininterval=0.5, leave=False)

    def lines(self, slices, epoch, epochs):
        """The epoch's ProgressLines, or None where bars (or nothing) show progress."""
        if self.progress_every is None:
            return None
        return ProgressLines(self.log, epoch, epochs, slices, self.progress_every)


class MetricsFile:
    """JSON Lines writer: one object per line, flushed at once so a crash never leaves half a record.

    The path is checked at once, but the file (and any folder missing on its way) is created with
    the first record: a run that fails before finishing an epoch leaves no file behind.
    """

    def __init__(self, path):
        # folders missing on the way are made with the file (the CLI checks paths more strictly)
        self.path, self.f = check_writable(path, "metrics file", made=os.path.dirname(os.path.abspath(path))), None

    def write(self, record):
        if self.f is None:
            try:
                os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
                self.f = open(self.path, "w", encoding="utf-8")
            except OSError as e:
                raise ConfigError(f"cannot write metrics file {self.path}: {e.strerror}") from None
        try:
            self.f.write(json.dumps(record) + "\n")
            self.f.flush()
        except OSError as e:  # a full disk, a file size limit: what was flushed before stays whole
            raise ConfigError(f"cannot write metrics file {self.path}: {e.strerror or e}") from None

    def close(self):
        if self.f is not None:
            f, self.f = self.f, None
            try:
                f.close()
            except OSError:  # the write that failed raised already; a second error would hide it
                pass


class ProgressLines:
    """Training progress as a line every `every` seconds, where no terminal shows a bar (a log file,
    mpirun's pipes): epoch, step of steps, samples per second over all processes, the epoch's loss so
    far (this process's share of the batches), and the time the epoch has left at that pace."""

    def __init__(self, say, epoch, epochs, slices, every=10.0):
        self.say, self.epoch, self.epochs, self.every = say, epoch, epochs, every
        self.ends = np.cumsum([b - a for a, b in slices])  # global samples done after each step
        self.start = self.last = time.monotonic()

    def step_done(self, step, loss=None):
        now = time.monotonic()
        if now - self.last < self.every or step + 1 >= len(self.ends):
            return
        self.last, elapsed = now, now - self.start
        done = int(self.ends[step])
        rate = done / elapsed if elapsed > 0 else float("inf")
        left = (int(self.ends[-1]) - done) / rate if rate > 0 else float("inf")
        self.say(f"epoch {self.epoch + 1}/{self.epochs}: step {step + 1}/{len(self.ends)}, {rate:,.1f} samples/s"
                 f"{'' if loss is None else f', loss {loss:.4f}'}, {_duration(left)} left in the epoch")


def _duration(seconds):
    """'42 s', '3 min 20 s', '2 h 05 min'."""
    if not math.isfinite(seconds):
        return "unknown time"
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def format_record(r):
    """'epoch 3: loss 0.1234, accuracy 0.9612, val_loss ...' for the log; a final record names the layout
    'processes 4, replicas 2, model_parallel_size 2'."""
    skip = {"epoch", "final", "params_sha256"}
    names = {"world_size": "processes"}
    parts = [f"{names.get(k, k)} {v:.4g}" if isinstance(v, float) else f"{names.get(k, k)} {v}"
             for k, v in r.items() if k not in skip and v is not None]
    head = "final" if r.get("final") else f"epoch {r['epoch']}"
    return f"{head}: " + ", ".join(parts)
