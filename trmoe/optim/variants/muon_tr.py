"""muon_tr: Muon on the matrices of optimizer.muon_scope, AdamW on the rest (trmoe.optim.muon,
docs/optimizers.md)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from trmoe.config.optimizers import OptimizerVariant, fail


class MuonScope(str, Enum):
    experts = "experts"  # the routed expert matrices only
    experts_shared = "experts_shared"  # routed experts and the shared expert
    all = "all"  # every matrix except the tied embedding


@dataclass
class MuonOptions:
    muon_scope: MuonScope = MuonScope.experts  # muon_tr: matrices on Muon: experts | experts_shared | all
    muon_lr_scale: float = 1.0  # muon_tr: lr multiplier of the Muon groups (times expert/shared lr scales)
    muon_momentum: float = 0.95  # muon_tr: momentum beta of the Muon buffer
    muon_nesterov: bool = True  # muon_tr: orthogonalise the Nesterov look-ahead instead of the buffer
    muon_ns_steps: int = 5  # muon_tr: Newton-Schulz iterations per orthogonalisation
    muon_update_rms: float = 0.2  # muon_tr: RMS each orthogonalised update is scaled to (~AdamW's)
    muon_split_gate_up: bool = True  # muon_tr: orthogonalise the gate and up halves of fused w_in separately


def _build(groups, matrix_groups, cfg, device, seed):
    from trmoe.optim.build import OptimizerSet
    from trmoe.optim.muon import Muon
    from trmoe.optim.variants.adamw import adamw

    muon = Muon(
        matrix_groups,
        lr=cfg.lr,
        momentum=cfg.muon_momentum,
        nesterov=cfg.muon_nesterov,
        ns_steps=cfg.muon_ns_steps,
        update_rms=cfg.muon_update_rms,
    )
    return OptimizerSet(muon=muon, adamw=adamw(groups, cfg, device))


def _validate(cfg) -> None:
    o = cfg.optimizer
    if not 0.0 <= o.muon_momentum < 1.0:
        fail("muon_momentum", o.muon_momentum, "must be in [0, 1)")
    if o.muon_ns_steps < 1:
        fail("muon_ns_steps", o.muon_ns_steps, "must be a positive integer")
    if o.muon_update_rms <= 0:
        fail("muon_update_rms", o.muon_update_rms, "must be > 0")
    if o.muon_lr_scale < 0:
        fail("muon_lr_scale", o.muon_lr_scale, "must be >= 0")
    if o.muon_scope == MuonScope.experts and cfg.model.routed_width == 0:
        fail("muon_scope", "experts", "the model has no routed experts; allowed: experts_shared, all")


VARIANT = OptimizerVariant(
    "muon_tr", build=_build, options=MuonOptions, validate=_validate, order=1, matrix_groups=True,
    matrix_state_bytes=4, state_bytes=8, state="Muon: momentum; AdamW: exp_avg, exp_avg_sq",
    doc="Muon (orthogonalised momentum, per expert and per gate/up half) on the matrices of `muon_scope`, "
    "AdamW on the rest",
)  # fmt: skip
