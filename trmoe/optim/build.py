"""Building the optimizer of optimizer.name: its parameter groups here, the rest from its variant (one module
of trmoe/optim/variants, or a plug-in: trmoe.config.optimizers). Update rules: docs/optimizers.md.

Parameters fall in three roles: routed experts (w_in, w_out and the routed gate), shared expert (its
matrices and gate) and base (embedding, attention, norms; and the routed gate with
optimizer.routed_gate_group=base, where the old runner put it). Each role has its own lr scale and weight
decay. Only matrices are decayed: norms, gates and other 1-D/0-D tensors never are, and the tied
embedding only when optimizer.decay_embedding is set.

Every group carries `name` and `base_lr`; the one global schedule sets lr = base_lr * multiplier on all
of them (trmoe.optim.schedule.apply_lr).

model.parametrization=mup (trmoe.model.mup): a hidden matrix whose fan-in grew m-fold over the base shape
gets lr / m and weight_decay * m (lr * wd unchanged), in its own group named `<role>..._mup<m>`. Every
built-in optimizer takes the same factors: AdamW's, StoSignSGD's and Lion's updates are ~lr per entry
whatever the gradient's scale, and Muon's update is rescaled to the element RMS muon_update_rms, AdamW's
(docs/mup.md).

No optimizer here keeps a warmup or decay of its own, and none
communicates across ranks: under DDP every rank sees the same averaged gradients and applies the same
per-parameter math.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trmoe.config.optimizers import OPTIMIZERS
from trmoe.config.schema import Config, GateGroup, OptimizerConfig
from trmoe.model.mup import fan_in_mult


def param_group_name(name: str, routed_gate_group: GateGroup = GateGroup.expert) -> str:
    """'expert', 'shared' or 'base' from a parameter's name in TRMoETransformer."""
    if name.endswith("ffn.routed_gate"):
        return routed_gate_group.value
    if ".ffn.routed." in name:
        return "expert"
    if ".ffn.shared." in name or name.endswith("ffn.shared_gate"):
        return "shared"
    return "base"


def _role_settings(cfg: OptimizerConfig) -> tuple[dict[str, float], dict[str, float]]:
    scales = {"expert": cfg.expert_lr_scale, "shared": cfg.shared_lr_scale, "base": 1.0}
    decays = {
        "expert": cfg.weight_decay if cfg.expert_weight_decay is None else cfg.expert_weight_decay,
        "shared": cfg.weight_decay if cfg.shared_weight_decay is None else cfg.shared_weight_decay,
        "base": cfg.weight_decay,
    }
    return scales, decays


def _on_muon(name: str, p: nn.Parameter, role: str, scope: str) -> bool:
    # scope: optimizer.muon_scope (trmoe.optim.variants.muon_tr.MuonScope, a str enum; that module builds
    # its OptimizerSet from here, so this one compares the values)
    if p.ndim < 2 or name == "embed.weight":
        return False
    if scope == "all":
        return True
    if role == "expert":
        return True
    return role == "shared" and scope == "experts_shared"


def param_groups(model: nn.Module, cfg: OptimizerConfig) -> list[dict]:
    """The element-wise groups of every trainable parameter (adamw, stosignsgd, lion)."""
    return split_param_groups(model, cfg, muon=False)[0]


def split_param_groups(model: nn.Module, cfg: OptimizerConfig, muon: bool) -> tuple[list[dict], list[dict]]:
    """(element-wise groups, Muon groups). The Muon list is empty unless `muon`: then the matrices of
    optimizer.muon_scope go there, split by role and by whether they are a fused [gate | up] w_in."""
    scales, decays = _role_settings(cfg)
    spec = _spec_of(model)
    buckets: dict[tuple[str, bool, float], list[nn.Parameter]] = {}
    muon_buckets: dict[tuple[str, bool, float], list[nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        role = param_group_name(name, cfg.routed_gate_group)
        mult = 1.0 if spec is None else fan_in_mult(name, spec)
        if muon and _on_muon(name, p, role, cfg.muon_scope):
            gate_up = cfg.muon_split_gate_up and name.endswith("w_in")
            muon_buckets.setdefault((role, gate_up, mult), []).append(p)
            continue
        is_embedding = name == "embed.weight"
        decay = p.ndim >= 2 and (not is_embedding or cfg.decay_embedding)
        buckets.setdefault((role, decay, mult), []).append(p)
    groups = []
    for (role, decay, mult), params in sorted(buckets.items()):
        lr = cfg.lr * scales[role] / mult
        groups.append(
            {
                "name": f"{role}{'' if decay else '_no_decay'}{_mup_suffix(mult)}",
                "params": params,
                "lr": lr,
                "base_lr": lr,  # the schedule multiplies this
                "weight_decay": decays[role] * mult if decay else 0.0,
            }
        )
    muon_groups = []
    for (role, gate_up, mult), params in sorted(muon_buckets.items()):
        lr = cfg.lr * scales[role] * cfg.muon_lr_scale / mult
        muon_groups.append(
            {
                "name": f"muon_{role}{'_gate_up' if gate_up else ''}{_mup_suffix(mult)}",
                "params": params,
                "lr": lr,
                "base_lr": lr,
                "weight_decay": decays[role] * mult,
                "split_gate_up": gate_up,
            }
        )
    return groups, muon_groups


def _spec_of(model: nn.Module):
    """The model's ModelSpec (through a DDP-style `.module` wrapper), or None for a module without one."""
    return getattr(model, "spec", None) or getattr(getattr(model, "module", None), "spec", None)


def _mup_suffix(mult: float) -> str:
    # sp groups (and mup's width-free ones) keep their names: saved optimizer states still load
    return "" if mult == 1 else f"_mup{mult:g}"


class OptimizerSet:
    """Several torch optimizers over disjoint parameters, driven as one: param_groups (all of them, the
    same dicts, so setting a group's lr works), step, zero_grad, state_dict / load_state_dict."""

    def __init__(self, **optimizers: torch.optim.Optimizer):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers.values() for g in opt.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for opt in self.optimizers.values() for p, s in opt.state.items()}

    def step(self, closure=None):
        for opt in self.optimizers.values():
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer_set": {name: opt.state_dict() for name, opt in self.optimizers.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        parts = state_dict["optimizer_set"]
        if set(parts) != set(self.optimizers):
            raise ValueError(f"optimizer state holds {sorted(parts)}, this one is {sorted(self.optimizers)}")
        for name, opt in self.optimizers.items():
            opt.load_state_dict(parts[name])


def build_optimizer(model: nn.Module, cfg: OptimizerConfig, device: torch.device, *, seed: int = 0):
    """The optimizer of optimizer.name over `model`. `seed` salts StoSignSGD's sign noise."""
    variant = OPTIMIZERS.get(cfg.name)
    groups, matrix_groups = split_param_groups(model, cfg, muon=variant.matrix_groups)
    return variant.build(groups, matrix_groups, cfg, device, seed)


def group_layout(model: nn.Module, cfg: OptimizerConfig) -> list[tuple[str, tuple[str, ...]]]:
    """(optimizer:group, its parameters' names) of every group `build_optimizer` would make, in order: what
    a saved optimizer state must match to load into it."""
    names = {id(p): n for n, p in model.named_parameters()}
    groups, muon_groups = split_param_groups(model, cfg, muon=OPTIMIZERS.get(cfg.name).matrix_groups)
    return [
        (f"{cfg.name.value}:{g['name']}", tuple(names[id(p)] for p in g["params"]))
        for g in (*muon_groups, *groups)
    ]


def optimizer_state_bytes(model: nn.Module, cfg: Config) -> tuple[int, str]:
    """(bytes of optimizer state for all of `model`'s trainable parameters, what it is): the planner's line
    (trmoe.plan.memory), from the selected variant's `state_bytes` over its element-wise and matrix groups."""
    variant = OPTIMIZERS.get(cfg.optimizer.name)
    groups, matrix_groups = split_param_groups(model, cfg.optimizer, muon=variant.matrix_groups)
    elementwise = sum(p.numel() for g in groups for p in g["params"])
    matrices = sum(p.numel() for g in matrix_groups for p in g["params"])
    parts = [f"{variant.state_bytes} B x {elementwise:,}"]
    if matrices:
        parts.insert(0, f"{variant.matrix_state_bytes} B x {matrices:,} (matrix groups)")
    total = variant.state_bytes * elementwise + variant.matrix_state_bytes * matrices
    return total, f"{variant.name} ({variant.state}): {' + '.join(parts)}"


def optimizer_kind(optimizer, group: dict) -> str:
    """Which update rule a group gets: its part's name in an OptimizerSet (muon, adamw), else the
    optimizer's class name in lower case (adamw, stosignsgd, lion)."""
    if isinstance(optimizer, OptimizerSet):
        for name, opt in optimizer.optimizers.items():
            if any(g is group for g in opt.param_groups):
                return name
    return type(optimizer).__name__.lower()


def describe_groups(optimizer) -> list[dict]:
    """Recorded in run_config.json: every group's rule, base lr, weight decay and size."""
    return [
        {
            "name": g["name"],
            "optimizer": optimizer_kind(optimizer, g),
            "base_lr": g["base_lr"],
            "weight_decay": g["weight_decay"],
            "tensors": len(g["params"]),
            "params": sum(p.numel() for p in g["params"]),
        }
        for g in optimizer.param_groups
    ]


class GroupLRs:
    """The metrics columns lr, lr_expert, lr_shared: the lr of the group that holds, respectively, the
    tied embedding, the routed experts' w_out and the shared expert's w_out (nan when absent). All
    groups follow one multiplier: another group's lr is its base_lr (run_config.json) * lr / optimizer.lr."""

    def __init__(self, model: nn.Module, optimizer):
        block = model.blocks[0]
        probes: dict[str, torch.Tensor | None] = {"lr": model.embed.weight}
        probes["lr_expert"] = probes["lr_shared"] = None
        if block.ffn.routed is not None:
            probes["lr_expert"] = block.ffn.routed.w_out
        if block.ffn.shared is not None:
            probes["lr_shared"] = block.ffn.shared.w_out
        self._optimizer = optimizer
        self._groups: dict[str, int | None] = {}
        for column, p in probes.items():
            holders = [i for i, g in enumerate(optimizer.param_groups) if any(q is p for q in g["params"])]
            self._groups[column] = holders[0] if holders else None

    def row(self) -> dict[str, float | None]:
        # groups by index: load_state_dict (resume, rollback) replaces an optimizer's group dicts
        groups = self._optimizer.param_groups
        return {col: (None if i is None else groups[i]["lr"]) for col, i in self._groups.items()}


def optimizer_keys_differing(old: OptimizerConfig, new: OptimizerConfig, whose: str) -> str:
    """The optimizer.* keys on which two optimizer configs differ, each with both values (at most four, then a
    count): `optimizer.decay_embedding: <whose> False, this run's True`. "" when none do (the grouping then
    follows from the model)."""
    from omegaconf import OmegaConf

    from trmoe.errors import differences
    from trmoe.run.identity import flatten

    def keys(section: OptimizerConfig) -> dict:
        return flatten(OmegaConf.to_container(OmegaConf.structured(section), enum_to_str=True), "optimizer.")

    return differences(keys(old), keys(new), whose)
