"""Before a run writes anything: does its model fit at all? An allocation that fails once the run directory
holds its records leaves a run that never trained (and a traceback); what a config needs at the least is
known beforehand, so a model that cannot fit is refused with one line, exit 2, nothing written."""

from __future__ import annotations

import torch

from trmoe.config.schema import Config
from trmoe.errors import UserError
from trmoe.model.transformer import ModelSpec, TRMoETransformer
from trmoe.optim.build import optimizer_state_bytes

GIB = 1 << 30


def available_bytes(device: torch.device) -> int | None:
    """Memory this process could still get: a GPU's free memory, or the host's available memory and free
    swap (/proc/meminfo); None where it is not known."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        fields = dict(line.split(":", 1) for line in open("/proc/meminfo").read().splitlines() if ":" in line)
        return (int(fields["MemAvailable"].split()[0]) + int(fields["SwapFree"].split()[0])) * 1024
    except (OSError, KeyError, ValueError):
        return None


def floor_bytes(cfg: Config, spec: ModelSpec, shards: int = 1) -> int:
    """The least one process holds: fp32 weights and gradients and the optimizer's state (activations come
    on top: `python -m trmoe.plan` estimates them), 1/shards of it under FSDP."""
    with torch.device("meta"):
        model = TRMoETransformer(spec)
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    optimizer, _ = optimizer_state_bytes(model, cfg)
    return (8 * params + optimizer) // max(shards, 1)


def check_fits(cfg: Config, spec: ModelSpec, device: torch.device, shards: int = 1) -> None:
    need, have = floor_bytes(cfg, spec, shards), available_bytes(device)
    if have is not None and need > have:
        raise UserError(
            f"model {cfg.model.name}: its weights, gradients and optimizer state need at least "
            f"{need / GIB:.1f} GiB, but {device} has {have / GIB:.1f} GiB available; allowed: a smaller "
            "model (sizes and memory per setting: python -m trmoe.plan)"
        )
