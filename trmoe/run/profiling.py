"""debug=profile: a torch.profiler trace of a few chosen steps, written into <run dir>/profile as a Chrome
trace (chrome://tracing, Perfetto, or TensorBoard's profiler plugin: `tensorboard --logdir <run
dir>/profile`), and the top ops by self time in the log."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from trmoe.config.schema import DebugConfig
from trmoe.run.rundir import PROFILE

log = logging.getLogger("trmoe")


class StepProfiler:
    """`step()` after every training step; records the steps wait+warmup+1 .. wait+warmup+active, once
    (repeat=1: torch's default, 0, starts the cycle again: one more trace per wait+warmup+active steps)."""

    def __init__(self, cfg: DebugConfig, run_dir: Path, device: torch.device):
        self._prof = None
        if not cfg.profile:
            return
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        self.dir = run_dir / PROFILE
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        write_trace = tensorboard_trace_handler(str(self.dir), worker_name="trmoe")

        def ready(prof) -> None:
            write_trace(prof)
            table = prof.key_averages().table(sort_by=sort, row_limit=cfg.profile_rows)
            log.info("profile of %d steps (trace in %s):\n%s", cfg.profile_active, self.dir, table)

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self._prof = profile(
            activities=activities,
            schedule=schedule(
                wait=cfg.profile_wait, warmup=cfg.profile_warmup, active=cfg.profile_active, repeat=1
            ),
            on_trace_ready=ready,
            record_shapes=True,
        )
        self._prof.__enter__()

    def step(self) -> None:
        if self._prof is not None:
            self._prof.step()

    def close(self) -> None:
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            self._prof = None

    def __enter__(self) -> StepProfiler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
