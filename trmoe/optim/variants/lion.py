"""lion: Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", arXiv:2302.06675) on every
group: the sign of an interpolation of momentum and gradient, one fp32 state per parameter.

    c  = beta1 m + (1 - beta1) g
    w <- w (1 - lr wd) - lr sign(c)
    m <- beta2 m + (1 - beta2) g

torch 2.13 has no torch.optim.Lion, so the rule is here (`lion_class`, defined on first use: this module is
read by the torch-free config layer). Every coordinate moves by lr (or 0 where c = 0): the paper uses an lr
3-10x smaller than AdamW's and a weight decay 3-10x larger, which optimizer.lr / weight_decay set.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from trmoe.config.optimizers import OptimizerVariant, fail


@dataclass
class LionOptions:
    lion_beta1: float = 0.9  # lion: interpolation of momentum and gradient whose sign is the update
    lion_beta2: float = 0.99  # lion: momentum decay of its one state


@functools.cache
def lion_class() -> type:
    """The Lion torch optimizer (group keys: lr, betas, weight_decay)."""
    import torch

    class Lion(torch.optim.Optimizer):
        def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                     weight_decay: float = 0.0):  # fmt: skip
            super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

        @torch.no_grad()
        def step(self, closure=None):
            with torch.enable_grad():
                loss = None if closure is None else closure()
            for group in self.param_groups:
                lr, wd = group["lr"], group["weight_decay"]
                beta1, beta2 = group["betas"]
                for p in [p for p in group["params"] if p.grad is not None]:
                    g, state = p.grad, self.state[p]
                    if "exp_avg" not in state:  # its one state, created at its first step
                        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    m = state["exp_avg"]
                    if wd:
                        p.mul_(1 - lr * wd)
                    p.add_(m.mul(beta1).add_(g, alpha=1 - beta1).sign_(), alpha=-lr)
                    m.mul_(beta2).add_(g, alpha=1 - beta2)
            return loss

    return Lion


def _build(groups, matrix_groups, cfg, device, seed):
    return lion_class()(groups, lr=cfg.lr, betas=(cfg.lion_beta1, cfg.lion_beta2))


def _validate(cfg) -> None:
    for name in ("lion_beta1", "lion_beta2"):
        value = getattr(cfg.optimizer, name)
        if not 0.0 <= value < 1.0:
            fail(name, value, "must be in [0, 1)")


VARIANT = OptimizerVariant(
    "lion", build=_build, options=LionOptions, validate=_validate, state_bytes=4, state="exp_avg", order=3,
    doc="Lion (Chen et al. 2023): the sign of `lion_beta1` momentum + gradient; every coordinate moves by lr",
)  # fmt: skip
