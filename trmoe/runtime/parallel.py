"""hardware.strategy: how a multi-rank job holds the model.

- ddp (the default when world > 1): DistributedDataParallel with no per-forward buffer broadcast (the route
  tables are built identically on every rank from the config); the loop skips the gradient all-reduce on
  all but the last micro-batch of a step (`no_sync`).
- fsdp: FSDP2 (`torch.distributed.fsdp.fully_shard`) on every block and then on the root, with a mixed
  precision policy (bf16/fp16 parameters in compute, fp32 gradient reduction) on GPUs. The model object is
  sharded in place, so checkpoints go through torch.distributed.checkpoint (format dcp).

The evaluation and the tied-head loss use the unwrapped module (`model`); the training forward goes through
the wrapper returned here.
"""

from __future__ import annotations

import inspect
import sys

import torch
from torch import nn

from trmoe.config.schema import Strategy
from trmoe.runtime.distributed import DistEnv


def resolve_strategy(strategy: Strategy, dist_env: DistEnv) -> str:
    """ "none" (single process), "ddp" or "fsdp"."""
    if not dist_env.distributed:
        return "none"
    return "fsdp" if strategy == Strategy.fsdp else "ddp"


def shard_fsdp(model: nn.Module, amp_dtype: torch.dtype | None) -> list[nn.Parameter]:
    """FSDP2 in place: each block is one unit (all-gathered for its forward, resharded after), the root
    holds the embedding/tied head and the final norm. FSDP2 cannot shard scalar parameters (the shared and
    routed gates): they stay replicated and their gradients are averaged by `average_gradients`, which the
    loop calls after backward. Returns those parameters."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    scalars = [p for p in model.parameters() if p.dim() == 0]
    kwargs = {"ignored_params": set(scalars)}
    if amp_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return scalars


def average_gradients(params: list[nn.Parameter]) -> None:
    """Mean over ranks of the gradients of parameters no wrapper reduces (one collective)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads or not torch.distributed.is_initialized():
        return
    flat = torch.stack([g.reshape(()) for g in grads])
    torch.distributed.all_reduce(
        flat, op=torch.distributed.ReduceOp.AVG if _has_avg() else torch.distributed.ReduceOp.SUM
    )
    if not _has_avg():
        flat /= torch.distributed.get_world_size()
    for g, v in zip(grads, flat.unbind(), strict=True):
        g.copy_(v)


def _has_avg() -> bool:
    return torch.distributed.get_backend() == "nccl"


def wrap_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [device.index] if device.type == "cuda" else None
    # no buffer broadcast before each forward: route tables are deterministic, identical on every rank
    # (torch 2.13 renamed the option and warns on the old name; the new one still syncs them once, at init)
    new_name = "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
    no_sync = {"forward_sync_buffers" if new_name else "broadcast_buffers": False}
    return DDP(model, device_ids=ids, output_device=ids[0] if ids else None, **no_sync)


def full(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a DTensor (FSDP results such as the gradient norm); others unchanged."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def is_dtensor(t: torch.Tensor | None) -> bool:
    # DTensor's module is loaded when one is made (fully_shard, a dcp load): until then there is none, and
    # this check leaves it unloaded (a single-process run never needs its imports)
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def shard_region(t: torch.Tensor) -> tuple[slice, ...]:
    """The region of a DTensor's global tensor that this rank holds (`t.to_local()`), as one slice per
    dimension. Shard placements split a dimension as torch.chunk does (FSDP2's and DTensor's layout: pieces
    of ceil(n / ranks), the last ones short or empty); Replicate keeps it whole."""
    from torch.distributed.tensor import Shard

    start, size = [0] * t.dim(), list(t.shape)
    mesh = t.device_mesh
    for mesh_dim, placement in enumerate(t.placements):
        if placement.is_replicate():
            continue
        if type(placement) is not Shard:  # Partial, or a strided shard (FSDP2 combined with TP)
            raise NotImplementedError(f"shard_region: placement {placement} of a {tuple(t.shape)} DTensor")
        dim = placement.dim % t.dim()
        piece = -(-size[dim] // mesh.size(mesh_dim))
        lo = min(mesh.get_local_rank(mesh_dim) * piece, size[dim])
        start[dim] += lo
        size[dim] = min(piece, size[dim] - lo)
    local = tuple(t.to_local().shape)
    if tuple(size) != local:
        raise NotImplementedError(f"shard_region: computed {tuple(size)}, the local shard is {local}")
    return tuple(slice(a, a + n) for a, n in zip(start, size, strict=True))
