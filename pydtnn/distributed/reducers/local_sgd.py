"""Local SGD: every process steps on its own gradients, and every `every` steps the processes average their
parameters and their optimizer's state (Stich 2019; post-local SGD, Lin et al. 2020, as PyTorch's
PostLocalSGDOptimizer runs it; PyDTNN's --model-sync-freq).

    finish()                 the first post_local steps: the gradients summed over the processes, as the
                             blocking reducer sums them (data parallelism); after them, nothing: each process
                             keeps the mean gradient of its own samples
    after_update(optimizer)  after step post_local + k every (and at the end of every epoch, so that evaluation
                             and checkpoints see one model): one allreduce of [the parameters | every array of
                             the optimizer's state (momentum, Adam's moments)], each process's copy weighted by
                             1 / P ("plain") or by the mean of its shares of the global batches since the last
                             average ("weighted")

With every = 1 and weighted averages this is data parallelism for SGD, with or without momentum: the average of
the processes' updates from one point is the update by the average gradient, and the momentum buffers are linear
in the gradients (tested: np 2 and 3 equal one process). Adam's second moments average the squares of the
processes' gradients instead of squaring their average, so for Adam it is not. BatchNorm's running statistics are
averaged at the end of each epoch, as under data parallelism. Nothing is kept between epochs, so a checkpoint
needs no state of its own; the step count that decides the start of the local steps is the optimizer's.
"""

from pydtnn.backends import array_module
from pydtnn.distributed.reducers.base import flat_buffer
from pydtnn.distributed.reducers.blocking import BlockingReducer
from pydtnn.errors import ConfigError

AVERAGES = ("plain", "weighted")


class LocalSGDReducer(BlockingReducer):
    name = "local_sgd"

    def __init__(self, comm, every=4, average="plain", post_local=0, compression="none", progress="test"):
        if int(every) != every or every < 1:
            raise ConfigError(f"local SGD: average every whole number >= 1 of steps, got {every!r}")
        if average not in AVERAGES:
            raise ConfigError(f"local SGD average {average!r}; expected one of {', '.join(AVERAGES)}")
        if int(post_local) != post_local or post_local < 0:
            raise ConfigError(f"local SGD: post_local must be a whole number of steps >= 0, got {post_local!r}")
        super().__init__(comm, compression, progress)
        self.every, self.average, self.post_local = int(every), average, int(post_local)
        self.step, self.since, self.share = 0, 0, 0.0  # steps done; local steps since the last average; their weights
        self.messages = None  # the average's buffers, made at the first (the optimizer's state exists by then)

    def attach(self, model):
        self.model = model
        return super().attach(model)

    def resume_at(self, step):
        self.step = int(step)

    def finish(self):
        if self.step < self.post_local:
            super().finish()
        elif self.weight == 0:  # an empty share (a last batch smaller than the processes) computed a stand-in
            for _, g in self.gradients:  # sample, which data parallelism weights by 0: here it moves nothing
                g[...] = 0
        self.order_done = True

    def after_update(self, optimizer):
        self.step += 1
        if self.step <= self.post_local:
            return
        self.since, self.share = self.since + 1, self.share + self.weight
        if self.since == self.every:
            self.synchronize(optimizer)

    def end_epoch(self, optimizer):
        if self.since:
            self.synchronize(optimizer)

    def synchronize(self, optimizer):
        """Average the parameters and the optimizer's state arrays over the processes (see the module's docstring)."""
        if self.messages is None:  # [(the arrays of one dtype, their buffer, its views)]: one message each
            arrays = [p for _, p, _ in self.model.parameters()]
            arrays += [a for a in optimizer.state_dict()["arrays"].values() if a.dtype.kind == "f"]
            self.messages = [(same, *flat_buffer(same)) for same in
                             ([a for a in arrays if a.dtype.str == d] for d in sorted({a.dtype.str for a in arrays}))]
        factor = 1.0 / self.comm.size if self.average == "plain" else self.share / self.since
        for same, buf, views in self.messages:
            for v, a in zip(views, same):
                array_module(buf).multiply(a, a.dtype.type(factor), out=v)
            self._reduce(buf, "local SGD average")
            for v, a in zip(views, same):
                a[...] = v
        self.since, self.share = 0, 0.0
