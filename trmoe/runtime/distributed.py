"""Who am I in a distributed job, and the few collectives the train loop needs.

One function decides the environment (`detect`), in this order:

1. torchrun (or any env:// launcher): RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR are set;
2. a submitit job (hydra/launcher=submitit_local or submitit_slurm): each task is one rank, and
   `submitit.helpers.TorchDistributedEnvironment` supplies rank, world size and the master address;
3. otherwise a single process: no process group at all.

`init` creates the process group (NCCL on CUDA, which is RCCL on ROCm builds; gloo on CPU) and `shutdown`
destroys it at the end of each job, so Hydra's basic launcher can run a sweep in one process.
Only rank 0 writes the run's files and logs to the console; rank r > 0 logs to <run dir>/logs/rank_<r>.log.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger("trmoe")

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
_exported_by_submitit = False  # detect() has set TORCHRUN_VARS from a submitit job's ranks


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    source: str = "single"  # torchrun | submitit | single

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def detect() -> DistEnv:
    """The distributed environment of this process. Starts nothing; a submitit job's ranks are exported
    as the env:// variables that init_process_group reads."""
    global _exported_by_submitit
    submitit_job = bool(os.environ.get("SUBMITIT_EXECUTOR"))
    # In a submitit job, torchrun's variables count only when a torchrun really started this process (its
    # run id) or this process exported them itself: a job inherits the submitting shell's environment, and
    # stale RANK/WORLD_SIZE from there made every task a lone single-process run of the same directory.
    torchrun = "TORCHELASTIC_RUN_ID" in os.environ or _exported_by_submitit or not submitit_job
    if torchrun and all(k in os.environ for k in TORCHRUN_VARS):
        return DistEnv(
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            local_rank=int(os.environ["LOCAL_RANK"]),
            source=_launcher(),
        )
    if submitit_job:
        from submitit.helpers import TorchDistributedEnvironment

        env = TorchDistributedEnvironment()
        if env.world_size > 1:
            # MASTER_ADDR/PORT, RANK, WORLD_SIZE for env:// (the GPUs are left as SLURM bound them)
            env.export(set_cuda_visible_devices=False, overwrite=True)
            _exported_by_submitit = True
        return DistEnv(env.rank, env.world_size, env.local_rank, source="submitit")
    return DistEnv()


def _launcher() -> str:
    """torchrun, or submitit once `detect` has exported submitit's ranks as torchrun's variables in this
    process (the variables are the same then; the launcher is not)."""
    return "submitit" if _exported_by_submitit else "torchrun"


def backend_for(device: torch.device) -> str:
    """NCCL on CUDA (RCCL on ROCm builds, under the same name), gloo on CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def init(device: torch.device) -> tuple[DistEnv, torch.device]:
    """Create the process group when the job has more than one rank (idempotent); returns the environment
    and this rank's device (cuda:<local rank> on GPUs)."""
    env = detect()
    if device.type == "cuda":
        index = env.local_rank % max(torch.cuda.device_count(), 1)
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    if env.rank > 0:
        quiet_console()  # rank 0 alone speaks on the console; the others log into logs/rank_<r>.log
    if env.distributed and not dist.is_initialized():
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend_for(device), rank=env.rank, world_size=env.world_size, **kwargs)
        log.info(
            "process group: rank %d of %d (%s, %s)", env.rank, env.world_size, env.source, dist.get_backend()
        )
    return env, device


def shutdown() -> None:
    """Destroy the process group, if any (end of each job: the next job of a sweep starts clean).

    gloo: its worker threads drop each finished collective's tensors after the caller saw it finish, and
    a tensor Python no longer holds needs the GIL to be freed; the group's destructor joins those threads
    while holding the GIL. Destroyed within that window, the process deadlocks (seen ~1 in 20 runs of a
    2-rank test, gdb: ProcessGroupGloo::~ProcessGroupGloo joining a runloop thread that waits in
    take_gil). A short sleep first releases the GIL so the threads finish; drop DDP/FSDP wrappers
    before calling this, so that the group is destroyed here and not whenever they are collected."""
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() == "gloo":
            time.sleep(0.1)
        dist.destroy_process_group()


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def barrier() -> None:
    if active():
        dist.barrier()


def collective_device() -> torch.device:
    """Where the tensors of a collective must live: NCCL (RCCL) reduces on this rank's GPU (`init` made it
    the current device), gloo on the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(*values: torch.Tensor) -> list[torch.Tensor]:
    """Sums over ranks of scalar tensors (one collective for all of them); copies, inputs untouched.
    The values may live on different devices (a CPU count next to device sums): they are gathered on
    the collective's device first."""
    if not active():
        return [v.detach().reshape(()).clone() for v in values]
    device = collective_device()
    stacked = torch.stack([v.detach().to(device=device, dtype=torch.float64).reshape(()) for v in values])
    dist.all_reduce(stacked, op=dist.ReduceOp.SUM)
    return list(stacked.unbind())


def quiet_console() -> None:
    """Remove the console handlers (ranks > 0: what they log goes to their own file)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            root.removeHandler(handler)


def no_sync(model: torch.nn.Module, sync: bool):
    """DDP: skip the gradient all-reduce on all but the last micro-batch of an accumulated step."""
    if not sync:
        return model.no_sync()
    return contextlib.nullcontext()
