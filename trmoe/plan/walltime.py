"""A launch's wall-time estimate, before step 1: the planner's training FLOPs (trmoe.model.flops: FLOPs per
token x the tokens still to train) over the device's peak FLOP/s (trmoe.runtime.peak: measured on a CPU, as
the run's MFU column is). It counts every FLOP at the peak (MFU 1), so it is a lower bound: real runs reach a
fraction of the peak, so the run takes at least this long.

Every launch logs it. On a CPU a launch whose bound exceeds trainer.max_hours is refused in one line before
anything is written: `experiment=routing_ablation` with its `_smoke` forgotten asks for days of CPU work. A
GPU run is only told (long GPU runs are what the framework is for).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from trmoe.config.derived import global_batch_tokens
from trmoe.config.schema import Config
from trmoe.errors import UserError

if TYPE_CHECKING:  # torch only where a figure is computed: trmoe.plan's CLI formats with duration()
    import torch


@dataclass(frozen=True)
class WallTime:
    seconds: float  # the lower bound: every FLOP at the peak
    steps: int  # still to train
    tokens_per_step: int  # of one rank
    flops_per_token: int
    peak: float  # FLOP/s of one device
    source: str  # where the peak comes from
    device: str  # "cpu", "cuda", ...

    def line(self) -> str:
        return (
            f"at least {duration(self.seconds)} on this {self.device} ({self.steps:,} steps x "
            f"{self.tokens_per_step:,} tokens x {self.flops_per_token:.3g} FLOPs per token at its peak "
            f"{self.peak / 1e12:.3g} TFLOP/s, {self.source})"
        )


def duration(seconds: float) -> str:
    """A time as a user reads it: ms, s, min, h, or days and hours (the plan's step time and ETA too)."""
    if seconds < 1:
        return f"{seconds * 1e3:.3g} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    minutes = seconds / 60
    if minutes < 120:
        return f"{minutes:.1f} min"
    days, hours = divmod(seconds / 3600, 24)
    return f"{int(days)} d {hours:.1f} h" if days else f"{hours:.1f} h"


def estimate(cfg: Config, spec, device: torch.device, amp_dtype: torch.dtype | None, steps: int) -> WallTime:
    """The bound for `steps` more optimizer steps of `cfg` on one `device` (a rank's share: every rank
    trains its own tokens per step at the same rate). The model is built on the meta device: no memory."""
    import torch

    from trmoe.model.flops import flops_per_token
    from trmoe.model.transformer import TRMoETransformer, count_parameters
    from trmoe.runtime.peak import peak_flops

    with torch.device("meta"):
        model = TRMoETransformer(spec)
    flops = flops_per_token(spec, count_parameters(model), cfg.trainer.seq_len)
    peak, source = peak_flops(device, amp_dtype, cfg.hardware.peak_tflops)
    tokens = global_batch_tokens(cfg.trainer, 1)
    seconds = steps * tokens * flops / peak
    return WallTime(seconds, steps, tokens, flops, peak, source, device.type)


def check(cfg: Config, wall: WallTime) -> None:
    """UserError when a CPU launch's bound exceeds trainer.max_hours (None: no limit)."""
    limit = cfg.trainer.max_hours
    if wall.device != "cpu" or limit is None or wall.seconds <= limit * 3600:
        return
    accept = max(int(limit) + 1, int(wall.seconds / 3600 * 1.5) + 1)  # room above the bound, which is low
    raise UserError(
        f"config error: trainer.max_hours={limit:g}: this run needs {wall.line()}; allowed: a smaller run "
        f"(fewer trainer.steps or ladder budgets, a smaller model or batch, an experiment's _smoke), a GPU, "
        f"or trainer.max_hours={accept} (null: no limit) to accept it"
    )


def check_config(cfg: Config) -> WallTime | None:
    """check() for a config that has not started: on the device hardware.device picks here, for the whole
    run. A device or precision not available here is left to the run to refuse (None: not estimated)."""
    from trmoe.config.spec import model_spec
    from trmoe.runtime import env

    try:
        device = env.select_device(cfg.hardware)
        amp_dtype = env.autocast_dtype(cfg.hardware, device)
    except UserError:
        return None
    if device.type != "cpu" or cfg.trainer.max_hours is None:
        return None  # only a CPU launch can be refused: estimating (a GEMM probe) would only cost time
    wall = estimate(cfg, model_spec(cfg), device, amp_dtype, job_steps(cfg))
    check(cfg, wall)
    return wall


def job_steps(cfg: Config) -> int:
    """The optimizer steps a launch of `cfg` trains: trainer.steps, or a ladder job's stable run and branches
    (its own trainer.steps is unset: the ladder sets each run's)."""
    if cfg.ladder.name is None:
        return cfg.trainer.steps
    from trmoe.config.ladder import plan

    return plan(cfg, global_batch_tokens(cfg.trainer, 1), job=False).job_steps
