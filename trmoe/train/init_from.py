"""trainer.init_from: a new run that starts from another model's weights (docs/reliability.md, "Starting
from another run").

    trainer.init_from=<path>     a run directory, its checkpoints/ or one step_XXXXXXXX (its newest complete
                                 checkpoint), a `python -m trmoe.convert` output (a run directory), or a
                                 `python -m trmoe.export` directory (format hf or safetensors)
    trainer.init_state=weights   the weights only: step 0, a fresh optimizer, data from the first sample (a
                                 warm start, fine-tuning)
                       optimizer the weights and the optimizer's state (moments, step counts): step 0
                       branch    weights, optimizer, data cursor, RNG, step and training time: the run goes
                                 on from the parent's step under its own config (trainer.steps, the LR
                                 schedule): a WSD cooldown branch (docs/scaling.md)

The new run is a run directory of its own: the parent is only read, never written. run_config.json records
the parent (`init_from`: path, run directory, step, kind, content hash and what was carried; the paths
relative to the sweep directory for a parent in the run's own Hydra sweep); a resume of the new run
continues its own checkpoints and keeps that record, and a kill before its first checkpoint starts it from
the parent again (refused when the parent's content is no longer the recorded one; the path may have moved:
it is where the parent is, its content is what it is). Everything is
checked before anything is written: the path, the tensors' names and shapes against the model this config
builds, and what `init_state` needs (an optimizer state and a train state in the parent, trainer.steps
beyond its step, the same tokens per step and the same data). A branch that scores another held-out set
(eval_batches x micro_batch windows) than its parent says so and records it.

What the new config defines is its own, never the parent's: its route tables replace the parent's (logged,
recorded as `followed`); scheduled gates, μP multipliers and a rerandomised router's draw come from the
config as in any run; learned routing state (a router's W_r, learned_v3's bias) is carried only into a
layer of the parent's strategy, else refused in one line naming the tensor.

The content hash is the SHA-256 of the parent's file records (the size and CRC32 of every file, verified
against the bytes before they are used; an export's model.safetensors is checksummed here): it names the
exact bytes the run started from without hashing gigabytes twice.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trmoe.config.ladder import hydra_sweep
from trmoe.config.schema import Config, InitState
from trmoe.config.spec import model_spec
from trmoe.errors import UserError, shape_difference
from trmoe.run.cadence import NEVER, Cadence
from trmoe.run.checkpoint import (
    CheckpointError,
    CheckpointInfo,
    CheckpointStore,
    file_crc32,
    files_digest,
    load_local_state,
    model_shapes,
)
from trmoe.run.find import find_checkpoint
from trmoe.run.rundir import named_by
from trmoe.train.preflight import meta_model, stored_config

log = logging.getLogger("trmoe")

KEY = "trainer.init_from"
ALLOWED = "a run directory, a checkpoint, a trmoe.convert output or a trmoe.export directory"
SAFETENSORS = "model.safetensors"
# What a branch takes from the parent's train state; the metrics window, the guard's history and the
# telemetry window start empty (they describe the parent's last steps, not this run's).
BRANCH_PARTS = ("state", "rng")


@dataclass
class InitSource:
    """Where a new run's weights come from (checked against its config: `resolve`)."""

    path: Path  # the checkpoint directory, or the export directory
    kind: str  # checkpoint | converted | export
    step: int
    state: InitState
    content_hash: str
    info: CheckpointInfo | None = None  # a trmoe checkpoint (checkpoint, converted)
    export_config: dict[str, Any] = field(default_factory=dict)
    followed: list[str] = field(default_factory=list)  # what apply() set from this config, not the parent
    held_out: dict[str, Any] | None = None  # a branch scoring another held-out set: windows, its line

    @property
    def parent_run(self) -> Path:
        return self.path.parent.parent if self.info is not None else self.path

    @property
    def branch(self) -> bool:
        return self.state == InitState.branch

    def record(self) -> dict[str, Any]:
        """run_config.json's `init_from`: a parent inside the run's Hydra sweep directory (a ladder's stable
        run) relative to it (`relative_to`: "sweep"), so that a moved sweep still names it; else absolute."""
        path, run, sweep = self.path.resolve(), self.parent_run.resolve(), hydra_sweep()
        inside = sweep is not None and Path(sweep[0]).resolve() in run.parents
        if inside:
            path, run = path.relative_to(Path(sweep[0]).resolve()), run.relative_to(Path(sweep[0]).resolve())
        return {
            "path": str(path),
            "run": str(run),
            **({"relative_to": "sweep"} if inside else {}),
            "step": self.step,
            "kind": self.kind,
            "content_hash": self.content_hash,
            "carried": self.state.value,
            "followed": list(self.followed),
            **({"held_out_windows": self.held_out["windows"]} if self.held_out else {}),
        }

    # -------------------------------------------------------------------------------------------- loading

    def weights(self) -> dict[str, torch.Tensor]:
        """The parent's model tensors (names as trmoe's state_dict has them), on the CPU."""
        if self.info is None:
            from safetensors.torch import load_file

            state = load_file(str(self.path / SAFETENSORS))
            return {_strip(k, self.export_config): v for k, v in state.items()}
        return self.info.model_weights()

    def load_data_cursor(self, data, rank: int) -> None:
        """A branch reads on where the parent stopped: its data cursor (a UserError, before anything is
        written, when this run reads other data)."""
        if self.branch and self.info is not None:
            cursor = load_local_state(self.info, rank).get("data")
            if cursor is not None:
                try:
                    data.load_state_dict(cursor)
                except UserError as e:
                    raise UserError(
                        f"{KEY}={self.path} (init_state=branch): {e} (nothing was written)"
                    ) from None

    def apply(self, trainer) -> None:
        """Into a built Trainer at its start: the weights, and what init_state carries besides."""
        model = trainer.model
        built = model.route_tables()  # this config's: the parent's are replaced by them after the load
        if self.state == InitState.weights:
            _load_weights(model, self.weights())
        else:  # the store's own load: weights and optimizer state, whatever the format and the sharding
            store = CheckpointStore(self.info.path.parent, rank=trainer.dist.rank)
            local = store.load(self.info, model=model, optimizer=trainer.optimizer)
            if self.branch:
                skip = [n for n in trainer.components.names() if n not in BRANCH_PARTS]
                trainer.components.load_state_dict(local, skip=skip)
                for evaluator in trainer.evaluators:  # the branch point is scored, as step 0 of a run is
                    if getattr(evaluator, "cadence", NEVER) != NEVER:
                        evaluator.cadence = evaluator.cadence | Cadence(at=(self.step,))
        self.followed = model.restore_route_tables(built)
        if self.followed:
            log.warning("%s: %s follow this config's routing (the parent's differ)", KEY, self.followed)
        if self.held_out is not None:
            log.warning(self.held_out["line"])
        log.info(
            "%s: %s of %s (step %d, %s), content %s",
            KEY,
            self.state.value,
            self.path,
            self.step,
            self.kind,
            self.content_hash[:12],
        )


def _check_router_state(source: InitSource, cfg: Config, new: dict[str, tuple[int, ...]]) -> None:
    from trmoe.model.routing import foreign_router_state

    ours, theirs = model_spec(cfg).strategies, None  # theirs: the parent's per layer (None: unrecorded)
    if source.info is not None and (stored := stored_config(source.info.meta)) is not None:
        theirs = model_spec(stored).strategies
    elif isinstance(spec := source.export_config.get("trmoe_model_spec"), dict) and "num_layers" in spec:
        theirs = tuple(spec.get("layer_strategies") or [spec.get("strategy")] * int(spec["num_layers"]))
    found = foreign_router_state(theirs, ours, set(new))
    if found is not None:
        layer, name, parent = found
        said = f"routes by {parent}" if parent is not None else "does not record its routing"
        raise UserError(
            f"{KEY}={source.path}: the parent's layer {layer} {said}, this config's by {ours[layer]}: {name} "
            "would carry the parent's; allowed: a parent with the same routing.strategy (routing.layers) at "
            "its router layers (nothing was written)"
        )


def _strip(name: str, config: dict[str, Any]) -> str:
    """An hf export stores model.<trmoe name>; a safetensors export trmoe's names."""
    return name.removeprefix("model.") if config.get("model_type") == "trmoe" else name


def _load_weights(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()):  # FSDP: each rank keeps its shards
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))
    else:
        model.load_state_dict(state, strict=True)


def _from_export(path: Path, state: InitState) -> InitSource:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{KEY}={path}: no readable config.json ({e}); allowed: {ALLOWED}") from None
    if not isinstance(config, dict) or not (
        config.get("model_type") == "trmoe" or "trmoe_model_spec" in config
    ):
        raise UserError(f"{KEY}={path}: config.json is not a trmoe export's; allowed: {ALLOWED}")
    if state != InitState.weights:
        raise UserError(
            f"trainer.init_state={state.value}: {path} is an export (weights only); allowed: weights"
        )
    try:
        import safetensors  # noqa: F401
    except ImportError:
        raise UserError(
            f"{KEY}={path}: reading an export needs safetensors: pip install 'trmoe[hf]'"
        ) from None
    step = (config.get("trmoe") or {}).get("step", config.get("step", 0))
    return InitSource(
        path=path,
        kind="export",
        step=int(step or 0),
        state=state,
        content_hash=files_digest({SAFETENSORS: file_crc32(path / SAFETENSORS)}),
        export_config=config,
    )


def _export_shapes(source: InitSource) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    try:
        with safe_open(str(source.path / SAFETENSORS), framework="pt") as f:
            return {_strip(k, source.export_config): tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # not a safetensors file, truncated
        raise UserError(f"{KEY}={source.path}: {SAFETENSORS} unreadable ({type(e).__name__}: {e})") from None


def find(cfg: Config) -> InitSource:
    """The parent that trainer.init_from names, verified (a missing or damaged path: UserError)."""
    raw, state = cfg.trainer.init_from, cfg.trainer.init_state
    path = Path(raw).expanduser()
    if not path.exists():
        raise UserError(f"{KEY}={raw}: no such file or directory; allowed: {ALLOWED}")
    if (path / SAFETENSORS).is_file() and not (path / "meta.json").exists():
        return _from_export(path, state)
    try:
        info = find_checkpoint(path)
    except UserError as e:
        raise UserError(f"{KEY}={raw}: {e}") from None
    kind = "converted" if "converted_from" in info.meta else "checkpoint"
    return InitSource(info.path, kind, info.step, state, info.content_hash, info)


def resolve(cfg: Config, launch, world_size: int) -> InitSource | None:
    """The checked parent of a fresh (or restarted) run with trainer.init_from; None otherwise (a resume
    continues the run's own checkpoints). Raises UserError, before anything is written, for a parent that
    does not fit."""
    if cfg.trainer.init_from is None or launch.mode not in ("fresh", "restart"):
        return None
    source = find(cfg)
    _check_same_parent(source, (launch.previous or {}).get("init_from"))
    model = meta_model(cfg)
    new = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    try:
        old = model_shapes(source.info) if source.info is not None else _export_shapes(source)
    except CheckpointError as e:
        raise UserError(f"{KEY}: {e} (nothing was written)") from None
    if old != new:
        count, example = shape_difference(old, new, "the parent's")
        raise UserError(
            f"{KEY}={source.path}: another model shape ({count} tensors differ, e.g. {example}); "
            "allowed: a parent whose model.* builds the same tensors (nothing was written)"
        )
    _check_router_state(source, cfg, new)
    if source.state != InitState.weights:
        _check_carried(source, cfg, model, world_size)
    return source


def _check_same_parent(source: InitSource, recorded: Any) -> None:
    """A restart (killed before its first checkpoint) starts from the bytes its record names, or not at all
    (a parent replaced since: a newer checkpoint in a run directory, another one copied over the path)."""
    if not isinstance(recorded, dict) or not recorded.get("content_hash"):
        return
    then, now = str(recorded["content_hash"]), source.content_hash
    if then != now:
        raise UserError(
            f"{KEY}={source.path}: not the parent this run started from (step {recorded.get('step')}, "
            f"content {then[:12]} then; step {source.step}, content {now[:12]} now); allowed: the parent it "
            f"started from (restore it), or another {named_by()} for a new run from this one (nothing was "
            "written)"
        )


def _check_carried(source: InitSource, cfg: Config, model: torch.nn.Module, world_size: int) -> None:
    """What init_state=optimizer|branch needs from the parent: an optimizer state of the same groups, and for
    a branch a train state, a later trainer.steps and the same tokens per step."""
    from trmoe.config.derived import eval_windows, global_batch_tokens, held_out_change
    from trmoe.optim.build import group_layout, optimizer_keys_differing

    info, state, t = source.info, source.state.value, cfg.trainer
    if source.kind == "converted":
        raise UserError(
            f"trainer.init_state={state}: {source.path} is a converted checkpoint (no optimizer state, no "
            "train state); allowed: weights"
        )
    stored = stored_config(info.meta)
    if stored is None or group_layout(meta_model(stored), stored.optimizer) != group_layout(
        model, cfg.optimizer
    ):
        # name the keys (both may be adamw: a preset's grouping rules differ, not optimizer.name)
        keys = stored and optimizer_keys_differing(stored.optimizer, cfg.optimizer, "the parent's")
        keys = keys or ("model.* differs" if stored else "its config is not one this trmoe reads")
        raise UserError(
            f"trainer.init_state={state}: the optimizer of {source.path} groups the parameters otherwise "
            f"({keys}); allowed: weights, or the parent's optimizer settings"
        )
    if not source.branch:
        return
    if cfg.trainer.steps <= source.step:
        raise UserError(
            f"trainer.steps={cfg.trainer.steps}: a branch goes on from the parent's step {source.step}; "
            f"allowed: > {source.step}"
        )
    parent_batch = (info.meta.get("derived") or {}).get("global_batch_tokens")
    ours = global_batch_tokens(cfg.trainer, world_size)
    if parent_batch is not None and parent_batch != ours:
        raise UserError(
            f"trainer.init_state=branch: the parent trained {parent_batch} tokens per step, this run "
            f"{ours}; allowed: the same (the data cursor counts samples by step)"
        )
    try:
        local = load_local_state(info, 0)
    except Exception as e:
        raise UserError(
            f"trainer.init_state=branch: {info.path}: no train state ({type(e).__name__})"
        ) from None
    if not isinstance(local, dict) or "step" not in local:
        raise UserError(f"trainer.init_state=branch: {info.path} holds no train state; allowed: weights")
    theirs = (info.meta.get("derived") or {}).get("eval_windows")  # the branch's held-out set: the parent's?
    if isinstance(theirs, int) and (note := held_out_change(theirs, t)) is not None:
        windows = {"parent": theirs, "run": eval_windows(t)}
        source.held_out = {"windows": windows, "line": f"{KEY} (init_state=branch): {note}"}
