"""The schedules applied: at the start of every step, the values of trmoe.optim.schedule's pure functions
(LR multiplier, top-k primary weight p, scheduled gates, diversity weight lambda) set on the optimizer and
the model, and a re-randomised router's draw of the step; after every applied optimizer step, learned_v3's
bias update from the step's expert loads (trmoe/model/moe.py); and their metrics columns."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trmoe.optim.build import GroupLRs, describe_groups
from trmoe.optim.schedule import Schedules, apply_lr
from trmoe.run.columns import MetricColumn


class Scheduler:
    COLUMNS = (
        MetricColumn("lr", "1", "optim/lr", slot=9, meaning=(
            "lr of the group holding the tied embedding (optimizer.lr x the schedule multiplier)")),
        MetricColumn("lr_expert", "1", "optim/lr_expert", slot=10, meaning=(
            "lr applied to the routed experts' matrices (Muon's under muon_tr)")),
        MetricColumn("lr_shared", "1", "optim/lr_shared", slot=11, meaning=(
            "lr applied to the shared expert's matrices")),
        MetricColumn("shared_gate", "1", "moe/shared_gate", "shared branch gate, mean over layers", slot=17),
        MetricColumn("routed_gate", "1", "moe/routed_gate", "routed branch gate, mean over layers", slot=18),
        MetricColumn("primary_weight", "1", "moe/primary_weight", slot=25, meaning=(
            "top-k primary weight p at this step (nan when top_k = 1)")),
        MetricColumn("diversity_lambda", "1", "moe/diversity_lambda", slot=26, meaning=(
            "lambda of the expert-diversity penalty at this step (nan when off)")),
    )  # fmt: skip
    # learned_v3's layers only: one member per such layer
    FAMILIES = (
        MetricColumn("route_bias_spread", "1", "moe/route_bias_spread", "learned_v3: max - min of the "
                     "layer's balancing bias b after this step"),
        MetricColumn("route_load_imbalance", "1", "moe/route_load_imbalance", "learned_v3: the layer's "
                     "largest expert load over the mean load in this step (1 = balanced)"),
    )  # fmt: skip
    MEMBER = "layer"

    def __init__(self, schedules: Schedules, model: nn.Module, optimizer, bias_update: float = 0.0):
        """`bias_update`: gamma of learned_v3's bias (routing.bias_update)."""
        self.schedules, self.model, self.optimizer = schedules, model, optimizer
        self.values: dict[str, float | None] = {}  # this step's
        self._group_lrs = GroupLRs(model, optimizer)
        self.bias_update = bias_update
        # learned_v3's layers, by index; the last applied step's load imbalance per layer (device, [L'])
        self._v3 = [i for i, b in enumerate(model.blocks) if b.ffn.route_bias is not None]
        self._imbalance: torch.Tensor | None = None

    def begin_step(self, step: int) -> dict[str, float | None]:
        """Set this step's LR, p, gates (lambda is the objective's); returns the step's values."""
        v = self.values = self.schedules.at(step)
        apply_lr(self.optimizer, v["lr_mult"])
        with torch.no_grad():
            for block in self.model.blocks:
                ffn = block.ffn
                ffn.redraw_router(step)  # rerandomised_router: this step's router (a no-op otherwise)
                ffn.reset_load()  # learned_v3: this step's loads start at 0 (a skipped step's are dropped)
                if v["primary_weight"] is not None and ffn.routed is not None:
                    if ffn.routed.primary_weight != v["primary_weight"]:
                        ffn.routed.primary_weight = v["primary_weight"]
                if v["shared_gate"] is not None and ffn.shared_gate is not None:
                    ffn.shared_gate.fill_(v["shared_gate"])
                if v["routed_gate"] is not None and ffn.routed_gate is not None:
                    ffn.routed_gate.fill_(v["routed_gate"])
        return v

    def end_step(self) -> None:
        """After an applied optimizer step: learned_v3's bias update from the step's loads (summed over the
        ranks: every rank applies the same update to the same bias)."""
        if not self._v3:
            return
        loads = torch.stack([self.model.blocks[i].ffn.route_load for i in self._v3])  # [L', E]
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(loads)
        for row, i in enumerate(self._v3):
            self.model.blocks[i].ffn.update_bias(loads[row], self.bias_update)
        self._imbalance = loads.max(dim=1).values / loads.mean(dim=1).clamp_min(1e-9)

    def columns_declared(self) -> tuple[MetricColumn, ...]:
        family = tuple(f.member(str(i)) for i in self._v3 for f in self.FAMILIES)
        return self.COLUMNS + family

    def row(self, step: int, row) -> dict[str, Any]:
        """The metrics columns of a logged step (a producer, trmoe.run.columns): per-group LRs, the gates'
        means, p, lambda."""
        row: dict[str, Any] = dict(self._group_lrs.row())
        row["shared_gate"], row["routed_gate"] = _gate_means(self.model)
        routed = [b.ffn.routed for b in self.model.blocks if b.ffn.routed is not None]
        row["primary_weight"] = routed[0].primary_weight if routed and routed[0].top_k > 1 else None
        row["diversity_lambda"] = self.values.get("diversity")
        for row_index, i in enumerate(self._v3):
            bias = self.model.blocks[i].ffn.route_bias
            row[f"route_bias_spread/{i}"] = float(bias.max() - bias.min())
            if self._imbalance is not None:
                row[f"route_load_imbalance/{i}"] = float(self._imbalance[row_index])
        return row

    def record(self) -> dict[str, Any]:
        """For run_config.json: the optimizer's groups and the resolved schedules."""
        return {"optimizer_groups": describe_groups(self.optimizer), "schedules": self.schedules.to_dict()}


def _gate_means(model: nn.Module) -> tuple[float | None, float | None]:
    shared = [b.ffn.shared_gate for b in model.blocks if b.ffn.shared_gate is not None]
    routed = [b.ffn.routed_gate for b in model.blocks if b.ffn.routed_gate is not None]

    def mean(gates):
        return torch.stack([g.detach() for g in gates]).mean().item() if gates else None

    return mean(shared), mean(routed)
