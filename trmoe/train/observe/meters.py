"""Live efficiency columns of metrics.csv: model FLOPs utilisation (MFU) and peak device memory.

MFU = tokens/s per device x training FLOPs per token (trmoe.model.flops) / the device's peak FLOP/s. The peak
is `hardware.peak_tflops` when set, else the datasheet figure of a known GPU at the run's precision, else a
measured probe (a CPU, an unknown GPU): the best of several square GEMMs of PROBE_N at the run's precision and
thread count, the fastest a real kernel ran here (a median of small GEMMs read low, and MFU above 100%).
The peak and its source are recorded in run_config.json (`mfu_peak`) and a resumed run reuses them, so the
MFU of a run's attempts is against one figure. A window faster than the peak is no MFU above 100%: its cell is
left empty (nan) and train.log says why once.
"""

from __future__ import annotations

import functools
import logging
import math
import resource
import sys
import time

import torch

from trmoe.model.flops import datasheet_peak
from trmoe.run.columns import MetricColumn

log = logging.getLogger("trmoe")

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


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory so far: the CUDA caching allocator's peak allocation, else the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


class EfficiencyMeter:
    """The `mfu` and `peak_mem_gib` columns of a metrics row (a producer, trmoe.run.columns), from the row's
    tok_s over `world_size` devices."""

    COLUMNS = (
        MetricColumn(
            "mfu",
            "1",
            "throughput/mfu",
            "model FLOPs utilisation of one device over the window (observe/meters.py: peak, FLOPs)",
            slot=15,
        ),
        MetricColumn(
            "peak_mem_gib",
            "GiB",
            "memory/peak_gib",
            "peak memory so far: CUDA allocator peak, or the process's peak RSS on CPU",
            slot=16,
        ),
    )

    def __init__(
        self, device: torch.device, flops_per_token: int, peak: float, source: str, world_size: int = 1
    ):
        self.device, self.flops_per_token, self.peak = device, flops_per_token, peak
        self.source, self.world_size = source, world_size
        self._said_above_peak = False

    def announce(self) -> None:
        log.info("MFU: %.3g FLOPs per token, peak %.4g TFLOP/s (%s)", self.flops_per_token, self.peak / 1e12,
                 self.source)  # fmt: skip

    def columns_declared(self) -> tuple[MetricColumn, ...]:
        return self.COLUMNS

    def row(self, step: int, row) -> dict[str, float]:
        return self.columns(row["tok_s"] / self.world_size)

    def columns(self, tok_s_per_device: float) -> dict[str, float]:
        mfu = tok_s_per_device * self.flops_per_token / self.peak
        if mfu > 1:  # faster than the peak: the peak is wrong (a probe that read low), not the window
            if not self._said_above_peak:
                log.warning(
                    "MFU not shown: a window ran at %.4g TFLOP/s, above the peak %.4g TFLOP/s (%s), so that "
                    "peak reads low; set hardware.peak_tflops to the device's for an MFU column",
                    tok_s_per_device * self.flops_per_token / 1e12, self.peak / 1e12, self.source,
                )  # fmt: skip
                self._said_above_peak = True
            mfu = math.nan  # an empty MFU cell, as a column left out (trmoe.run.columns)
        return {"mfu": mfu, "peak_mem_gib": peak_memory_gib(self.device)}
