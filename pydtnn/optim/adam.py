"""Adam and its variants: AdamW (decoupled weight decay) and Nadam (Nesterov momentum)."""

from pydtnn.backends import array_module
from pydtnn.optim.base import Optimizer, check


class Adam(Optimizer):
    """torch.optim.Adam (L2 weight decay coupled to the gradient). With d = g + weight_decay * p:

        m_t = beta1 * m_{t-1} + (1 - beta1) * d
        v_t = beta2 * v_{t-1} + (1 - beta2) * d^2
        p -= lr / (1 - beta1^t) * m_t / (sqrt(v_t) / sqrt(1 - beta2^t) + eps)

    Slots: exp_avg (m), exp_avg_sq (v); both start at zero.
    """

    slots = ("exp_avg", "exp_avg_sq")
    decoupled = False  # AdamW: p *= 1 - lr * weight_decay instead of adding weight_decay * p to g

    def __init__(self, params, lr=0.001, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, backend=None):
        super().__init__(params, backend, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)

    def configure(self, lr, beta1, beta2, eps, weight_decay):
        super().configure(lr)
        self.beta1 = check(self, "beta1", beta1, 0.0, 1.0)
        self.beta2 = check(self, "beta2", beta2, 0.0, 1.0)
        self.eps = check(self, "eps", eps, 0.0, lo_open=True)
        self.weight_decay = check(self, "weight_decay", weight_decay, 0.0)

    def hyperparameters(self):
        return {
            **super().hyperparameters(),
            "beta1": self.beta1,
            "beta2": self.beta2,
            "eps": self.eps,
            "weight_decay": self.weight_decay,
        }

    def update(self, p, g, state, tmp):
        self.backend.adam_update(p, g, state["exp_avg"], state["exp_avg_sq"], tmp, self.lr, self.beta1, self.beta2,
                                 self.eps, self.weight_decay, self.decoupled, self.t)


class AdamW(Adam):
    """torch.optim.AdamW: Adam with decoupled weight decay, applied before the moments:

        p *= 1 - lr * weight_decay;  then Adam's update with d = g.
    """

    decoupled = True

    def __init__(self, params, lr=0.001, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, backend=None):
        super().__init__(params, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, backend=backend)


class Nadam(Adam):
    """torch.optim.NAdam (Dozat 2016 with its momentum schedule). With d = g + weight_decay * p,
    m_t and v_t as in Adam, and

        mu_t = beta1 * (1 - 0.5 * 0.96^(t * momentum_decay)),  P_t = mu_1 * ... * mu_t
        s = sqrt(v_t / (1 - beta2^t)) + eps
        p -= lr * (1 - mu_t) / (1 - P_t) * d / s + lr * mu_{t+1} / (1 - P_t * mu_{t+1}) * m_t / s

    Slots: exp_avg, exp_avg_sq; scalar state: mu_product (P_t).
    """

    def __init__(self, params, lr=0.002, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, momentum_decay=4e-3,
                 backend=None):
        self.mu_product = 1.0
        Optimizer.__init__(
            self, params, backend, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
            momentum_decay=momentum_decay,
        )

    def configure(self, lr, beta1, beta2, eps, weight_decay, momentum_decay):
        super().configure(lr, beta1, beta2, eps, weight_decay)
        self.momentum_decay = check(self, "momentum_decay", momentum_decay, 0.0)

    def hyperparameters(self):
        return {**super().hyperparameters(), "momentum_decay": self.momentum_decay}

    def scalar_state(self):
        return {"mu_product": self.mu_product}

    def set_scalar_state(self, scalars):
        self.mu_product = check(self, "mu_product", scalars["mu_product"], 0.0, 1.0, hi_open=False)

    def begin_step(self):
        mu = self.beta1 * (1.0 - 0.5 * 0.96 ** (self.t * self.momentum_decay))
        mu_next = self.beta1 * (1.0 - 0.5 * 0.96 ** ((self.t + 1) * self.momentum_decay))
        self.mu_product *= mu
        self._grad_scale = self.lr * (1.0 - mu) / (1.0 - self.mu_product)
        self._avg_scale = self.lr * mu_next / (1.0 - self.mu_product * mu_next)
        self._bias_correction2 = 1 - self.beta2**self.t

    def update(self, p, g, state, tmp):
        xp = array_module(p)
        d = self.backend.adam_moments(p, g, state["exp_avg"], state["exp_avg_sq"], tmp, self.lr, self.beta1, self.beta2,
                                      self.weight_decay, self.decoupled)
        s = xp.divide(state["exp_avg_sq"], self._bias_correction2, out=tmp[1])
        xp.sqrt(s, out=s)
        s += self.eps
        u = xp.divide(d, s, out=tmp[0])
        u *= self._grad_scale
        p -= u
        xp.divide(state["exp_avg"], s, out=s)
        s *= self._avg_scale
        p -= s
