"""A scaling ladder's rungs and budgets (ladder.*, docs/scaling.md): one width/depth rule, one budget rule.

Rung r of hidden size H = ladder.hidden[r]:

    num_heads    = H / head_dim                        num_kv_heads = max(1, num_heads / kv_group)
    num_layers   = max(min_layers, round(H / aspect))
    shared_width = shared_ratio · H                    routed_width = routed_ratio · H   (0 stays 0)

the widths rounded to model.match_multiple (routed_width also to a multiple of the experts). The rung's
reference model is that shape with ladder.num_experts experts (top ladder.top_k) routed by a fixed table
(no router parameters): its counts name the rung (N = non-embedding active = active - embedding, Kaplan
et al. 2020), and with ladder.match_params every arm solves model.match_field to its total (the dense
control's width; the learned arm keeps its router as the match residual).

Budgets: D_b = ladder.tokens[b], or ladder.tokens_per_param[b] · N; in steps B_b = ceil(D_b / T) with T the
tokens per step. A warmup-stable-decay run of horizon B decays over its last f·B steps (f =
optimizer.wsd_decay_fraction), so budget b branches from the stable run at step p_b = round((1 - f) · B_b)
and decays to B_b; the stable run trains to the largest p_b with the largest B_b as its horizon, so its LR
up to every p_b is the branch's own (warmup pinned by optimizer.warmup_steps).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, open_dict, read_write

from trmoe.config.schema import Config, LrRule, Parametrization, RoutingStrategy
from trmoe.errors import UserError


def _round(value: float, multiple: int) -> int:
    return max(multiple, multiple * round(value / multiple))


def rung_shape(cfg: Config, rung: int, num_experts: int | None = None) -> dict[str, int]:
    """The model.* fields rung `rung` sets (the rule above) for an arm with `num_experts` experts (default
    the config's) whose routed_width 0 (the dense control) stays 0."""
    lad, m = cfg.ladder, cfg.model
    experts = m.num_experts if num_experts is None else num_experts
    hidden = lad.hidden[rung]
    heads = hidden // lad.head_dim
    return {
        "hidden_size": hidden,
        "num_heads": heads,
        "num_kv_heads": max(1, heads // lad.kv_group),
        "num_layers": max(lad.min_layers, round(hidden / lad.aspect)),
        "shared_width": _round(lad.shared_ratio * hidden, m.match_multiple),
        "routed_width": 0
        if m.routed_width == 0 and num_experts is None
        else _round(lad.routed_ratio * hidden, math.lcm(m.match_multiple, experts)),
    }


def rung_label(cfg: Config, rung: int) -> str:
    """e.g. "h64-l2": the rung's hidden size and layers."""
    shape = rung_shape(cfg, rung)
    return f"h{shape['hidden_size']}-l{shape['num_layers']}"


def reference(cfg: Config, rung: int) -> Config:
    """The rung's reference model: the rule's shape with ladder.num_experts experts and a fixed route table
    (modulo_cyclic: no router parameters), unmatched."""
    experts = cfg.ladder.num_experts
    model = replace(cfg.model, num_experts=experts, match_params=None, **rung_shape(cfg, rung, experts))
    routing = replace(
        cfg.routing, strategy=RoutingStrategy.modulo_cyclic, top_k=min(cfg.ladder.top_k, experts)
    )
    return replace(cfg, model=model, routing=routing)


def reference_counts(cfg: Config, rung: int):
    """trmoe.model.transformer.ParamCounts of the rung's reference model (built on the meta device)."""
    from trmoe.config.spec import model_spec
    from trmoe.model.transformer import parameter_counts  # torch: only a ladder pays for it

    return parameter_counts(model_spec(reference(cfg, rung)))


def apply_rung(cfg: Config) -> dict[str, Any]:
    """Rung ladder.rung's shape (and its match target and muP base) into cfg.model, in place; returns the
    fields set, for the caller to write into the composed config too. Nothing for a run outside a ladder."""
    lad = cfg.ladder
    if lad.name is None:
        return {}
    fields: dict[str, Any] = rung_shape(cfg, lad.rung)
    if lad.match_params:
        fields["match_params"] = reference_counts(cfg, lad.rung).total
    if lad.lr_rule == LrRule.mup:  # rung 0 is the base shape: the lr tuned there transfers up the ladder
        base = rung_shape(cfg, 0)
        solved = cfg.model.match_field.value if lad.match_params else None
        # a width the match solves has no rule value at rung 0: its base scales with the hidden size (None)
        fields.update(
            parametrization=Parametrization.mup,
            mup_base_width=base["hidden_size"],
            mup_base_shared_width=None if solved == "shared_width" else base["shared_width"] or None,
            mup_base_routed_width=None if solved == "routed_width" else base["routed_width"] or None,
        )
    for key, value in fields.items():
        setattr(cfg.model, key, value)
    return fields


def write_back(raw: DictConfig, fields: dict[str, Any]) -> None:
    """The rung's fields into the composed config, so that the saved config shows the trained shape."""
    with read_write(raw), open_dict(raw):
        for key, value in fields.items():
            raw.model[key] = value.value if hasattr(value, "value") else value


@dataclass(frozen=True)
class Budget:
    tokens: int  # tokens trained: steps x tokens per step
    steps: int  # B: the branch's trainer.steps and LR horizon
    branch_step: int  # p: the stable run's step it branches from


@dataclass(frozen=True)
class LadderPlan:
    """What one ladder job trains: the stable run and a branch per budget."""

    rung: int
    label: str
    tokens_per_step: int
    n_reference: int  # non-embedding active parameters of the rung's reference model
    budgets: tuple[Budget, ...]

    @property
    def stable_steps(self) -> int:
        return max(b.branch_step for b in self.budgets)

    @property
    def horizon(self) -> int:
        return max(b.steps for b in self.budgets)

    @property
    def job_steps(self) -> int:
        """Optimizer steps of the whole job: the stable run and each branch's decay."""
        return self.stable_steps + sum(b.steps - b.branch_step for b in self.budgets)


def _check_keys_it_sets(cfg: Config) -> None:
    """A job's keys that the ladder sets per run (trmoe.train.ladder's stable and branch configs) would be
    silently replaced, and a ladder without checkpoints has no branch points to branch from: refused before
    the first run (the job's own config; the runs the ladder makes set these keys themselves, and never
    come here). trainer.steps is compared with its schema default, the only value that says "not set"."""
    from trmoe.config.schema import TrainerConfig

    set_here = {
        "trainer.steps": (cfg.trainer.steps, TrainerConfig.steps),
        "optimizer.decay_steps": (cfg.optimizer.decay_steps, None),
        "checkpoint.at_steps": (list(cfg.checkpoint.at_steps), []),
    }
    for key, (value, unset) in set_here.items():
        if value != unset:
            raise UserError(
                f"config error: {key}={value}: a ladder sets it for each run (the stable run to its last "
                "branch point, each branch to its budget: ladder.tokens / ladder.tokens_per_param); allowed: "
                "unset"
            )
    if not cfg.checkpoint.enabled:
        raise UserError(
            "config error: checkpoint.enabled=false: a ladder's branches start from the stable run's "
            "checkpoints at their branch points; allowed: true"
        )


def plan(cfg: Config, tokens_per_step: int, rung: int | None = None, *, job: bool = True) -> LadderPlan:
    """The budgets of rung `rung` (default ladder.rung) in steps; a UserError when two budgets meet at one
    step or a branch point is not after the warmup. `job`: `cfg` is a job's own config, whose keys the ladder
    sets per run must be unset (False: one of the runs the ladder made, which sets them)."""
    lad = cfg.ladder
    if job:
        _check_keys_it_sets(cfg)
    rung = lad.rung if rung is None else rung
    counts = reference_counts(cfg, rung)
    n = counts.active - counts.embedding
    wanted = lad.tokens if lad.tokens is not None else [x * n for x in lad.tokens_per_param]
    key = "ladder.tokens" if lad.tokens is not None else "ladder.tokens_per_param"
    fraction = cfg.optimizer.wsd_decay_fraction
    budgets = []
    for d in wanted:
        steps = math.ceil(d / tokens_per_step)
        budgets.append(Budget(steps * tokens_per_step, steps, round((1 - fraction) * steps)))
    warmup = cfg.optimizer.warmup_steps or 0
    for a, b in zip(budgets, budgets[1:], strict=False):
        if b.branch_step <= a.branch_step:
            raise UserError(
                f"config error: {key}={list(wanted)}: at rung {rung} ({tokens_per_step} tokens per step) two "
                f"budgets branch at step {a.branch_step}; allowed: budgets further apart"
            )
    if budgets[0].branch_step <= warmup:
        raise UserError(
            f"config error: {key}={list(wanted)}: rung {rung}'s smallest budget ({budgets[0].steps} steps) "
            f"branches at step {budgets[0].branch_step}, within optimizer.warmup_steps={warmup}; allowed: "
            "a larger budget or a shorter warmup"
        )
    return LadderPlan(rung, rung_label(cfg, rung), tokens_per_step, n, tuple(budgets))


def hydra_sweep() -> tuple[str, int] | None:
    """The job's sweep directory (runtime.cwd joined with sweep.dir, as multirun.yaml has them) and its
    number; None outside a Hydra multirun."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    h = HydraConfig.get()
    return os.path.normpath(os.path.join(h.runtime.cwd, h.sweep.dir)), int(h.job.num)


def record(cfg: Config, tokens_per_step: int, arm: str | None, parent: dict | None) -> dict | None:
    """run_config.json's `ladder` (the contract with the report's Scaling section, docs/scaling.md); None
    outside a ladder. A branch is a run with a parent (trainer.init_from); its budget is what it trains.
    The sweep directory and job number (hydra_sweep) with the job's planned budgets let the report tell the
    runs this ladder planned from copies, strays and gaps (trmoe.report.ladder.own); the parent is recorded
    relative to the sweep so that a moved sweep still names it."""
    lad = cfg.ladder
    if lad.name is None:
        return None
    branch = parent is not None
    sweep_dir, job = hydra_sweep() or (None, None)
    parent_run = parent["run"] if branch else None
    if parent_run is not None and sweep_dir is not None and parent.get("relative_to") != "sweep":
        parent_run = os.path.relpath(Path(parent_run).resolve(), Path(sweep_dir).resolve())
    return {
        "name": lad.name,
        "rung": lad.rung,
        "rung_label": rung_label(cfg, lad.rung),
        "arm": arm or cfg.routing.strategy.value,
        "seed": cfg.trainer.seed,
        "role": "branch" if branch else "stable",
        "budget_tokens": cfg.trainer.steps * tokens_per_step if branch else None,
        "budgets": [b.tokens for b in plan(cfg, tokens_per_step, job=False).budgets],  # the job's budgets
        "parent_run": parent_run,
        "parent_step": parent["step"] if branch else None,
        "sweep": sweep_dir,
        "job": job,
    }
