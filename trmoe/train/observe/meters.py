"""Live efficiency columns of metrics.csv: model FLOPs utilisation (MFU) and peak device memory.

MFU = tokens/s per device x training FLOPs per token (trmoe.model.flops) / the device's peak FLOP/s
(trmoe.runtime.peak: hardware.peak_tflops, a datasheet figure, or a measured GEMM). The peak and its source
are recorded in run_config.json (`mfu_peak`) and a resumed run reuses them, so the MFU of a run's attempts is
against one figure. A window faster than the peak is no MFU above 100%: its cell is
left empty (nan) and train.log says why once.
"""

from __future__ import annotations

import logging
import math
import resource
import sys

import torch

from trmoe.run.columns import MetricColumn

log = logging.getLogger("trmoe")


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
