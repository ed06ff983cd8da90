"""What a run says about itself when it starts: the opening log lines and <run dir>/run_config.json (rank 0).

run_config.json records everything needed to reproduce the run and to read its results: the config, the model
spec and parameter counts, the code (git) and the machine (backend), the data's identity, what the training
controls resolved to, and the history of the run's attempts (trmoe.run.launch).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from trmoe.config import ladder
from trmoe.config.param_match import solve_match
from trmoe.config.schema import Config
from trmoe.model.spec import ModelSpec
from trmoe.model.transformer import ParamCounts
from trmoe.run import records
from trmoe.run.columns import MetricColumn
from trmoe.run.launch import Launch
from trmoe.runtime import env
from trmoe.runtime.distributed import DistEnv

log = logging.getLogger("trmoe")


@dataclass(frozen=True)
class RunFacts:
    """What the built run is, beyond its config: what `announce` says and records."""

    launch: Launch
    spec: ModelSpec
    params: ParamCounts
    dist: DistEnv  # this process's rank, the world size, who started the ranks
    strategy: str  # none | ddp | fsdp (hardware.strategy resolved)
    device: torch.device
    amp_dtype: torch.dtype | None
    tokens_per_step: int
    checkpoints: bool  # checkpoint.enabled
    data: dict[str, Any]  # the data's identity (DataPipeline.info)
    metrics_columns: tuple[MetricColumn, ...]  # the producers' declarations, in metrics.csv's order
    mfu_peak: dict[str, Any]  # the peak FLOP/s the mfu column is against, its source (observe/meters.py)
    controls: dict[str, Any]  # what the training controls resolved to: loss backend, groups, schedules, ...
    init_from: dict[str, Any] | None = None  # the parent of trainer.init_from (InitSource.record)
    distilled: dict[str, Any] | None = None  # routing=distilled: its parent and pass (trmoe.distill)


def announce(facts: RunFacts, cfg: Config, raw_cfg: DictConfig) -> None:
    """The run's opening log lines and run_config.json (rank 0)."""
    t, spec, launch, params, run = cfg.trainer, facts.spec, facts.launch, facts.params, facts.launch.run
    world, tokens_per_step = facts.dist.world_size, facts.tokens_per_step
    log.info("run directory: %s", run.path)
    if world > 1:
        log.info("%d ranks (%s), strategy %s", world, facts.dist.source, facts.strategy)
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
        ",".join(dict.fromkeys(spec.strategies)),
    )
    total = f"{tokens_per_step * t.steps:,}"
    log.info("tokens per step %s, steps %d, total %s tokens", f"{tokens_per_step:,}", t.steps, total)
    if not facts.checkpoints:
        log.warning(
            "checkpoint.enabled=false: no checkpoint is written; this run cannot be resumed (a rerun "
            "starts again at step 0)"
        )
    match = solve_match(cfg)
    if match is not None:
        log.info("parameter match: %s", match.describe())
    if facts.dist.rank != 0:
        return
    git, backend = env.git_commit(), env.backend_metadata(facts.device, facts.amp_dtype)
    records.write_run_config(
        run.path,
        {
            "run_name": run.name,
            "run_dir": str(run.path.resolve()),
            "config": OmegaConf.to_container(raw_cfg, resolve=True),
            "model_spec": spec.to_dict(),
            "params": params.to_dict(),
            "git": git,
            "world_size": world,
            "strategy": facts.strategy,  # none | ddp | fsdp (hardware.strategy resolved)
            "backend": backend,
            "tokens_per_step": tokens_per_step,
            "total_tokens": tokens_per_step * t.steps,
            "data": facts.data,
            "metrics_columns": [c.name for c in facts.metrics_columns],
            "metrics_declared": [c.record() for c in facts.metrics_columns],  # units, trackers, plots
            "mfu_peak": facts.mfu_peak,  # a resume reuses a measured one: one figure for every attempt
            "controls": facts.controls,  # loss backend, groups, schedules, compile, telemetry file
            "param_match": None if match is None else match.to_dict(),  # model.match_params: the width
            "init_from": facts.init_from,  # trainer.init_from: parent path, run, step, kind, content hash
            "distilled": facts.distilled,  # routing=distilled: parent (run, step, content), tokens, rules
            "route_embedding": _route_embedding(spec),  # clustered/dispersed_hash: file, sha256, shape
            # ladder.*: rung, arm, seed, role (stable | branch), budget and parent (trmoe.config.ladder)
            "ladder": ladder.record(cfg, tokens_per_step, _arm(), facts.init_from),
            # config hash, derived values, the attempts of this run (force_resume noted, each one's code)
            **launch.record(git, backend),
        },
    )


def _route_embedding(spec) -> dict | None:
    """The token embedding clustered_hash/dispersed_hash built their tables from: file and content hash."""
    if spec.route_embedding is None:
        return None
    from trmoe.model.embedding_routing import embedding_record

    return embedding_record(spec.route_embedding, spec.vocab_size)


def _arm() -> str | None:
    """The arm option of the job (`arm=<grid>/<arm>`, Hydra's runtime choices), if any."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return HydraConfig.get().runtime.choices.get("arm")
