"""Device, precision, threads, seeding and the backend facts recorded with every run."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import platform
import random
import subprocess
from pathlib import Path

import numpy as np
import torch

from trmoe.config.schema import Device, HardwareConfig, Precision
from trmoe.config.validate import usable_cores
from trmoe.errors import UserError

log = logging.getLogger("trmoe")


def mps_available() -> bool:
    return torch.backends.mps.is_available()


def pick_device(name: str, *, label: str) -> torch.device:
    """The device `name` asks for: auto (a GPU if there is one, else MPS, else the CPU), or one of
    hardware.device's names (cpu, mps, cuda, rocm). cuda and rocm are both torch's "cuda" device type: the
    torch build decides which one it is, and the name must match it. A name that is not available here is a
    UserError that begins `<label>=<name>`, as the caller's user wrote the choice (the train app's config
    key, a tool's --device)."""
    is_rocm = torch.version.hip is not None
    has_gpu = torch.cuda.is_available()
    has_mps = mps_available()
    if name == Device.auto:
        return torch.device("cuda") if has_gpu else torch.device("mps") if has_mps else torch.device("cpu")
    if name == Device.cpu:
        return torch.device("cpu")
    if name == Device.mps:
        if not has_mps:
            raise UserError(f"{label}=mps: MPS is not available here; allowed: auto, cpu")
        return torch.device("mps")
    if name not in (Device.cuda, Device.rocm):
        raise UserError(f"{label}={name}: allowed: {', '.join(d.value for d in Device)}")
    if not has_gpu or (name == Device.rocm) != is_rocm:
        raise UserError(
            f"{label}={name}: no {name.upper()} device is available to this torch build "
            f"({torch.__version__}); allowed here: auto, cpu"
        )
    return torch.device("cuda")


def select_device(hw: HardwareConfig) -> torch.device:
    """The train app's device: hardware.device."""
    return pick_device(hw.device.value, label="config error: hardware")


# hardware.precision's (and a loading tool's --dtype's) names of the reduced precisions
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_dtype(hw: HardwareConfig, device: torch.device) -> torch.dtype | None:
    """Training: the autocast dtype, or None for plain fp32. Master weights always stay fp32."""
    p = hw.precision
    if p == Precision.fp32 or (p == Precision.auto and device.type != "cuda"):
        return None
    if p == Precision.auto:
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "cpu":
        raise UserError(f"config error: hardware.precision={p.value}: CPU runs use fp32; allowed: auto, fp32")
    return DTYPES[p.value]


def weights_dtype(name: str, device: torch.device) -> torch.dtype:
    """A loaded model's (sample, eval, export): the dtype its weights are cast to, `--dtype` `name`; auto:
    bf16 on a GPU, fp32 on the CPU. Not autocast: no fp32 master weights stay behind."""
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if name not in DTYPES:
        raise UserError(f"dtype {name!r}: allowed: auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def autocast(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


# torch's own thread count, as the process started: what hardware.threads=null means
_STARTUP_THREADS = torch.get_num_threads()


def configure(hw: HardwareConfig, device: torch.device) -> None:
    """The process as the config asks, every setting set both ways: sweep jobs share one process, and a
    job must not inherit the thread count or determinism of the job before it."""
    torch.set_num_threads(hw.threads if hw.threads is not None else _STARTUP_THREADS)
    if hw.threads is not None and hw.threads > usable_cores():
        log.warning(
            "hardware.threads=%d is above the %d cores this process may use: oversubscribed threads "
            "slow every step",
            hw.threads,
            usable_cores(),
        )
    if device.type == "cpu" and hw.reuse_host_memory:
        keep_freed_host_memory()
    torch.use_deterministic_algorithms(hw.deterministic, warn_only=device.type != "cpu")
    if hw.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # That mode also fills every new uninitialised tensor with NaN, a debugging aid for ops that read
        # memory they never wrote; trmoe's do not, and the memsets cost ~2% of a 100m CPU step (the fresh
        # [V, H] embedding gradient alone is 307 MB).
        torch.utils.deterministic.fill_uninitialized_memory = False
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # mallopt parameters (glibc malloc.h)


def keep_freed_host_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse (process-wide); True if it took effect.

    By default glibc serves every block over 32 MiB with a fresh mmap and unmaps it on free, and it returns
    the top of the heap to the OS. A CPU training step allocates the same large tensors every step (the
    [V, H] embedding and head gradients: 307 MB at 100m), so each of them page-faults its memory in again,
    which on the 2-core CI machine cost ~1.2 s of a ~6.9 s 100m step. With mmap off and no trimming, freed
    blocks are reused; the process keeps its peak resident size, which a training run reaches anyway, plus
    some fragmentation early on (torch's 64-byte aligned blocks leave small spare tails that other
    allocations can pin: +5% resident at 50m, flat after the first steps).
    The same reason people preload jemalloc or tcmalloc for CPU training; this needs nothing installed."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)
        ok = libc.mallopt(_M_MMAP_MAX, 0) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, -1) == 1 and ok  # -1: never trim
    except (OSError, AttributeError):
        return False
    return ok


def sum_dtype(device: torch.device | str) -> torch.dtype:
    """The dtype of the loop's running sums on the device (losses over a step, a log window or the
    held-out set; telemetry counters): float64, exact over any run; float32 on MPS, which has no float64."""
    return torch.float32 if torch.device(device).type == "mps" else torch.float64


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def source_checkout() -> Path | None:
    """The git checkout trmoe is imported from, or None: an installed wheel, or a venv that merely lies
    inside some other repository (the user's), whose commit says nothing about trmoe's code."""
    import trmoe

    root = Path(trmoe.__file__).resolve().parents[1]
    if not (root / ".git").exists():  # a checkout's top level (.git is a file in a worktree)
        return None
    return root


def git_commit() -> dict:
    """trmoe's version, and the commit and local-changes state of the checkout it is imported from (None
    for both when it is not imported from a git checkout)."""
    import trmoe

    root = source_checkout()

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = None if root is None else git("rev-parse", "HEAD")
    dirty = None if commit is None else bool(git("status", "--porcelain", "--untracked-files=no"))
    return {"version": trmoe.__version__, "commit": commit, "dirty": dirty}


def cpu_name() -> str:
    """The processor's model name (Linux /proc/cpuinfo), else what the platform module knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def backend_metadata(device: torch.device, dtype: torch.dtype | None) -> dict:
    """What ran the job (run_config.json "backend"): device and its name, the CPU, versions, threads,
    precision, the process group's backend, and which attention (SDPA) kernels torch may pick."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    meta = {
        "device": str(device),
        "device_name": cpu_name(),
        "cpu": cpu_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "autocast_dtype": None if dtype is None else str(dtype).replace("torch.", ""),
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "process_group": torch.distributed.get_backend() if distributed else None,
    }
    if device.type == "cuda":
        meta["device_name"] = torch.cuda.get_device_name(device)
        meta["device_count"] = torch.cuda.device_count()
        meta["cudnn"] = torch.backends.cudnn.version()
        meta["sdpa_kernels"] = {
            "flash": torch.backends.cuda.flash_sdp_enabled(),
            "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
            "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
            "math": torch.backends.cuda.math_sdp_enabled(),
        }
    return meta
