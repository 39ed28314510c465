"""Stochastic gradient descent with optional momentum, Nesterov momentum and L2 weight decay."""

from pydtnn.errors import ConfigError
from pydtnn.optim.base import Optimizer, check


class SGD(Optimizer):
    """torch.optim.SGD. With d = g + weight_decay * p:

        b_1 = d,  b_t = momentum * b_{t-1} + (1 - dampening) * d       (if momentum > 0)
        u = d + momentum * b_t  if nesterov,  b_t  if momentum > 0,  d  otherwise
        p -= lr * u

    Slot: momentum_buffer (only with momentum > 0).
    """

    slots = ("momentum_buffer",)

    def __init__(self, params, lr=0.01, momentum=0.0, nesterov=False, weight_decay=0.0, dampening=0.0, backend=None):
        super().__init__(
            params, backend, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, dampening=dampening
        )

    def configure(self, lr, momentum, nesterov, weight_decay, dampening):
        super().configure(lr)
        self.momentum = check(self, "momentum", momentum, 0.0)
        self.weight_decay = check(self, "weight_decay", weight_decay, 0.0)
        self.dampening = check(self, "dampening", dampening, 0.0, 1.0, hi_open=False)
        if not isinstance(nesterov, bool):
            raise ConfigError(f"{self.kind}: nesterov={nesterov!r}; expected True or False")
        if nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ConfigError(
                f"{self.kind}: nesterov=True needs momentum > 0 and dampening = 0, "
                f"got momentum={momentum!r}, dampening={dampening!r}"
            )
        self.nesterov = nesterov

    def hyperparameters(self):
        return {
            **super().hyperparameters(),
            "momentum": self.momentum,
            "nesterov": self.nesterov,
            "weight_decay": self.weight_decay,
            "dampening": self.dampening,
        }

    def active_slots(self):
        return self.slots if self.momentum > 0 else ()

    def update(self, p, g, state, tmp):
        self.backend.sgd_update(p, g, state.get("momentum_buffer"), tmp, self.lr, self.weight_decay, self.momentum,
                                self.dampening, self.nesterov, self.t == 1)
