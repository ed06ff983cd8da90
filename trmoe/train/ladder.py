"""One job of a scaling ladder (ladder.*, docs/scaling.md): a rung x arm x seed trained at every budget.

    <run dir>            the warmup-stable run: trainer.steps = the largest branch point p, LR horizon = the
                         largest budget B (its LR is constant from the warmup to p), a checkpoint at every p_b
    <run dir>-d<tokens>  one decay branch per budget b: trainer.init_from = the stable run's step p_b,
                         init_state=branch, trainer.steps = LR horizon = B_b (it decays over its last f·B_b)

So N budgets cost one stable run plus N decays of wsd_decay_fraction of each budget (instead of N runs).
Each is an ordinary run directory (resumable; the parent is only read) whose run_config.json carries the
`ladder` record (trmoe.config.ladder.record). A Hydra sweep over ladder.rung, arm and trainer.seed runs one
such job per point; the jobs of one point run in this process one after the other: a branch needs its parent's
checkpoint, and the sweep's report sees every run when the last job ends.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, open_dict

from trmoe.config.derived import global_batch_tokens
from trmoe.config.ladder import Budget, LadderPlan, plan
from trmoe.config.resolve import to_config
from trmoe.config.schema import Config, InitState
from trmoe.run.checkpoint import step_name
from trmoe.runtime import distributed


def ladder_plan(cfg: Config) -> LadderPlan:
    return plan(cfg, global_batch_tokens(cfg.trainer, distributed.detect().world_size))


def branch_dir(run_dir: Path, budget: Budget) -> Path:
    return run_dir.with_name(f"{run_dir.name}-d{budget.tokens}")


def _with(raw: DictConfig, values: dict[str, Any]) -> DictConfig:
    out = copy.deepcopy(raw)
    with open_dict(out):
        for key, value in values.items():
            section, name = key.split(".")
            out[section][name] = value
    return out


def stable_config(raw: DictConfig, lp: LadderPlan) -> DictConfig:
    return _with(
        raw,
        {
            "trainer.steps": lp.stable_steps,
            "optimizer.decay_steps": lp.horizon,
            "checkpoint.at_steps": sorted({b.branch_step for b in lp.budgets}),
            "checkpoint.keep_last": 0,  # every branch point stays
        },
    )


def branch_config(raw: DictConfig, run_dir: Path, budget: Budget) -> DictConfig:
    return _with(
        raw,
        {
            "trainer.steps": budget.steps,
            "optimizer.decay_steps": budget.steps,
            "trainer.init_from": str(run_dir / "checkpoints" / step_name(budget.branch_step)),
            "trainer.init_state": InitState.branch.value,
        },
    )


def train_ladder(raw: DictConfig, run_dir: Path, cfg: Config) -> float:
    """The stable run into run_dir, then each budget's branch; returns the largest budget's final held-out
    loss (a sweep's objective). Every budget is checked (ladder.plan) before the first run starts."""
    from trmoe.train.loop import train

    lp = ladder_plan(cfg)
    stable = stable_config(raw, lp)
    train(stable, run_dir, to_config(stable))
    final = float("nan")
    for budget in lp.budgets:
        branch = branch_config(raw, run_dir, budget)
        final = train(branch, branch_dir(run_dir, budget), to_config(branch))
    return final
