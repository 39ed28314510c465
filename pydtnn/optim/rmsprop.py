"""RMSProp: gradient scaled by a running root-mean-square, optionally centred and with momentum."""

from pydtnn.backends import array_module
from pydtnn.errors import ConfigError
from pydtnn.optim.base import Optimizer, check


class RMSProp(Optimizer):
    """torch.optim.RMSprop with alpha = rho. With d = g + weight_decay * p:

        v_t = rho * v_{t-1} + (1 - rho) * d^2
        m_t = rho * m_{t-1} + (1 - rho) * d                          (if centered)
        s = sqrt(v_t - m_t^2) + eps  if centered,  sqrt(v_t) + eps  otherwise
        b_t = momentum * b_{t-1} + d / s;  p -= lr * b_t            (if momentum > 0)
        p -= lr * d / s                                             (otherwise)

    Slots: square_avg, grad_avg (centered), momentum_buffer (momentum > 0); all start at zero.
    """

    slots = ("square_avg", "grad_avg", "momentum_buffer")

    def __init__(self, params, lr=0.01, rho=0.99, eps=1e-8, momentum=0.0, weight_decay=0.0, centered=False,
                 backend=None):
        super().__init__(
            params, backend, lr=lr, rho=rho, eps=eps, momentum=momentum, weight_decay=weight_decay, centered=centered
        )

    def configure(self, lr, rho, eps, momentum, weight_decay, centered):
        super().configure(lr)
        self.rho = check(self, "rho", rho, 0.0, 1.0)
        self.eps = check(self, "eps", eps, 0.0, lo_open=True)
        self.momentum = check(self, "momentum", momentum, 0.0)
        self.weight_decay = check(self, "weight_decay", weight_decay, 0.0)
        if not isinstance(centered, bool):
            raise ConfigError(f"{self.kind}: centered={centered!r}; expected True or False")
        self.centered = centered

    def hyperparameters(self):
        return {
            **super().hyperparameters(),
            "rho": self.rho,
            "eps": self.eps,
            "momentum": self.momentum,
            "weight_decay": self.weight_decay,
            "centered": self.centered,
        }

    def active_slots(self):
        return ("square_avg",) + (("grad_avg",) if self.centered else ()) + (
            ("momentum_buffer",) if self.momentum > 0 else ()
        )

    def update(self, p, g, state, tmp):
        xp = array_module(p)
        d = g
        if self.weight_decay:
            d = xp.multiply(p, self.weight_decay, out=tmp[0])
            d += g
        v, s = state["square_avg"], tmp[1]
        v *= self.rho
        xp.multiply(d, d, out=s)
        s *= 1 - self.rho
        v += s
        if self.centered:
            m = state["grad_avg"]
            xp.subtract(d, m, out=s)  # m += (1 - rho) * (d - m), torch's lerp
            s *= 1 - self.rho
            m += s
            xp.multiply(m, m, out=s)
            xp.subtract(v, s, out=s)
            xp.sqrt(s, out=s)
        else:
            xp.sqrt(v, out=s)
        s += self.eps
        xp.divide(d, s, out=s)
        if self.momentum:
            b = state["momentum_buffer"]
            b *= self.momentum
            b += s
            s = xp.multiply(b, self.lr, out=s)
        else:
            s *= self.lr
        p -= s
