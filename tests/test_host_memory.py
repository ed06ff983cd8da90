"""CPU runs keep freed host memory for reuse (hardware.reuse_host_memory): a large tensor allocated again
after being freed does not page-fault its memory in again. Counted with the kernel's minor-fault counter, in
a fresh process each (the setting is process-wide).

With reuse on, the first few re-allocations may still take fresh memory: torch asks for 64-byte aligned
blocks, glibc carves them from a slightly larger chunk and frees the spare tail, where a small allocation
can settle and keep the freed block from merging with its neighbours. The heap then grows by one block
until freed blocks merge (seen: at most 5 such steps out of 15, in 100 fresh processes, none after step 6),
so the test checks the steady state, as a training run sees it."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

PROBE = """
import resource, sys, torch
from trmoe.config.schema import HardwareConfig
from trmoe.runtime import env
env.configure(HardwareConfig(reuse_host_memory=sys.argv[1] == "on"), torch.device("cpu"))
def faults_of_one_step():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    grad = torch.zeros(64 * 2**20 // 4)  # 64 MiB: far above glibc's largest mmap threshold (32 MiB)
    grad.add_(1.0)
    del grad
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(*(faults_of_one_step() for _ in range(STEPS)))
""".replace("STEPS", "24")

PAGES = 64 * 2**20 // 4096


def _faults(setting: str) -> list[int]:
    """Minor page faults of each of 24 allocate-use-free steps, the last 8 of them (the steady state)."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE, setting], capture_output=True, text=True, check=True, timeout=120
    )
    return [int(n) for n in out.stdout.split()][-8:]


@pytest.mark.subprocess
@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc malloc only"
)
def test_freed_memory_is_reused_instead_of_faulted_in_again():
    # glibc's default: a fresh mapping (and its page faults) every time
    assert min(_faults("off")) >= PAGES // 2
    # kept: the same pages come back (with the mallopt call removed this counted 16,384 per step)
    assert sum(_faults("on")) < PAGES // 20


@pytest.mark.subprocess
def test_deterministic_mode_does_not_nan_fill_fresh_tensors():
    # A fresh 64 MiB mapping comes zeroed from the OS; the deterministic mode's debugging fill makes it NaN.
    probe = (
        "import torch; from trmoe.config.schema import HardwareConfig; from trmoe.runtime import env; "
        "env.configure(HardwareConfig(deterministic=True, reuse_host_memory=False), torch.device('cpu')); "
        "print(torch.are_deterministic_algorithms_enabled(), int(torch.empty(2**24).isnan().sum()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.split() == ["True", "0"]
