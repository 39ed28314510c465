"""One training step on one batch: forward, loss, backward, gradient reduction, optimizer update.

    step = Step(model, loss, optimizer, reducer=reducer, accumulation_steps=2)
    loss, out = step.run(x, y, weight=n / global_batch, streams=SampleStreams(seed, epoch, indices))

The loop (trainer.py) asks a step for nothing but this, so another way to take a step (pipeline stages
with their micro-batches, ZeRO's sharded update) is another class with the same method:

    input_shape, output_shape: the shapes of a sample x and of its outputs (without the batch).
    stages: the processes the model is cut over in a pipeline (1 here).
    predict(x) -> outputs: the model's in evaluation mode (every stage takes part in a pipeline).
    params_sha256() -> the whole model's (every process takes part where it is split).
    run(x, y, weight=1.0, streams=None, read=True, rows=None) -> (loss, outputs)
        x (n, ...), y (n, ...): this rank's share of the global batch, on the device (n >= 1).
        weight: that share, n / global batch (its gradients count that much in the average).
        streams: the share's randomness.SampleStreams (one per row), which dropout draws from, or None.
        read: the loss as a Python float, checked to be finite before the update (TrainingDiverged naming
            the value, the parameters untouched); read=False leaves it a 0-d array on the device,
            unchecked, for pydtnn.readings to read later.
        rows: [(a, b)] the rows of x each micro-batch takes (the Trainer's: this rank's part of each of the
            global batch's micro-batches, sampler.micro_shares); None: micro_bounds(n, micro-batches).
        outputs: the model's outputs (n, ...), for the metrics.

Gradient accumulation is a loop over the same micro_step; reduce_and_update is the one place where
gradients are waited for and applied (DistributedOptimizer.step uses it too).
"""

import math
from contextlib import nullcontext

from pydtnn.errors import ConfigError, TrainingDiverged
from pydtnn.losses import defers
from pydtnn.recompute import passes as recompute_passes

_UNTRACED = nullcontext()  # reusable: a step without a tracer allocates no context per phase


def span(tracer, cat):
    """The tracer's span of category `cat` on the phases' track (tid 1), or a context that does nothing."""
    return _UNTRACED if tracer is None else tracer.span(cat, cat, tid=1)


def reduce_and_update(optimizer, reducer=None, tracer=None, replay=False):
    """Wait for the gradients' reduction (reducer.finish: they are then the weighted average over the ranks),
    then the optimizer's step. replay: first report every gradient ready, after a backward that ran inside
    reducer.no_sync(); then the reducer's after_update. reducer None: the gradients are this process's own (or
    already reduced)."""
    if reducer is not None:
        with span(tracer, "reduce"):
            if replay:
                reducer.replay()
            reducer.finish()
    if reducer is None or reducer.has_update:  # the stale reducer's first step of an epoch has none yet
        with span(tracer, "optimizer"):
            optimizer.step()
    if reducer is not None:
        reducer.after_update(optimizer)  # local SGD's average of the replicas, every so many steps


def micro_bounds(n, micro_batches):
    """[(a, b)]: rows [a, b) of each of a batch of n samples' micro-batches (bounds n i // M), as every step cuts
    it (Step's accumulation, a pipeline's micro-batches, the performance model); empty ones where M > n."""
    bounds = [n * i // micro_batches for i in range(micro_batches + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


class BatchNormSync:
    """What a synchronized BatchNorm needs: a sum over ranks, and this rank's share of the batch in flight."""

    def __init__(self, comm):
        self.comm, self.weight = comm, 1.0

    def allreduce(self, buf):
        return self.comm.allreduce(buf, "batchnorm")


class Step:
    """Forward, loss, backward, reduction and update of a Model on one batch (see the module docstring).

    reducer: an attached gradient reducer (pydtnn.distributed.reducers), or None on one process.
    accumulation_steps: the batch is cut into that many micro-batches, their gradients summed (each
    weighted by its share of the batch), then reduced once and applied once: activations take the memory
    of a micro-batch, the update is that of the whole batch. batchnorm_sync: a BatchNormSync, which every
    layer that computes statistics over the batch (Layer.synchronize) uses from now on, or None.
    tracer: a profiling.Tracer, which gets the forward, loss, backward, reduce and optimizer spans.
    recompute: "none", or "segments" / "all": activations recomputed in backward (pydtnn.recompute).
    """

    def __init__(self, model, loss, optimizer, reducer=None, accumulation_steps=1, batchnorm_sync=None,
                 tracer=None, recompute="none"):
        if int(accumulation_steps) != accumulation_steps or accumulation_steps < 1:
            raise ConfigError(f"accumulation_steps must be a positive integer, got {accumulation_steps!r}")
        self.model, self.loss, self.optimizer, self.reducer = model, loss, optimizer, reducer
        self.accumulation_steps, self.batchnorm_sync, self.tracer = int(accumulation_steps), batchnorm_sync, tracer
        self.backend, self._defers = model.backend, defers(loss)
        self.passes = recompute_passes(model, recompute)
        self._grads = [g for _, g in model.gradients()]
        self._acc = None  # the accumulated gradients, one array per parameter, made at the first accumulated step
        if batchnorm_sync is not None:
            for _, layer in model.layers():
                layer.synchronize(batchnorm_sync)

    stages = 1  # processes the model is cut over (a pipeline's stages)

    @property
    def input_shape(self):
        return self.model.input_shape

    @property
    def output_shape(self):
        return self.model.output_shape

    def predict(self, x):
        """The model's outputs for x (n, ...) in evaluation mode."""
        return self.model.forward(x, training=False)

    def params_sha256(self):
        """The whole model's Model.params_sha256 (a collective where the model is split)."""
        return self.model.params_sha256()

    def run(self, x, y, weight=1.0, streams=None, read=True, rows=None):
        """(loss, outputs) of one step on x (n, ...) against y; see the module docstring."""
        if self.accumulation_steps > 1:
            return self._accumulated(x, y, weight, streams, read, rows)
        if self.reducer is not None:
            self.reducer.begin_step(weight)  # before backward, which starts the reductions
        loss, out = self.micro_step(x, y, weight, streams, read)
        reduce_and_update(self.optimizer, self.reducer, self.tracer)
        return loss, out

    def micro_step(self, x, y, weight, streams, read):
        """Forward, loss and backward of x (m, ...) against y: the layers' grads hold the gradients of this
        batch's mean loss. weight: the batch's share of the global batch (synchronized BatchNorm weighs its
        statistics by it); streams: its samples' streams. Returns (loss, outputs), the loss as in run()."""
        if self.batchnorm_sync is not None:
            self.batchnorm_sync.weight = weight
        with self.backend.sample_streams_for(streams):
            with span(self.tracer, "forward"):
                out = self.passes.forward(x, training=True)
            with span(self.tracer, "loss"):
                loss = self._loss(out, y, read)
                dy = self.loss.backward()
            with span(self.tracer, "backward"):
                self.passes.backward(dy)
        return loss, out

    def _loss(self, out, y, read):
        """The batch's mean loss: a float checked to be finite, or (read=False) a 0-d device array."""
        if read or not self._defers:
            loss = self.loss.forward(out, y)
            if not math.isfinite(loss):
                raise TrainingDiverged(f"loss is {loss}")
            return loss
        return self.loss.value(out, y)

    def _accumulated(self, x, y, weight, streams, read, rows=None):
        """run() over `accumulation_steps` micro-batches: rows [a, b) each (`rows`, else micro_bounds), with the
        streams of their rows."""
        n, xp, grads = x.shape[0], self.backend.xp, self._grads
        if self._acc is None:
            self._acc = [xp.zeros_like(g) for g in grads]
        own_rows = streams is not None and len(streams) == n
        total, outs = 0.0, []
        with nullcontext() if self.reducer is None else self.reducer.no_sync():  # one reduction, after the loop
            for a, b in rows or micro_bounds(n, self.accumulation_steps):
                if a == b:
                    continue
                loss, out = self.micro_step(x[a:b], y[a:b], weight * (b - a) / n,
                                            streams.rows(None, a, b) if own_rows else streams, read)
                share = (b - a) / n
                for acc, g in zip(self._acc, grads):
                    if a == 0:
                        xp.multiply(g, share, out=acc)
                    else:
                        acc += xp.multiply(g, share, out=g)  # g is rewritten by the next backward
                if not read:  # in float64, as a Python float adds up when the loss is read
                    loss = xp.asarray(loss, dtype=xp.float64)
                total += loss * share
                outs.append(out)
        for acc, g in zip(self._acc, grads):
            g[...] = acc
        if self.reducer is not None:
            self.reducer.begin_step(weight)
        reduce_and_update(self.optimizer, self.reducer, self.tracer, replay=True)
        return total, xp.concatenate(outs)
