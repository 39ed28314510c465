"""The training loop: epochs of batches, each one Step (forward, loss, backward, reduce, update), then callbacks.

    trainer = Trainer(model, SoftmaxCrossEntropy(), SGD(model.parameters(), lr=0.05, momentum=0.9))
    history = trainer.fit(train, epochs=5, batch_size=64, val=val, test=test)
    trainer.evaluate(test)            # {"loss": ..., "accuracy": ...}
    trainer.predict(test)             # (N, num_classes) outputs

The loop is here (fit, epochs, schedules, callbacks, evaluate, predict); one step on one batch is
pydtnn.step, reading the loss and metrics back from the device is pydtnn.readings, and what a run reports
(progress, epoch lines, the metrics file whose format is a public contract) is pydtnn.progress.
"""

import time
from contextlib import nullcontext

import numpy as np

from pydtnn import metrics as metric_fns
from pydtnn import runtime
from pydtnn.data.dataset import batch_slices, epoch_order
from pydtnn.data.workers import BatchWorkers, check_workers
from pydtnn.errors import ConfigError, DataError, TrainingDiverged
from pydtnn.losses import check_host_targets, defers, targets_checked_on_host
from pydtnn.optim.schedules import learning_rate
from pydtnn.progress import MetricsFile, Reporting, format_record
from pydtnn.randomness import SampleStreams
from pydtnn.readings import Readings, diverged, settle
from pydtnn.step import BatchNormSync, Step, span


class Trainer:
    """Trainer for a Model, a loss and an optimizer, on one process or data-parallel over many.

    Every option is a keyword, given at construction, and is not replaced afterwards (restore() continues
    an earlier run; a callback may set stop_training). metrics: names from pydtnn.metrics reported besides
    the loss. seed: drives the per-epoch sample order (a pure function of (seed, epoch), so runs are
    reproducible and resumable). schedules: pydtnn.optim.schedules objects; the learning rate of each step
    is optimizer.lr at construction times their factors.
    callbacks: objects with any of on_train_begin(trainer), on_epoch_begin(trainer, epoch),
    on_batch_end(trainer, step, logs), on_epoch_end(trainer, epoch, logs) (see pydtnn.callbacks); setting
    trainer.stop_training = True ends fit after the epoch.

    Data parallelism: pass a communicator (pydtnn.distributed.launch.init()) and a reducer
    (pydtnn.distributed.reducers.create(...)). batch_size is then per process: each step takes a
    global batch of batch_size * world_size samples and gives each rank its share. Metrics are
    reduced once per epoch; only rank 0 shows progress and writes files. With model parallelism
    (pydtnn.distributed.model_parallel) comm is the data-parallel communicator, whose ranks are the
    model replicas, and is_root says which process of all shows progress and writes files.
    sync_batchnorm: BatchNorm statistics over the global batch (all ranks) instead of each rank's share:
    two small allreduces per BatchNorm layer and step (forward and backward), and N processes compute
    what one process computes on the same global batch, BatchNorm included.

    accumulation_steps: each step's batch in that many micro-batches, one reduction and one update
    (pydtnn.step.Step). recompute: "none", "segments" or "all": activations kept only at segment inputs
    and recomputed in backward (pydtnn.recompute). step: another way to take a step, with Step's run(),
    predict(), params_sha256(), input_shape, output_shape and stages (a pipeline stage's,
    pydtnn.distributed.pipeline.PipelineStep), in place of the Step made of the arguments above. tracer: a profiling.Tracer for the spans of data, forward, loss, backward,
    reduce, optimizer and each step (model.set_tracer adds the layers' own).

    prefetch: assemble the next training batch (read, decode, augment) in a background thread while
    the current step computes. Batches depend only on (seed, epoch, step, rank), so the result is
    the same either way; the "data" span of a trace then shows only the wait that was not hidden.
    data_workers: threads that assemble each batch, every one a share of its samples (pydtnn.data.workers);
    the batches are the same, to the bit, for any number.
    sync_every: steps between reads of the loss and metrics (pydtnn.readings; see steps_between_reads).

    progress, epoch_lines, progress_every, metrics_file, log: what the root process reports, and where
    (pydtnn.progress.Reporting).

    The process-wide settings (CPU threads, BLAS threads, malloc; pydtnn.runtime) are configured with
    their defaults unless pydtnn.runtime.configure has run already.
    """

    SYNC_EVERY_DEVICE = 32  # steps between reads of the loss and metrics when they live on a GPU

    def __init__(self, model, loss, optimizer, *, metrics=("accuracy",), seed=0, schedules=(), callbacks=(),
                 comm=None, reducer=None, sync_batchnorm=False, accumulation_steps=1, tracer=None, prefetch=True,
                 sync_every=None, progress=True, epoch_lines=None, progress_every=10.0, metrics_file=None, log=None,
                 is_root=None, step=None, recompute="none", data_workers=1):
        runtime.ensure_configured()
        if sync_every is not None and (int(sync_every) != sync_every or sync_every < 1):
            raise ConfigError(f"sync_every must be a positive integer, got {sync_every!r}")
        self.model, self.loss, self.optimizer = model, loss, optimizer
        self.metric_names = tuple(dict.fromkeys(metric_fns.canonical(m) for m in metrics))
        self.metric_fns = {m: metric_fns.get(m) for m in self.metric_names}
        self.seed, self.schedules, self.callbacks = seed, list(schedules), list(callbacks)
        self.base_lr = optimizer.lr
        if comm is None:
            from pydtnn.distributed.comm import SingleProcess

            comm = SingleProcess()
        self.comm, self.world_size = comm, comm.size
        self.is_root = comm.rank == 0 if is_root is None else bool(is_root)
        self.report = Reporting(progress, epoch_lines, metrics_file, log, progress_every, self.is_root)
        self.log = self.report.log
        self.reducer = reducer.attach(model) if reducer is not None else None
        self.step = step if step is not None else Step(model, loss, optimizer, self.reducer, accumulation_steps,
                                                       BatchNormSync(comm) if sync_batchnorm else None, tracer,
                                                       recompute)
        self._tracer = tracer
        self.prefetch = prefetch
        self.data_workers = check_workers(data_workers)
        self.sync_every = sync_every  # None: 1 where arrays are on the host, SYNC_EVERY_DEVICE on a GPU
        self.history = []
        self.stop_training = False

    @property
    def tracer(self):
        """The profiling.Tracer given at construction, or None."""
        return self._tracer

    @property
    def accumulation_steps(self):
        """Micro-batches per step, as given at construction."""
        return self.step.accumulation_steps

    def restore(self, history, base_lr):
        """Continue an earlier run (pydtnn.resume): the records of its completed epochs, and its base learning
        rate, which the optimizer takes now (schedules scale it from there)."""
        self.history = list(history)
        self.base_lr = self.optimizer.lr = base_lr

    def layout(self):
        """{"world_size": processes of the job, "replicas": model replicas (data parallelism), "model_parallel_size":
        processes each replica is split over}: the layout as the final record names it."""
        group = self.model.sharding.group.size if self.model.sharding is not None else 1
        out = {"world_size": self.world_size * group * self.step.stages, "replicas": self.world_size,
               "model_parallel_size": group}
        if self.step.stages > 1:
            out["pipeline_stages"] = self.step.stages
        return out

    def train_step(self, x, y, weight=1.0, read=True):
        """Forward, loss, backward, gradient reduction and update on one batch (pydtnn.step). Returns (loss, outputs).

        weight: this rank's share of the global batch (its gradients count that much in the average).
        read: the loss as a Python float, checked to be finite before the update (TrainingDiverged); with
        read=False it is a 0-d array left on the device, unchecked (fit reads it later). Dropout draws from
        the backend's Generator here; fit gives it each sample's stream.
        """
        return self.step.run(x, y, weight, None, read)

    # -- loops ---------------------------------------------------------------------------
    def fit(self, train, epochs=1, batch_size=64, val=None, test=None, steps_per_epoch=None, start_epoch=0,
            drop_last=False):
        """Train for `epochs` epochs; evaluate on val after each and on test at the end.

        Returns the history: one dict per epoch with loss, metrics, val_* (None without val), lr,
        time_s and samples_per_second (training samples over training time, validation excluded), and with a
        sparse reducer (topk, oktopk) sent_bytes_per_step, the bytes this process sent per step.
        The final record (test_*, wall time, params_sha256) is left in `self.final`.
        """
        if batch_size < 1:
            raise ConfigError(f"batch_size must be a positive integer, got {batch_size}")
        self._check_data(train, val, test, batch_size, drop_last, steps_per_epoch)
        self.epochs, self.stop_training = epochs, False
        self._callback("on_train_begin")
        writer = MetricsFile(self.report.metrics_file) if self.report.metrics_file else None
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
                if self.reducer is not None:  # local SGD averages what its replicas hold apart
                    self.reducer.end_epoch(self.optimizer)
                    if self.reducer.epoch_sent() is not None:  # the sparse reducers count their bytes
                        record["sent_bytes_per_step"] = self.reducer.epoch_sent()
                self._average_buffers()  # before validation, so every rank evaluates the same model
                record.update(self.evaluate_as("val", val, batch_size))
                record["lr"] = getattr(self.optimizer, "lr", None)
                record["time_s"] = time.perf_counter() - t0
                record["samples_per_second"] = seen / t_train if t_train > 0 else None
                self.history.append(record)
                if writer:
                    writer.write(record)
                if self.report.epoch_lines:
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
            self.final["params_sha256"] = self.step.params_sha256()
            if writer:
                writer.write(self.final)
            return self.history
        finally:
            if writer:
                writer.close()

    def _check_data(self, train, val, test, batch_size, drop_last, steps_per_epoch=None):
        """Refuse, before an epoch is spent, data that would train on nothing or fail at the end."""
        if len(train) == 0:
            raise DataError(f"the training set {getattr(train, 'name', '')} is empty; expected at least one sample")
        if not batch_slices(len(train), batch_size * self.world_size, drop_last):
            raise ConfigError(f"drop_last with a global batch of {batch_size * self.world_size} samples "
                              f"({batch_size} per process x {self.world_size}) leaves no batch of the {len(train)} "
                              f"training samples; use a smaller batch or drop_last false")
        self._check_synchronized_micro_batches(len(train), batch_size, drop_last, steps_per_epoch)
        want = tuple(self.step.input_shape)
        for what, data in (("training", train), ("validation", val), ("test", test)):
            shape = getattr(data, "input_shape", None)
            if shape is not None and tuple(shape) != want:
                raise DataError(f"the {what} set {getattr(data, 'name', '')} has samples of shape "
                                f"{tuple(shape)}; the model takes {want}")

    def _check_synchronized_micro_batches(self, n, batch_size, drop_last, steps_per_epoch=None):
        """ConfigError where synchronized BatchNorm or ZeRO stage 3 would hang: its statistics, or the layers'
        gathers of their parameters, are collectives in every micro-batch, so every replica must run every
        micro-batch, and a replica's share of a global batch (the last, smaller one) must hold at least one sample
        per micro-batch."""
        m = self.step.accumulation_steps
        what = ("--sync_batchnorm" if getattr(self.step, "batchnorm_sync", None) is not None else
                "--zero 3" if self.model.param_shards is not None else None)
        if what is None or m == 1 or self.world_size == 1:
            return
        from pydtnn.distributed.sampler import micro_shares

        for a, b in batch_slices(n, batch_size * self.world_size, drop_last)[:steps_per_epoch]:
            least = min(hi - lo for r in range(self.world_size) for *_, lo, hi in micro_shares(b - a, m,
                                                                                               self.world_size, r))
            if least < 1:
                raise ConfigError(f"{what} with --micro_batches {m}: the global batch of {b - a} samples "
                                  f"(the last of {n}) leaves a replica no sample of a micro-batch, and every "
                                  f"replica must run every micro-batch; use --drop_last true, or a batch or "
                                  f"micro-batch count that gives each micro-batch at least {self.world_size} "
                                  f"samples (a global batch of at least {m * self.world_size})")

    def _train_epoch(self, train, epoch, epochs, batch_size, steps_per_epoch, drop_last=False):
        """One pass over the epoch's global batches; returns ({"epoch", "loss", metrics...}, samples seen).

        Every rank walks the same global batches (the order is a function of seed and epoch) and
        takes its own share of each, so all ranks issue the same collectives even when the last
        batch is smaller than the world; an empty share computes on one sample with weight 0.
        """
        from pydtnn.distributed.sampler import local_rows, micro_shares

        backend, rank, size = self.model.backend, self.comm.rank, self.world_size
        order = epoch_order(len(train), self.seed, epoch)
        slices = batch_slices(len(train), batch_size * size, drop_last)[:steps_per_epoch]
        shares = []  # (indices of this rank's samples, n, the rows of its micro-batches) per step
        for a, b in slices:  # the global batch by sample index, cut into micro-batches; this rank's part of each
            taken, parts = order[a:b], micro_shares(b - a, self.step.accumulation_steps, size, rank)
            row_of = np.empty(b - a, np.int64)
            row_of[np.argsort(taken, kind="stable")] = np.arange(b - a)  # each sample's row in the sorted batch
            idx = np.concatenate([np.sort(taken[(row_of >= mb0) & (row_of < mb1)][lo:hi])
                                  for mb0, mb1, lo, hi in parts])  # its part, the micro-batch in the epoch's order
            shares.append((idx, len(idx), local_rows(parts)) if len(idx) else (order[a : a + 1], 0, None))

        def load(step):
            idx = shares[step][0]
            return workers.get_batch(train, idx, backend.dtype, rng=SampleStreams(self.seed, epoch, idx))

        bar, lines = self.report.bar(slices, epoch, epochs), self.report.lines(slices, epoch, epochs)
        self.model.train()
        if self.reducer is not None:
            self.reducer.begin_epoch(epoch)
        every = self.steps_between_reads()
        readings = Readings(self.metric_fns, backend, every, self.reducer, epoch, *self._last_and_rank())
        with BatchWorkers(self.data_workers) as workers, _Prefetcher(load, len(slices), self.prefetch) as batches:
            for step, (a, b) in enumerate(bar):
                indices, n, rows = shares[step]
                loss, out, y = self._train_batch(batches, step, epoch, indices, n / (b - a), rows, read=every == 1)
                if readings.add(loss, out, y, n, step, last=step == len(slices) - 1) and readings.seen:
                    bar.set_postfix({k: f"{v / readings.seen:.4f}" for k, v in readings.sums.items()}, refresh=False)
                if lines is not None:
                    lines.step_done(step, readings.mean())
                self._callback("on_batch_end", step, None)
        bar.close()
        means, seen = readings.totals(self.comm)  # one reduction per epoch
        record = metric_fns.with_perplexity({"epoch": epoch + 1, **means})
        record.setdefault("accuracy", None)
        return record, seen

    def steps_between_reads(self):
        """How often fit reads the loss and metrics back and checks the loss is finite: sync_every, or by
        default every step where arrays are on the host (reading is free) and every SYNC_EVERY_DEVICE
        steps on a GPU, where each read makes the host wait for the device."""
        if self.sync_every is not None:
            return self.sync_every
        return 1 if self.model.backend.xp is np else self.SYNC_EVERY_DEVICE

    def _last_and_rank(self):
        """What a divergence names besides its step: the last completed epoch's record (None before one) and
        this rank (None on one process)."""
        return (self.history[-1] if self.history else None), (self.comm.rank if self.world_size > 1 else None)

    def _train_batch(self, batches, step, epoch, indices, weight, rows=None, read=True):
        """One step of _train_epoch: batch `step`, this rank's dataset rows `indices`, `weight` of the global
        batch, its micro-batches' `rows` (None: the step's own cut). Returns (loss, outputs, targets). read=False leaves the loss on the device (a 0-d array, for
        Readings); the labels are then checked on the host here, before they are copied."""
        backend = self.model.backend
        if self.schedules:
            self.optimizer.lr = learning_rate(self.base_lr, self.schedules, epoch, step, len(batches))
        t_step = time.perf_counter_ns()
        with span(self._tracer, "data"):
            x, y = batches.get(step)
            if not read:  # the values are checked here, on the host, and not read again on the device
                check_host_targets(self.loss, y, self.step.output_shape)
            x, y = backend.batch_to_device(x, y)  # a GPU copies them while it computes the step before
        # dropout masks from each sample's stream (pydtnn.randomness): the same at any process count, nothing
        # to checkpoint; the Generator, reseeded per step and rank, serves only layers outside a Model
        backend.reseed([self.seed, epoch, step, self.comm.rank, 1])
        if read:
            settle(self.reducer)  # the last step's reductions, before this step reads its loss
        try:
            with nullcontext() if read else targets_checked_on_host():
                loss, out = self.step.run(x, y, weight, SampleStreams(self.seed, epoch, indices), read, rows)
        except TrainingDiverged as e:
            raise diverged(str(e), epoch, step, "parameters keep the values of the step before",
                           *self._last_and_rank()) from None
        if self._tracer is not None:
            self._tracer.add(f"step {step + 1}", "step", t_step, time.perf_counter_ns(), tid=0, epoch=epoch + 1)
        return loss, out, y

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
        keys += ("perplexity",) if "bits_per_token" in keys else ()
        values = metric_fns.with_perplexity(self.evaluate(data, batch_size)) if data is not None else {}
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
        size = max(batch_size, 1)
        most = max(len(batch_slices(b - a, size)) for a, b in zip(bounds[:-1], bounds[1:]))
        self.model.eval()
        # read every batch, or (on a GPU; sync_every > 1) the sums stay on the device in float64, read once
        read = self.steps_between_reads() == 1 or not defers(self.loss)
        readings = Readings(self.metric_fns, backend, every=1 if read else None)
        try:
            with BatchWorkers(self.data_workers) as workers:
                for a, b in batch_slices(last - first, max(batch_size, 1)):
                    x, y = workers.get_batch(data, np.arange(first + a, first + b), backend.dtype)
                    if not read:
                        check_host_targets(self.loss, y, self.step.output_shape)
                    x, y = backend.batch_to_device(x, y)
                    out = self.step.predict(x)
                    with nullcontext() if read else targets_checked_on_host():
                        loss = self.loss.forward(out, y) if read else self.loss.value(out, y)
                    readings.add(loss, out, y, b - a)
                if self.model.param_shards is not None:  # ZeRO 3: every replica gathers as often as the others
                    blank = backend.asarray(np.zeros((1, *self.step.input_shape), backend.dtype))
                    for _ in range(most - len(batch_slices(last - first, size))):
                        self.step.predict(blank)
        finally:
            self.model.training = was_training
        return readings.totals(self.comm)[0]

    def predict(self, data, batch_size=256):
        """Model outputs for every sample of a dataset (or an array of inputs), as a NumPy array. Where ZeRO stage 3
        shards the parameters, every replica calls it with as many samples (its forwards gather them)."""
        backend = self.model.backend
        outs = []
        n = len(data)
        for a, b in batch_slices(n, max(batch_size, 1)):
            if hasattr(data, "get_batch"):
                x = data.get_batch(np.arange(a, b), backend.dtype)[0]
            else:
                x = np.asarray(data[a:b], dtype=backend.dtype)
            outs.append(backend.to_numpy(self.step.predict(backend.asarray(x))))
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
