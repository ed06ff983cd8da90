"""routing=distilled's parent and pass (docs/routing.md, "distilled"): the route tables a new run trains with
are counted from a trained router's choices (the formula: trmoe/model/distill.py).

    routing.distill_from=<path>        a run directory, its checkpoints/ or one step_XXXXXXXX (the newest
                                       complete checkpoint) of a routing=learned or learned_v3 run
    routing.distill_from=arm:<name>    in a sweep: the sibling job of arm <grid>/<name> (this job's arm group)
                                       whose other overrides (the seed, ...) are this job's: a grid lists
                                       the parent arm before the distilled one, and the basic launcher runs
                                       the jobs in that order (conf/experiment/controls_2026.yaml)
    routing.distill_tokens=M           tokens of the pass: the first ceil(M / trainer.seq_len) windows of this
                                       run's training order (the training split: never the held-out one)

The parent is checked before anything is written (UserError): a checkpoint must be there, every distilled
layer must be a trained router in the parent (learned, learned_v3: "no learned router" otherwise), and the
model dimensions the table depends on (vocabulary, experts, K, layers, hidden size) must be this run's. A
fresh run (or one killed before its first checkpoint, whose parent must still be the recorded bytes) runs the
pass at its start and sets the tables; a resume takes them from its checkpoint, as every route table.
run_config.json's `distilled` records the parent (as given, its run directory relative to this run's, step,
content hash), the tokens counted and the rules.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from trmoe.config.schema import Config
from trmoe.config.spec import model_spec
from trmoe.config.validate import layer_strategies
from trmoe.errors import UserError
from trmoe.model.routing import DISTILL_FALLBACK, REGISTRY
from trmoe.run import status
from trmoe.run.checkpoint import CheckpointInfo
from trmoe.run.find import find_checkpoint

log = logging.getLogger("trmoe")

KEY = "routing.distill_from"
ARM = "arm:"
# what the table depends on: a parent that differs in one of them cannot give this run's table
DIMS = ("vocab_size", "num_experts", "top_k", "num_layers", "hidden_size")
RULES = {
    "order": "count descending, ties to the lower expert id",
    "unseen": f"{DISTILL_FALLBACK} (routing.seed)",
}


@dataclass
class DistillParent:
    """A distilled run's checked parent."""

    given: str  # routing.distill_from as configured
    info: CheckpointInfo
    layers: tuple[int, ...]  # the distilled layers of this run
    tokens: int  # routing.distill_tokens
    run_dir: Path  # this run's directory (the record names the parent relative to it)
    seed: int = 0  # routing.seed of this run (the unseen ids' table)
    counted: int = 0  # tokens the pass read

    @property
    def content_hash(self) -> str:
        return self.info.content_hash

    def record(self) -> dict[str, Any]:
        """run_config.json's `distilled`."""
        return {
            "from": self.given,
            "run": os.path.relpath(self.info.path.parent.parent.resolve(), self.run_dir.resolve()),
            "checkpoint": self.info.path.name,
            "step": self.info.step,
            "content_hash": self.content_hash,
            "tokens": self.counted,
            "layers": list(self.layers),
            **RULES,
        }

    def tables(self, data, seq_len: int, micro_batch: int, device: torch.device) -> dict[int, torch.Tensor]:
        """The pass: the parent's routes over the first windows of `data`'s training order, counted into the
        distilled tables of this run's layers."""
        from trmoe.model.distill import count_routes, distilled_table
        from trmoe.model.transformer import TRMoETransformer

        parent_cfg = _stored(self.info)
        spec = model_spec(parent_cfg)
        model = TRMoETransformer(spec)
        model.load_state_dict(self.info.model_weights(), strict=True)
        model = model.to(device=device, dtype=torch.float32)
        windows = -(-self.tokens // seq_len)
        self.counted = windows * seq_len

        def batches():
            for first in range(0, windows, micro_batch):
                yield data.batch(first, min(micro_batch, windows - first))[0]

        counts = count_routes(model, batches(), self.layers)
        return {
            layer: distilled_table(c, spec.top_k, layer, self.seed).to(device) for layer, c in counts.items()
        }

    def apply(self, trainer, data) -> None:
        """Into a built Trainer at its fresh start: the pass, its tables into the model (broadcast from rank
        0 when there are several ranks, so every rank trains with one table)."""
        t = trainer.cfg.trainer
        source, fresh = data.train, None
        if hasattr(source, "state_dict"):  # a streamed source keeps a cursor: the pass reads its own
            from trmoe.data.build import build_data

            fresh = build_data(trainer.cfg, trainer.model.spec.vocab_size)
            source = fresh.train
        try:
            tables = self.tables(source, t.seq_len, t.micro_batch, trainer.device)
        finally:
            if fresh is not None:
                fresh.close()
        if trainer.dist.world_size > 1:
            for table in tables.values():
                torch.distributed.broadcast(table, src=0)
        trainer.model.restore_route_tables(tables)
        log.info(
            "%s: tables of layers %s distilled from %s (step %d, content %s) over %s tokens",
            KEY,
            list(self.layers),
            self.info.path,
            self.info.step,
            self.content_hash[:12],
            f"{self.counted:,}",
        )


def _stored(info: CheckpointInfo) -> Config:
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), info.meta["config"])
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except Exception as e:  # another trmoe version's config
        raise UserError(f"{KEY}={info.path}: its config is not readable by this trmoe ({e})") from None


def sibling(given: str, run_dir: Path) -> Path:
    """The run directory `arm:<name>` names: the job of this sweep (run_dir's parent) whose arm is
    <this job's arm group>/<name> and whose other task overrides are this job's."""
    from hydra.core.hydra_config import HydraConfig

    name = given.removeprefix(ARM)
    if not HydraConfig.initialized() or not HydraConfig.get().runtime.choices.get("arm"):
        raise UserError(f"{KEY}={given}: names an arm of this sweep; this run is no sweep job with an arm")
    hc = HydraConfig.get()
    group = str(hc.runtime.choices["arm"]).rpartition("/")[0]
    arm = f"{group}/{name}" if group else name
    ours = _without_arm(list(hc.overrides.task))
    for job in sorted(p for p in run_dir.parent.iterdir() if p.is_dir() and p != run_dir):
        theirs = OmegaConf.load(job / ".hydra" / "overrides.yaml") if (job / ".hydra").is_dir() else []
        theirs = [str(o) for o in theirs]
        if f"arm={arm}" in theirs and _without_arm(theirs) == ours:
            record = status.read_status(job) or {}
            if record.get("status") != status.FINISHED:
                raise UserError(
                    f"{KEY}={given}: the parent job {job} is {record.get('status', 'not started')}, not "
                    "finished; allowed: run the parent arm first (the grid lists it first; a parallel "
                    "launcher does not wait for it)"
                )
            return job
    raise UserError(
        f"{KEY}={given}: no job of arm={arm} with this job's other overrides in {run_dir.parent}; allowed: "
        "an arm the sweep runs before this one"
    )


def _without_arm(overrides: list[str]) -> list[str]:
    return sorted(o for o in overrides if not o.lstrip("+~").startswith(("arm=", f"{KEY}=")))


def resolve(cfg: Config, launch) -> DistillParent | None:
    """The checked parent of a fresh (or restarted) distilled run; None otherwise (a resume takes its tables
    from its checkpoint). Raises UserError, before anything is written, for a parent that does not fit."""
    r = cfg.routing
    layers = tuple(i for i, name in enumerate(layer_strategies(cfg)) if REGISTRY[name].distilled)
    if not layers or launch.mode not in ("fresh", "restart"):
        return None
    given = str(r.distill_from)
    path = sibling(given, launch.run.path) if given.startswith(ARM) else Path(given).expanduser()
    try:
        info = find_checkpoint(path)
    except UserError as e:
        raise UserError(f"{KEY}={given}: {e} (the parent's checkpoint is what is distilled)") from None
    parent = DistillParent(given, info, layers, r.distill_tokens, launch.run.path, seed=r.seed)
    ours, theirs = model_spec(cfg), model_spec(_stored(info))
    for layer in layers:
        strategy = theirs.strategy_of(layer) if layer < theirs.num_layers else None
        if strategy is None or REGISTRY[strategy].router != "trained":
            raise UserError(
                f"{KEY}={given}: the parent has no learned router at layer {layer} (it routes by "
                f"{strategy}); allowed: a routing=learned or learned_v3 run (nothing was written)"
            )
    differ = [f"model {d} {getattr(theirs, d)} (this run: {getattr(ours, d)})" for d in DIMS]
    differ = [d for d, name in zip(differ, DIMS, strict=True) if getattr(theirs, name) != getattr(ours, name)]
    if differ:
        raise UserError(
            f"{KEY}={given}: the parent's {', '.join(differ)} differ; allowed: a parent of the same "
            "vocabulary, experts, top-K, layers and hidden size (nothing was written)"
        )
    recorded = ((launch.previous or {}).get("distilled") or {}).get("content_hash")
    if recorded and recorded != parent.content_hash:  # a restart distils the bytes its record names
        raise UserError(
            f"{KEY}={given}: not the parent this run started from (content {recorded[:12]} then, "
            f"{parent.content_hash[:12]} now); allowed: restore it, or a new run (nothing was written)"
        )
    return parent


def keep(launch) -> dict[str, Any] | None:
    """A resume's record: the first attempt's (its tables are in the checkpoint)."""
    return (launch.previous or {}).get("distilled")
