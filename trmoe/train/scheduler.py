"""The schedules applied: at the start of every step, the values of trmoe.optim.schedule's pure functions
(LR multiplier, top-k primary weight p, scheduled gates, diversity weight lambda) set on the optimizer and
the model, and a re-randomised router's draw of the step; and their metrics columns."""

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

    def __init__(self, schedules: Schedules, model: nn.Module, optimizer):
        self.schedules, self.model, self.optimizer = schedules, model, optimizer
        self.values: dict[str, float | None] = {}  # this step's
        self._group_lrs = GroupLRs(model, optimizer)

    def begin_step(self, step: int) -> dict[str, float | None]:
        """Set this step's LR, p, gates (lambda is the objective's); returns the step's values."""
        v = self.values = self.schedules.at(step)
        apply_lr(self.optimizer, v["lr_mult"])
        with torch.no_grad():
            for block in self.model.blocks:
                ffn = block.ffn
                ffn.redraw_router(step)  # rerandomised_router: this step's router (a no-op otherwise)
                if v["primary_weight"] is not None and ffn.routed is not None:
                    if ffn.routed.primary_weight != v["primary_weight"]:
                        ffn.routed.primary_weight = v["primary_weight"]
                if v["shared_gate"] is not None and ffn.shared_gate is not None:
                    ffn.shared_gate.fill_(v["shared_gate"])
                if v["routed_gate"] is not None and ffn.routed_gate is not None:
                    ffn.routed_gate.fill_(v["routed_gate"])
        return v

    def columns_declared(self) -> tuple[MetricColumn, ...]:
        return self.COLUMNS

    def row(self, step: int, row) -> dict[str, Any]:
        """The metrics columns of a logged step (a producer, trmoe.run.columns): per-group LRs, the gates'
        means, p, lambda."""
        row: dict[str, Any] = dict(self._group_lrs.row())
        row["shared_gate"], row["routed_gate"] = _gate_means(self.model)
        routed = [b.ffn.routed for b in self.model.blocks if b.ffn.routed is not None]
        row["primary_weight"] = routed[0].primary_weight if routed and routed[0].top_k > 1 else None
        row["diversity_lambda"] = self.values.get("diversity")
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
