"""optimizer=demo_signum: Signum (Bernstein et al. 2018), the sign of a momentum, with decoupled decay.

    m <- beta m + (1 - beta) g
    w <- w (1 - lr wd) - lr sign(m)

trmoe reads this module when it builds its config schema, before any run needs torch: torch is imported
inside `_build` (through `_signum`), never at module level.
"""

from __future__ import annotations

from dataclasses import dataclass

from trmoe.config.optimizers import OptimizerVariant, fail


@dataclass
class SignumOptions:
    signum_momentum: float = 0.9  # demo_signum: beta, the momentum whose sign is the update


def _build(groups, matrix_groups, cfg, device, seed):
    from trmoe_demo_plugins._signum import Signum

    return Signum(groups, lr=cfg.lr, momentum=cfg.signum_momentum)


def _validate(cfg) -> None:
    if not 0.0 <= cfg.optimizer.signum_momentum < 1.0:
        fail("signum_momentum", cfg.optimizer.signum_momentum, "must be in [0, 1)")


VARIANT = OptimizerVariant(
    "demo_signum",
    build=_build,
    options=SignumOptions,
    validate=_validate,
    state_bytes=4,  # one fp32 momentum per parameter: the planner's memory line
    state="momentum",
    doc="Signum: the sign of a momentum (Bernstein et al. 2018)",
)
