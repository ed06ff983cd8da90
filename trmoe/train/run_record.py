"""What a run says about itself when it starts: the opening log lines and <run dir>/run_config.json (rank 0).

run_config.json records everything needed to reproduce the run and to read its results: the config, the model
spec and parameter counts, the code (git) and the machine (backend), the data's identity, what the training
controls resolved to, and the history of the run's attempts (trmoe.run.launch).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from omegaconf import DictConfig, OmegaConf

from trmoe.config.param_match import solve_match
from trmoe.model.transformer import ParamCounts
from trmoe.run import records
from trmoe.runtime import env

if TYPE_CHECKING:
    from trmoe.train.trainer import Trainer

log = logging.getLogger("trmoe")


def announce(trainer: Trainer, raw_cfg: DictConfig, params: ParamCounts) -> None:
    """The run's opening log lines and run_config.json (rank 0)."""
    cfg, t, spec, launch = trainer.cfg, trainer.t, trainer.model.spec, trainer.launch
    world = trainer.dist.world_size
    tokens_per_step = trainer.state.tokens_per_step
    log.info("run directory: %s", trainer.run.path)
    if world > 1:
        log.info("%d ranks (%s), strategy %s", world, trainer.dist.source, trainer.parallelism)
    if launch.mode != "fresh":
        source = launch.checkpoint.path if launch.checkpoint else "no checkpoint"
        log.info("=== %s from step %d (%s) ===", launch.mode, launch.start_step, source)
    log.info(
        "model %s: %s parameters (%s active per token, %s embedding), %d layers, attention %s %d/%d, "
        "FFN shared %d + routed %d x %d (top-%d, %s)",
        cfg.model.name,
        f"{params.total:,}",
        f"{params.active:,}",
        f"{params.embedding:,}",
        spec.num_layers,
        cfg.attention.kind.value,
        spec.num_heads,
        spec.num_kv_heads,
        spec.shared_width,
        spec.num_experts,
        spec.expert_width,
        spec.top_k,
        spec.strategy,
    )
    total = f"{tokens_per_step * t.steps:,}"
    log.info("tokens per step %s, steps %d, total %s tokens", f"{tokens_per_step:,}", t.steps, total)
    if not trainer.store.enabled:
        log.warning(
            "checkpoint.enabled=false: no checkpoint is written; this run cannot be resumed (a rerun "
            "starts again at step 0)"
        )
    match = solve_match(cfg)
    if match is not None:
        log.info("parameter match: %s", match.describe())
    if trainer.dist.rank != 0:
        return
    git, backend = env.git_commit(), env.backend_metadata(trainer.device, trainer.amp_dtype)
    records.write_run_config(
        trainer.run.path,
        {
            "run_name": trainer.run.name,
            "run_dir": str(trainer.run.path.resolve()),
            "config": OmegaConf.to_container(raw_cfg, resolve=True),
            "model_spec": spec.to_dict(),
            "params": params.to_dict(),
            "git": git,
            "world_size": world,
            "strategy": trainer.parallelism,  # none | ddp | fsdp (hardware.strategy resolved)
            "backend": backend,
            "tokens_per_step": tokens_per_step,
            "total_tokens": tokens_per_step * t.steps,
            "data": trainer.data.info,
            "metrics_columns": list(trainer.columns),
            "controls": trainer.controls.record(trainer.optimizer),  # loss backend, groups, schedules
            "param_match": None if match is None else match.to_dict(),  # model.match_params: the width
            # config hash, derived values, the attempts of this run (force_resume noted, each one's code)
            **launch.record(git, backend),
        },
    )
