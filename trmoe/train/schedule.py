"""Learning-rate schedule as a pure function of the optimizer step (1-based)."""

from __future__ import annotations

import math

from trmoe.config.schema import LRSchedule, OptimizerConfig


def warmup_steps(total_steps: int, cfg: OptimizerConfig) -> int:
    """optimizer.warmup_steps, or 5% of the run (at least 1 step) when it is not set."""
    return cfg.warmup_steps if cfg.warmup_steps is not None else max(1, round(0.05 * total_steps))


def lr_multiplier(step: int, total_steps: int, cfg: OptimizerConfig) -> float:
    """Linear warmup (step / warmup, so step 1 already moves), then constant or cosine from 1 down to
    min_lr_ratio at total_steps."""
    warmup = warmup_steps(total_steps, cfg)
    if step <= warmup:
        return step / warmup
    if cfg.schedule == LRSchedule.constant:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    floor = cfg.min_lr_ratio
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def apply_lr(optimizer, multiplier: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = group["base_lr"] * multiplier
