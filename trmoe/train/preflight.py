"""Pre-flight checks of a resume that need the training internals (a meta-device model, the optimizer's
groups, the schedules), run right after the launch decision and before anything is written. They live on
the training side so that the run-lifecycle modules (launch, identity, rundir, checkpoint) do not import
prepare, optim or schedule.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from omegaconf import OmegaConf

from trmoe.config.schema import Config
from trmoe.config.spec import model_spec
from trmoe.errors import UserError, shape_difference
from trmoe.model.transformer import TRMoETransformer
from trmoe.optim.build import group_layout, optimizer_keys_differing
from trmoe.optim.schedule import build_schedules, check_extension
from trmoe.run.checkpoint import CheckpointError, CheckpointInfo, model_shapes
from trmoe.run.launch import Launch
from trmoe.train.prepare import freeze_scheduled_gates

log = logging.getLogger("trmoe")


def check(launch: Launch, cfg: Config) -> None:
    """What `launch` will load must fit this config: the model's tensors (on resume, or when a
    force_resume let keys change) and the schedules of the steps already run."""
    info = launch.checkpoint
    if info is None:
        return
    if launch.mode == "resume" or launch.forced:  # what the resume will load, or what force may not change
        _check_shapes(info, cfg, forced=bool(launch.forced))
    _check_schedules(info, cfg, launch)


def stored_config(meta: dict[str, Any]) -> Config | None:
    """The Config a checkpoint recorded, or None when this trmoe cannot read it."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), meta["config"])
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except Exception:  # a config from another trmoe version: the key diff already reports it
        return None


def meta_model(config: Config) -> TRMoETransformer:
    """The model `config` builds, on the meta device (no memory), its scheduled gates frozen as training
    freezes them (so that the optimizer's groups are those of the run)."""
    with torch.device("meta"):
        model = TRMoETransformer(model_spec(config))
    freeze_scheduled_gates(model, build_schedules(config))
    return model


def _check_shapes(info: CheckpointInfo, cfg: Config, *, forced: bool) -> None:
    """Before anything is written: the checkpoint's tensors (their names and shapes as stored, not as its
    config says: it may come from another trmoe version) must fit the model this config builds, and a
    force_resume may not change how the optimizer groups the parameters either (its saved state loads group
    by group). Both models are built on the meta device: no memory."""

    try:
        old = model_shapes(info)
    except CheckpointError as e:
        raise UserError(f"checkpoint unusable: {e} (nothing was changed)") from None
    model = meta_model(cfg)
    new = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if old != new:
        count, example = shape_difference(old, new, "the checkpoint's")
        if forced:
            raise UserError(
                f"trainer.force_resume=true cannot change the model's tensors: {count} differ from "
                f"{info.path} (e.g. {example}) (nothing was changed)"
            )
        raise UserError(
            f"checkpoint {info.path} does not fit this model: {count} tensors differ "
            f"(e.g. {example}); resume it with the trmoe version that wrote it (nothing was changed)"
        )
    stored = stored_config(info.meta) if forced else None
    if stored is None:  # not forced (same config, same groups), or a config from another trmoe version
        return
    old_groups, new_groups = (
        group_layout(meta_model(stored), stored.optimizer),
        group_layout(model, cfg.optimizer),
    )
    if old_groups != new_groups:
        first = next(
            (i for i, (a, b) in enumerate(zip(old_groups, new_groups, strict=False)) if a != b),
            min(len(old_groups), len(new_groups)),
        )
        was = old_groups[first][0] if first < len(old_groups) else "none"
        now = new_groups[first][0] if first < len(new_groups) else "none"
        what = f"{was} -> {now}" if was != now else f"{was} holds other parameters"
        keys = optimizer_keys_differing(stored.optimizer, cfg.optimizer, "the checkpoint's")
        raise UserError(
            f"trainer.force_resume=true cannot change how the optimizer groups the parameters (its saved "
            f"state loads group by group): {len(old_groups)} groups in {info.path}, {len(new_groups)} now; "
            f"group {first}: {what}{f' ({keys})' if keys else ''} (nothing was changed)"
        )


def _check_schedules(info: CheckpointInfo, cfg: Config, launch: Launch) -> None:
    """trainer.steps may change, but not what the schedules did in the steps already run (e.g. a cosine
    horizon that moves bends the LR of steps already taken)."""
    stored = stored_config(info.meta)
    if stored is None or info.step == 0:
        return
    try:
        check_extension(build_schedules(stored), build_schedules(cfg), info.step)
    except UserError as e:
        if not cfg.trainer.force_resume:
            raise UserError(f"{e} (resuming {info.path}; nothing was changed)") from None
        log.warning("trainer.force_resume=true: continuing although %s", e)
        launch.forced["schedules"] = [str(e), "forced"]
