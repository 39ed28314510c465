"""The training loop: batches -> forward -> loss -> backward -> optimizer step -> callbacks.

    trainer = Trainer(model, SoftmaxCrossEntropy(), SGD(model.parameters(), lr=0.05, momentum=0.9))
    history = trainer.fit(train, epochs=5, batch_size=64, val=val, test=test)
    trainer.evaluate(test)            # {"loss": ..., "accuracy": ...}
    trainer.predict(test)             # (N, num_classes) outputs

Per-epoch numbers go to `history`, to the progress bar, and (with metrics_file) to a JSON Lines file
whose format is a public contract (docs/architecture.md).
"""

import json
import math
import os
import sys
import time
from contextlib import nullcontext

import numpy as np
from tqdm import tqdm

from pydtnn import metrics as metric_fns
from pydtnn import runtime
from pydtnn.data.dataset import batch_slices, epoch_order
from pydtnn.errors import ConfigError, DataError, TrainingDiverged
from pydtnn.files import is_terminal
from pydtnn.losses import check_host_targets, defers, targets_checked_on_host
from pydtnn.optim.schedules import learning_rate
from pydtnn.randomness import SampleStreams


class MetricsFile:
    """JSON Lines writer: one object per line, flushed at once so a crash never leaves half a record.

    The path is checked at once, but the file (and any folder missing on its way) is created with
    the first record: a run that fails before finishing an epoch leaves no file behind.
    """

    def __init__(self, path):
        from pydtnn.files import check_writable

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


class Trainer:
    """Trainer for a Model, a loss and an optimizer, on one process or data-parallel over many.

    metrics: names from pydtnn.metrics reported besides the loss. seed: drives the per-epoch sample
    order (a pure function of (seed, epoch), so runs are reproducible and resumable). schedules:
    pydtnn.optim.schedules objects; the learning rate of each step is optimizer.lr at construction
    times their factors. callbacks: objects with any of on_train_begin(trainer),
    on_epoch_begin(trainer, epoch), on_batch_end(trainer, step, logs), on_epoch_end(trainer, epoch,
    logs) (see pydtnn.callbacks); setting trainer.stop_training = True ends fit after the epoch.

    Data parallelism: pass a communicator (pydtnn.distributed.launch.init()) and a reducer
    (pydtnn.distributed.reducers.create(...)). batch_size is then per process: each step takes a
    global batch of batch_size * world_size samples and gives each rank its share. Metrics are
    reduced once per epoch; only rank 0 shows progress and writes files. With model parallelism
    (pydtnn.distributed.model_parallel) comm is the data-parallel communicator, whose ranks are the
    model replicas, and is_root says which process of all shows progress and writes files.

    prefetch: assemble the next training batch (read, decode, augment) in a background thread while
    the current step computes. Batches depend only on (seed, epoch, step, rank), so the result is
    the same either way; the "data" span of a trace then shows only the wait that was not hidden.

    The process-wide settings (CPU threads, BLAS threads, malloc; pydtnn.runtime) are configured with
    their defaults unless pydtnn.runtime.configure has run already.
    """

    def __init__(self, model, loss, optimizer, metrics=("accuracy",), seed=0, progress=True, metrics_file=None,
                 callbacks=(), schedules=(), log=None, comm=None, reducer=None, prefetch=True, epoch_lines=None,
                 is_root=None, sync_every=None, progress_every=10.0):
        runtime.ensure_configured()
        self.model, self.loss, self.optimizer = model, loss, optimizer
        self.metric_names = tuple(dict.fromkeys(metric_fns.canonical(m) for m in metrics))
        self.metric_fns = {m: metric_fns.get(m) for m in self.metric_names}
        self.seed = seed
        self.callbacks = list(callbacks)
        self.schedules = list(schedules)
        self.base_lr = optimizer.lr
        if comm is None:
            from pydtnn.distributed.comm import SingleProcess

            comm = SingleProcess()
        self.comm, self.world_size = comm, comm.size
        self.is_root = comm.rank == 0 if is_root is None else bool(is_root)
        self.reducer = reducer.attach(model) if reducer is not None else None
        # bars only on a terminal (redirected to a file they would fill it with carriage returns); elsewhere
        # (a log file, mpirun's pipes) a progress line every `progress_every` seconds; the one summary line
        # per epoch (on stdout) is on wherever progress is, or as epoch_lines says
        self.progress = progress and self.is_root and is_terminal(sys.stderr)
        self.progress_every = progress_every if progress and self.is_root and not self.progress else None
        self.epoch_lines = (progress if epoch_lines is None else epoch_lines) and self.is_root
        self.metrics_file = metrics_file if self.is_root else None
        say = log or (lambda msg: print(msg, file=sys.stderr))
        self.log = say if self.is_root else (lambda msg: None)
        self.history = []
        self.stop_training = False
        self.tracer = None  # a profiling.Tracer: spans for data, forward, loss, backward, optimizer
        self.accumulation_steps, self._acc = 1, None  # micro-batches per step (set before fit)
        self._params = model.parameters()
        self._bn_sync = None
        self.prefetch = prefetch
        if sync_every is not None and (int(sync_every) != sync_every or sync_every < 1):
            raise ConfigError(f"sync_every must be a positive integer, got {sync_every!r}")
        self.sync_every = sync_every  # None: 1 where arrays are on the host, SYNC_EVERY_DEVICE on a GPU

    def layout(self):
        """{"world_size": processes of the job, "replicas": model replicas (data parallelism), "model_parallel_size":
        processes each replica is split over}: the layout as the final record names it."""
        group = self.model.sharding.group.size if self.model.sharding is not None else 1
        return {"world_size": self.world_size * group, "replicas": self.world_size, "model_parallel_size": group}

    def sync_batchnorm(self):
        """BatchNorm statistics over the global batch (all ranks) instead of each rank's share.

        Costs two small allreduces per BatchNorm layer and step (forward and backward); makes N
        processes compute what one process computes on the same global batch, BatchNorm included.
        """
        from pydtnn.layers.norm import BatchNorm

        self._bn_sync = _BatchNormSync(self.comm)
        for _, layer in self.model.layers():
            if isinstance(layer, BatchNorm):
                layer.synchronize(self._bn_sync)

    # -- one step ------------------------------------------------------------------------
    def train_step(self, x, y, weight=1.0, read=True):
        """Forward, loss, backward, gradient reduction and update on one batch. Returns (loss, outputs).

        weight: this rank's share of the global batch (its gradients count that much in the average).
        read: the loss as a Python float, checked to be finite before the update (TrainingDiverged); with
        read=False it is a 0-d array left on the device, unchecked (fit reads it later).
        """
        if self.accumulation_steps > 1:
            return self._accumulated_step(x, y, weight, read)
        if self._bn_sync is not None:
            self._bn_sync.weight = weight
        if self.reducer is not None:
            self.reducer.begin_step(weight)
        with self._span("forward"):
            out = self.model.forward(x, training=True)
        with self._span("loss"):
            loss = self._loss(out, y, read)
            dy = self.loss.backward()
        with self._span("backward"):
            self.model.backward(dy)
        if self.reducer is not None:
            with self._span("reduce"):
                self.reducer.finish()
        with self._span("optimizer"):
            self.optimizer.step()
        return loss, out

    def _loss(self, out, y, read):
        """The batch's mean loss: a float checked to be finite, or (read=False) a 0-d device array."""
        if read or not defers(self.loss):
            loss = self.loss.forward(out, y)
            if not math.isfinite(loss):
                raise TrainingDiverged(f"loss is {loss}")
            return loss
        return self.loss.value(out, y)

    def _accumulated_step(self, x, y, weight, read=True):
        """The batch in `accumulation_steps` micro-batches, gradients summed, one reduction, one update.

        Memory for activations is that of a micro-batch; the update is that of the whole batch.
        """
        n = x.shape[0]
        bounds = [n * i // self.accumulation_steps for i in range(self.accumulation_steps + 1)]
        params = self._params
        if self._acc is None:
            self._acc = [self.model.backend.xp.zeros_like(g) for _, _, g in params]
        total, outs = 0.0, []
        with nullcontext() if self.reducer is None else self.reducer.no_sync():  # one reduction, after the loop
            backend, streams = self.model.backend, self.model.backend.sample_streams
            for a, b in zip(bounds[:-1], bounds[1:]):
                if a == b:
                    continue
                if self._bn_sync is not None:
                    self._bn_sync.weight = weight * (b - a) / n
                if streams is not None and len(streams) == n:  # the micro-batch's samples, their own streams
                    backend.sample_streams = streams.rows(None, a, b)
                with self._span("forward"):
                    out = self.model.forward(x[a:b], training=True)
                with self._span("loss"):
                    loss = self._loss(out, y[a:b], read)
                    dy = self.loss.backward()
                with self._span("backward"):
                    self.model.backward(dy)
                share = (b - a) / n
                for acc, (_, _, g) in zip(self._acc, params):
                    if a == 0:
                        self.model.backend.xp.multiply(g, share, out=acc)
                    else:
                        acc += self.model.backend.xp.multiply(g, share, out=g)  # g is rewritten next backward
                if not read:  # in float64, as a Python float adds up when the loss is read
                    loss = self.model.backend.xp.asarray(loss, dtype=self.model.backend.xp.float64)
                total += loss * share
                outs.append(out)
        for acc, (_, _, g) in zip(self._acc, params):
            g[...] = acc
        if self.reducer is not None:
            self.reducer.begin_step(weight)
            with self._span("reduce"):
                self.reducer.replay()
                self.reducer.finish()
        with self._span("optimizer"):
            self.optimizer.step()
        return total, self.model.backend.xp.concatenate(outs)

    def _span(self, cat, name=None):
        return nullcontext() if self.tracer is None else self.tracer.span(name or cat, cat, tid=1)

    # -- loops ---------------------------------------------------------------------------
    def fit(self, train, epochs=1, batch_size=64, val=None, test=None, steps_per_epoch=None, start_epoch=0,
            drop_last=False):
        """Train for `epochs` epochs; evaluate on val after each and on test at the end.

        Returns the history: one dict per epoch with loss, metrics, val_* (None without val), lr,
        time_s and samples_per_second (training samples over training time, validation excluded).
        The final record (test_*, wall time, params_sha256) is left in `self.final`.
        """
        if batch_size < 1:
            raise ConfigError(f"batch_size must be a positive integer, got {batch_size}")
        self._check_data(train, val, test, batch_size, drop_last)
        self.epochs, self.stop_training = epochs, False
        self._callback("on_train_begin")
        writer = MetricsFile(self.metrics_file) if self.metrics_file else None
        for record in self.history[:start_epoch] if writer else ():  # a resumed run keeps its earlier epochs
            writer.write(record)
        t_start, train_time, train_samples = time.perf_counter(), 0.0, 0
        try:
            for epoch in range(start_epoch, epochs):
                self._callback("on_epoch_begin", epoch)
                t0 = time.perf_counter()
                record, seen = self._train_epoch(train, epoch, epochs, batch_size, steps_per_epoch, drop_last)
                t_train = time.perf_counter() - t0
                train_time, train_samples = train_time + t_train, train_samples + seen
                self._average_buffers()  # before validation, so every rank evaluates the same model
                record.update(self.evaluate_as("val", val, batch_size))
                record["lr"] = getattr(self.optimizer, "lr", None)
                record["time_s"] = time.perf_counter() - t0
                record["samples_per_second"] = seen / t_train if t_train > 0 else None
                self.history.append(record)
                if writer:
                    writer.write(record)
                if self.epoch_lines:
                    print(format_record(record), flush=True)
                for sched in self.schedules:
                    sched.on_epoch_end(epoch, record)
                self._callback("on_epoch_end", epoch, record)
                if self.stop_training:
                    break
            self.final = {"final": True, **self.evaluate_as("test", test, batch_size)}
            self.final["wall_time_s"] = time.perf_counter() - t_start
            self.final["samples_per_second"] = train_samples / train_time if train_time > 0 else None
            self.final.update(self.layout())
            self.final["params_sha256"] = self.model.params_sha256()
            if writer:
                writer.write(self.final)
            return self.history
        finally:
            if writer:
                writer.close()

    def _check_data(self, train, val, test, batch_size, drop_last):
        """Refuse, before an epoch is spent, data that would train on nothing or fail at the end."""
        if len(train) == 0:
            raise DataError(f"the training set {getattr(train, 'name', '')} is empty; expected at least one sample")
        if not batch_slices(len(train), batch_size * self.world_size, drop_last):
            raise ConfigError(f"drop_last with a global batch of {batch_size * self.world_size} samples "
                              f"({batch_size} per process x {self.world_size}) leaves no batch of the {len(train)} "
                              f"training samples; use a smaller batch or drop_last false")
        want = tuple(self.model.input_shape)
        for what, data in (("training", train), ("validation", val), ("test", test)):
            shape = getattr(data, "input_shape", None)
            if shape is not None and tuple(shape) != want:
                raise DataError(f"the {what} set {getattr(data, 'name', '')} has samples of shape "
                                f"{tuple(shape)}; the model takes {want}")

    def _train_epoch(self, train, epoch, epochs, batch_size, steps_per_epoch, drop_last=False):
        """One pass over the epoch's global batches; returns ({"epoch", "loss", metrics...}, samples seen).

        Every rank walks the same global batches (the order is a function of seed and epoch) and
        takes its own share of each, so all ranks issue the same collectives even when the last
        batch is smaller than the world; an empty share computes on one sample with weight 0.
        """
        from pydtnn.distributed.sampler import shard_bounds

        backend, rank, size = self.model.backend, self.comm.rank, self.world_size
        order = epoch_order(len(train), self.seed, epoch)
        slices = batch_slices(len(train), batch_size * size, drop_last)[:steps_per_epoch]
        sums, seen = dict.fromkeys(("loss",) + self.metric_names, 0.0), 0
        shares = []  # (indices of this rank's samples, n) per step
        for a, b in slices:
            bounds = shard_bounds(b - a, size)
            lo, hi = a + bounds[rank], a + bounds[rank + 1]
            shares.append((np.sort(order[lo:hi]) if hi > lo else order[a : a + 1], hi - lo))

        def load(step):
            return train.get_batch(shares[step][0], backend.dtype, rng=SampleStreams(self.seed, epoch, shares[step][0]))

        bar = tqdm(slices, desc=f"epoch {epoch + 1}/{epochs}", unit="batch", file=sys.stderr,
                   disable=not self.progress, dynamic_ncols=True, mininterval=0.5, leave=False)
        lines = None if self.progress_every is None else ProgressLines(self.log, epoch, epochs, slices,
                                                                        self.progress_every)
        self.model.train()
        if self.reducer is not None:
            self.reducer.begin_epoch(epoch)
        every = self.steps_between_reads()
        pending = []  # (step, n, [loss, metrics...] as 0-d device arrays), read every `every` steps
        with _Prefetcher(load, len(slices), self.prefetch) as batches:
            for step, (a, b) in enumerate(bar):
                loss, out, y, n = self._train_batch(batches, step, epoch, a, b, *shares[step], read=every == 1)
                if every > 1:
                    with targets_checked_on_host():  # _train_batch checked them: no value is read here
                        values = [loss] + [fn(out, y, read=False) if n else 0.0 for fn in self.metric_fns.values()]
                    pending.append((step, n, values))
                    if len(pending) >= every or step == len(slices) - 1:
                        seen = self._read_pending(pending, sums, seen, epoch, every)
                        if seen:
                            bar.set_postfix({k: f"{v / seen:.4f}" for k, v in sums.items()}, refresh=False)
                elif n:
                    sums["loss"] += loss * n
                    for m, fn in self.metric_fns.items():
                        sums[m] += fn(out, y) * n
                    seen += n
                    bar.set_postfix({k: f"{v / seen:.4f}" for k, v in sums.items()}, refresh=False)
                if lines is not None:
                    lines.step_done(step, sums["loss"] / seen if seen else None)
                self._callback("on_batch_end", step, None)
        bar.close()
        totals = self.comm.allreduce_sum(list(sums.values()) + [seen])  # one reduction per epoch
        seen = int(totals[-1])
        record = {"epoch": epoch + 1, **{k: float(v) / max(seen, 1) for k, v in zip(sums, totals)}}
        record.setdefault("accuracy", None)
        return record, seen

    SYNC_EVERY_DEVICE = 32  # steps between reads of the loss and metrics when they live on a GPU

    def steps_between_reads(self):
        """How often fit reads the loss and metrics back and checks the loss is finite: sync_every, or by
        default every step where arrays are on the host (reading is free) and every SYNC_EVERY_DEVICE
        steps on a GPU, where each read makes the host wait for the device."""
        if self.sync_every is not None:
            return self.sync_every
        return 1 if self.model.backend.xp is np else self.SYNC_EVERY_DEVICE

    def _read_pending(self, pending, sums, seen, epoch, every):
        """Read the pending steps' losses and metrics in one transfer, check each loss is finite, add them to
        the epoch's sums (in step order, as a read every step would); returns the samples seen."""
        settle = getattr(getattr(self.reducer, "comm", None), "settle", None)
        if settle is not None:  # NCCL: wait for queued reductions from the host, watched for stalls
            settle()
        xp = self.model.backend.xp
        rows = self.model.backend.to_numpy(xp.stack([xp.stack([xp.asarray(v, dtype=xp.float64) for v in values])
                                                     for _, _, values in pending]))
        for i, ((step, n, _), row) in enumerate(zip(pending, rows)):
            loss = float(row[0])
            if not math.isfinite(loss):
                later = len(pending) - 1 - i
                raise self._diverged(f"loss is {loss}", epoch, step, (
                    f"the loss is read every {every} steps here, so the parameters have taken {later + 1} "
                    f"update{'s' if later else ''} since (sync_every 1 stops before the update)"))
            if n:
                sums["loss"] += loss * n
                for m, v in zip(self.metric_fns, row[1:]):
                    sums[m] += float(v) * n
                seen += n
        pending.clear()
        return seen

    def _diverged(self, what, epoch, step, parameters):
        last = self.history[-1] if self.history else None
        where = f" on rank {self.comm.rank}" if self.world_size > 1 else ""
        return TrainingDiverged(
            f"{what} at epoch {epoch + 1} step {step + 1}{where}; {parameters}; last completed epoch: "
            f"{json.dumps(last) if last else 'none'}; try a smaller learning rate")

    def _train_batch(self, batches, step, epoch, a, b, indices, n, read=True):
        """One step of _train_epoch on global batch [a, b), of which this rank has n samples (dataset rows
        `indices`). read=False leaves the loss on the device (a 0-d array, checked by _read_pending); the
        labels are then checked on the host here, before they are copied."""
        backend, rank = self.model.backend, self.comm.rank
        if self.schedules:
            self.optimizer.lr = learning_rate(self.base_lr, self.schedules, epoch, step, len(batches))
        t_step = time.perf_counter_ns()
        with self._span("data"):
            x, y = batches.get(step)
            if not read:  # the values are checked here, on the host, and not read again on the device
                check_host_targets(self.loss, y, self.model.output_shape)
            x, y = backend.batch_to_device(x, y)  # a GPU copies them while it computes the step before
        # dropout masks from each sample's stream (pydtnn.randomness): the same at any process count, nothing
        # to checkpoint; the Generator, reseeded per step and rank, serves only layers outside a Model
        backend.reseed([self.seed, epoch, step, rank, 1])
        backend.sample_streams = SampleStreams(self.seed, epoch, indices)
        settle = getattr(getattr(self.reducer, "comm", None), "settle", None)
        if read and settle is not None:  # NCCL: the last step's reductions, watched for stalls
            settle()
        try:
            with nullcontext() if read else targets_checked_on_host():
                loss, out = self.train_step(x, y, weight=n / (b - a), read=read)
        except TrainingDiverged as e:
            backend.sample_streams = None
            raise self._diverged(str(e), epoch, step, "parameters keep the values of the step before") from None
        backend.sample_streams = None
        if self.tracer is not None:
            self.tracer.add(f"step {step + 1}", "step", t_step, time.perf_counter_ns(), tid=0, epoch=epoch + 1)
        return loss, out, y, n

    def _average_buffers(self):
        """Make BatchNorm running statistics (per rank while training) the same on every rank."""
        if self.world_size == 1:
            return
        for _, layer in self.model.layers():
            for buf in layer.buffers.values():
                self.comm.allreduce(buf, "buffers")
                buf /= self.world_size

    def evaluate_as(self, prefix, data, batch_size=256):
        """{prefix_loss, prefix_<metric>...} of evaluate(data), all None when data is None."""
        keys = ("loss",) + tuple(dict.fromkeys(self.metric_names + ("accuracy",)))
        values = self.evaluate(data, batch_size) if data is not None else {}
        return {f"{prefix}_{k}": values.get(k) for k in keys}

    def _callback(self, hook, *args):
        for cb in self.callbacks:
            fn = getattr(cb, hook, None)
            if fn is not None:
                fn(self, *args)

    def evaluate(self, data, batch_size=256):
        """Mean loss and metrics over a whole dataset, in evaluation mode (no parameter changes).

        With several processes each evaluates a contiguous shard; the sums are reduced once.
        """
        from pydtnn.distributed.sampler import shard_bounds

        backend, was_training = self.model.backend, self.model.training
        bounds = shard_bounds(len(data), self.world_size)
        first, last = bounds[self.comm.rank], bounds[self.comm.rank + 1]
        self.model.eval()
        sums, seen = dict.fromkeys(("loss",) + self.metric_names, 0.0), 0
        # read every batch, or (on a GPU; sync_every > 1) the sums stay on the device in float64, read once
        read = self.steps_between_reads() == 1 or not defers(self.loss)
        try:
            for a, b in batch_slices(last - first, max(batch_size, 1)):
                x, y = data.get_batch(np.arange(first + a, first + b), backend.dtype)
                if not read:
                    check_host_targets(self.loss, y, self.model.output_shape)
                x, y = backend.batch_to_device(x, y)
                out = self.model.forward(x, training=False)
                with nullcontext() if read else targets_checked_on_host():
                    if read:
                        sums["loss"] += self.loss.forward(out, y) * (b - a)
                    else:
                        sums["loss"] += backend.xp.asarray(self.loss.value(out, y), dtype=np.float64) * (b - a)
                    for m, fn in self.metric_fns.items():
                        if read:
                            sums[m] += fn(out, y) * (b - a)
                        else:
                            sums[m] += backend.xp.asarray(fn(out, y, read=False), dtype=np.float64) * (b - a)
                seen += b - a
        finally:
            self.model.training = was_training
        if not read and seen:  # one transfer for every sum
            xp = backend.xp
            values = backend.to_numpy(xp.stack([xp.asarray(v, dtype=np.float64) for v in sums.values()]))
            sums = dict(zip(sums, (float(v) for v in values)))
        totals = self.comm.allreduce_sum(list(sums.values()) + [seen])
        return {k: float(v) / max(totals[-1], 1) for k, v in zip(sums, totals)}

    def predict(self, data, batch_size=256):
        """Model outputs for every sample of a dataset (or an array of inputs), as a NumPy array."""
        backend = self.model.backend
        outs = []
        n = len(data)
        for a, b in batch_slices(n, max(batch_size, 1)):
            if hasattr(data, "get_batch"):
                x = data.get_batch(np.arange(a, b), backend.dtype)[0]
            else:
                x = np.asarray(data[a:b], dtype=backend.dtype)
            outs.append(backend.to_numpy(self.model.forward(backend.asarray(x), training=False)))
        return np.concatenate(outs) if outs else np.empty((0,) + self.model.output_shape, backend.dtype)


class _Prefetcher:
    """Batches load(0), load(1), ... load(count - 1), each built one step ahead in a background thread
    (or on demand when not `enabled`). get(step) must be called with step = 0, 1, 2, ... in order."""

    def __init__(self, load, count, enabled=True):
        self.load, self.count, self.enabled = load, count, enabled and count > 1
        self.pool = self.next = None

    def __len__(self):
        return self.count

    def __enter__(self):
        if self.enabled:
            from concurrent.futures import ThreadPoolExecutor

            self.pool = ThreadPoolExecutor(1, thread_name_prefix="pydtnn-data")
            self.next = self.pool.submit(self.load, 0)
        return self

    def get(self, step):
        if not self.enabled:
            return self.load(step)
        batch = self.next.result()  # an error while loading is raised here, in the training thread
        self.next = self.pool.submit(self.load, step + 1) if step + 1 < self.count else None
        return batch

    def __exit__(self, exc_type, *exc):
        if self.pool is not None:
            # after an error, do not wait for a batch nobody will use: the job may be aborting
            self.pool.shutdown(wait=exc_type is None, cancel_futures=True)


class _BatchNormSync:
    """What a synchronized BatchNorm needs: a sum over ranks, and this rank's share of the batch."""

    def __init__(self, comm):
        self.comm, self.weight = comm, 1.0

    def allreduce(self, buf):
        return self.comm.allreduce(buf, "batchnorm")


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

