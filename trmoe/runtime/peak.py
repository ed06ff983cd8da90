"""The peak FLOP/s of one device, which MFU and the launch's wall-time estimate are against:
`hardware.peak_tflops` when set, else the datasheet figure of a known GPU at the run's precision, else a
measured probe (a CPU, an unknown GPU): the best of several square GEMMs of PROBE_N at the run's precision
and thread count, the fastest a real kernel ran here (a median of small GEMMs read low, and MFU above 100%).
It lives below trmoe.train so that the launch's wall-time check (trmoe.plan.walltime) uses the figure the
run's MFU column uses.
"""

from __future__ import annotations

import functools
import time

import torch

from trmoe.model.flops import datasheet_peak

PROBE_N = 1024  # the probe GEMM: a real GEMM's peak on CPU (~0.1 s a repeat on one core)
PROBE_REPS = 5


def probe_peak_flops(
    device: torch.device, dtype: torch.dtype, n: int = PROBE_N, reps: int = PROBE_REPS
) -> float:
    """Measured FLOP/s of an n^3 GEMM on `device` in `dtype`: the best of `reps`, after one warm-up; once
    per process and thread count (a sweep's jobs in one process share it: ~0.3 s on one CPU core)."""
    return _probe(device, dtype, n, reps, torch.get_num_threads())


@functools.lru_cache(maxsize=8)
def _probe(device: torch.device, dtype: torch.dtype, n: int, reps: int, _threads: int) -> float:
    gen = torch.Generator(device=device).manual_seed(0)  # its own: the run's global RNG stays untouched
    a, b = (torch.randn(n, n, device=device, dtype=dtype, generator=gen) for _ in range(2))
    times = []
    for i in range(reps + 1):
        _sync(device)
        start = time.perf_counter()
        a @ b
        _sync(device)
        if i:
            times.append(time.perf_counter() - start)
    return 2 * n**3 / min(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_flops(
    device: torch.device,
    amp_dtype: torch.dtype | None,
    override_tflops: float | None,
    recorded: dict | None = None,
) -> tuple[float, str]:
    """(peak FLOP/s of one device, where the figure comes from). `recorded`: run_config.json's `mfu_peak` of
    this run's earlier attempt, reused when it was measured (not given) on a device of the same name."""
    if override_tflops is not None:
        return override_tflops * 1e12, "hardware.peak_tflops"
    if (
        isinstance(recorded, dict)
        and str(recorded.get("source", "")).startswith("measured")
        and recorded.get("device_name") == device_name(device)
        and isinstance(recorded.get("flops"), int | float)
        and recorded["flops"] > 0
    ):
        source = str(recorded["source"]).removesuffix(", recorded by the first attempt")
        return float(recorded["flops"]), f"{source}, recorded by the first attempt"
    precision = "fp32" if amp_dtype is None else "bf16"
    if device.type == "cuda":
        peak = datasheet_peak(torch.cuda.get_device_name(device), precision)
        if peak is not None:
            return peak, f"datasheet {precision}"
    dtype = torch.float32 if amp_dtype is None else amp_dtype
    return probe_peak_flops(device, dtype), f"measured {PROBE_N}^3 {str(dtype).replace('torch.', '')} GEMM"


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"{device.type}"


def peak_record(device: torch.device, peak: float, source: str) -> dict:
    """run_config.json's `mfu_peak`: the figure, where it came from, the device it is of."""
    return {"flops": peak, "source": source, "device_name": device_name(device)}
