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


def _state_bytes(elementwise: int, matrices: int) -> tuple[int, str]:
    return 4 * elementwise, f"demo_signum: 1 fp32 momentum x {elementwise:,}"


VARIANT = OptimizerVariant(
    name="demo_signum",
    doc="Signum: the sign of a momentum (Bernstein et al. 2018)",
    build=_build,
    state_bytes=_state_bytes,
    options=SignumOptions,
    validate=_validate,
    state="4 B: momentum",
)
