"""CPU runs keep freed host memory for reuse (hardware.reuse_host_memory): a large tensor allocated again
after being freed does not page-fault its memory in again. Counted with the kernel's minor-fault counter, in
a fresh process each (the setting is process-wide)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

PROBE = """
import resource, sys, torch
from trmoe.config.schema import HardwareConfig
from trmoe.train import env
env.configure(HardwareConfig(reuse_host_memory=sys.argv[1] == "on"), torch.device("cpu"))
def faults_of_one_step():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    grad = torch.zeros(64 * 2**20 // 4)  # 64 MiB: far above glibc's largest mmap threshold (32 MiB)
    grad.add_(1.0)
    del grad
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults_of_one_step()  # the first one always faults its pages in
print(min(faults_of_one_step() for _ in range(3)))
"""

PAGES = 64 * 2**20 // 4096


def _faults(setting: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, setting], capture_output=True, text=True, check=True, timeout=120
    )
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc malloc only"
)
def test_freed_memory_is_reused_instead_of_faulted_in_again():
    assert _faults("off") >= PAGES // 2  # glibc's default: a fresh mapping (and its page faults) each time
    assert _faults("on") < PAGES // 20  # kept: the same pages come back


def test_deterministic_mode_does_not_nan_fill_fresh_tensors():
    # A fresh 64 MiB mapping comes zeroed from the OS; the deterministic mode's debugging fill makes it NaN.
    probe = (
        "import torch; from trmoe.config.schema import HardwareConfig; from trmoe.train import env; "
        "env.configure(HardwareConfig(deterministic=True, reuse_host_memory=False), torch.device('cpu')); "
        "print(torch.are_deterministic_algorithms_enabled(), int(torch.empty(2**24).isnan().sum()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.split() == ["True", "0"]
