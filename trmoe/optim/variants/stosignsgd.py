"""stosignsgd: stochastic-sign SGD with momentum on every group (trmoe.optim.stosignsgd,
docs/optimizers.md)."""

from __future__ import annotations

from dataclasses import dataclass

from trmoe.config.optimizers import OptimizerVariant, fail


@dataclass
class StoSignOptions:
    stosign_max_decay: float = 1.0  # stosignsgd: d in G <- max(d * G, |m|); 1 = a running maximum


def _build(groups, matrix_groups, cfg, device, seed):
    from trmoe.optim.stosignsgd import StoSignSGD

    return StoSignSGD(groups, lr=cfg.lr, beta=cfg.beta1, max_decay=cfg.stosign_max_decay, seed=seed)


def _validate(cfg) -> None:
    o = cfg.optimizer
    if not 0.0 < o.stosign_max_decay <= 1.0:
        fail("stosign_max_decay", o.stosign_max_decay, "must be in (0, 1]")


VARIANT = OptimizerVariant(
    "stosignsgd", build=_build, options=StoSignOptions, validate=_validate, order=2,
    state_bytes=8, state="exp_avg, max_scale",
    doc="momentum (`beta1`), then an unbiased stochastic sign: every coordinate moves by lr",
)  # fmt: skip
