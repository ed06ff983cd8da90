"""Stop requests by signal: SIGUSR2 (SLURM's and submitit's preemption/timeout warning), SIGTERM (SLURM
preemption, `timeout`, `kill`, container stop), SIGINT (Ctrl-C) and SIGHUP (the terminal closed).

The handler only records the signal. The train loop looks at the flag at each step boundary, saves a
checkpoint there, closes its files and raises `Preempted`; the app then hands the signal to whatever handler
was installed before trmoe's and exits:

- under submitit (also through hydra-submitit-launcher), that is submitit's own handler: on SIGUSR2 it
  pickles the job again (the launcher's `checkpoint`), requeues it (`scontrol requeue`; the local executor
  reruns it on exit code 144) and exits (code 255 on SLURM); the rerun resumes from the checkpoint;
- otherwise the process exits with 128 + the signal number (SIGTERM 143, SIGUSR2 140): the status of a
  process that the signal ended, but only after the checkpoint is on disk. A SLURM batch script requeues
  on it (`[ $? -ge 128 ] && scontrol requeue $SLURM_JOB_ID`); under `timeout` the status is 124 anyway.

The stop is bounded (`trainer.stop_within`, 60 s by default): at each micro-batch boundary of a step, a
single-process run whose step would end more than half that bound after the signal (the remaining
micro-batches at the pace of those done) drops the step instead, without a checkpoint (the other half is the
checkpoint's and the files' time); it then says which checkpoint is kept (a rerun resumes from it, losing the
steps since). So the run ends within the bound, or one micro-batch when a micro-batch alone takes longer,
as long as the step's checkpoint and an evaluation due at it fit in the other half (they are not cut). A
distributed run stops at step boundaries only (its ranks would have to agree at every micro-batch).

Ctrl-C and SIGHUP are stops like SIGTERM (exit 130 / 129 after the checkpoint). A second Ctrl-C while the
first is being served stops at once (KeyboardInterrupt: one line, exit 130; the rerun resumes from the
last complete checkpoint). A signal that was ignored when the run started (SIGHUP under `nohup`) stays
ignored. Outside the train loop (building the data, the first evaluation) Ctrl-C is a KeyboardInterrupt.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from typing import Any, NoReturn

log = logging.getLogger("trmoe")

STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
PREEMPTED = "preempted"  # status.json of a run stopped by a signal after its checkpoint was saved


class Preempted(BaseException):  # noqa: N818 — not an error: a requested stop (BaseException like SystemExit)
    """Raised by the train loop at the step boundary after a stop signal, once the checkpoint of that step
    is saved (unless checkpoint.enabled=false) and the run's files are closed."""

    def __init__(self, signum: int, step: int, previous_handler: Any, *, saved: bool = True, how: str = ""):
        self.signum = signum
        self.step = step
        self.previous_handler = previous_handler
        how = how or (
            "checkpoint saved"
            if saved
            else "no checkpoint (checkpoint.enabled=false): a rerun starts at step 0"
        )
        super().__init__(f"stopped at step {step} on {signal.Signals(signum).name}; {how}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopSignals:
    """Context manager: while active, SIGUSR2 and SIGTERM set `requested` instead of ending the process.
    Outside the main thread (where Python cannot install handlers) it does nothing."""

    def __init__(self, signals: tuple[int, ...] = STOP_SIGNALS, within: float = 60.0, store: Any = None):
        self.signals = signals
        self.within = within  # seconds from the signal to the end of the run (trainer.stop_within)
        self.store = store  # the run's CheckpointStore: which checkpoint a dropped step keeps
        self._step_started = 0.0
        self.requested: int | None = None
        self.requested_at = 0.0  # time.monotonic() of the request
        self._previous: dict[int, Any] = {}
        self._flag = None  # agreed(): the all-reduced stop flag, on the collective's device

    def _handle(self, signum: int, frame) -> None:
        if signum == signal.SIGINT and self.requested == signal.SIGINT:
            raise KeyboardInterrupt  # Ctrl-C twice: stop now
        if self.requested is None:
            self.requested, self.requested_at = signum, time.monotonic()
            # os.write: safe inside a signal handler (no locks), and visible even if logging is mid-call
            name = signal.Signals(signum).name
            line = (
                f"trmoe: {name} received: stopping within {self.within:g} s: a checkpoint at the end of this "
                "step, or the step dropped if it would end later\n"
            )
            os.write(2, line.encode())

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in self.signals:
                if signal.getsignal(signum) is signal.SIG_IGN:  # nohup's SIGHUP: stays ignored
                    continue
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()

    def next_micro_batch(self, step: int, index: int, count: int) -> bool:
        """Called before micro-batch `index` of `count` of `step`: whether it is the step's last. Before any
        but the first, a requested stop that finishing the step would answer more than half the bound after
        the signal (the rest at the pace so far; the other half is the checkpoint's and the files') drops
        the step: Preempted, no checkpoint, the newest complete one kept. Not in a distributed run: its ranks
        would have to agree on the micro-batch, so it stops at the step's end."""
        import torch.distributed as dist

        now = time.monotonic()
        if index == 0:
            self._step_started = now
        elif self.requested is not None and not (dist.is_available() and dist.is_initialized()):
            ends = now + (now - self._step_started) / index * (count - index)
            if ends > self.requested_at + self.within / 2:
                store = self.store if self.store is not None and self.store.enabled else None
                kept = max((s for s, _ in store.step_dirs()), default=None) if store is not None else None
                how = dropped(step, self.within, kept)
                stop = Preempted(self.requested, step - 1, self.previous(self.requested), how=how)
                log.warning("%s", stop)  # in train.log: why it ended
                raise stop
        return index == count - 1

    def previous(self, signum: int) -> Any:
        return self._previous.get(signum, signal.SIG_DFL)

    def agreed(self) -> int | None:
        """The stop request agreed by every rank (any rank's signal stops all of them at the same step).
        Distributed: one tiny all-reduce per step, on the collective's device (the GPU for NCCL, the CPU
        for gloo); reading its result is its one host sync. The flag tensor is made once: filling it is a
        kernel launch, while a new CUDA tensor made from a Python value is a blocking copy, a second sync."""
        import torch

        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return self.requested
        if self._flag is None:
            from trmoe.runtime.distributed import collective_device

            self._flag = torch.zeros((), dtype=torch.int64, device=collective_device())
        self._flag.fill_(self.requested or 0)
        torch.distributed.all_reduce(self._flag, op=torch.distributed.ReduceOp.MAX)
        return int(self._flag.item()) or None


def dropped(step: int, within: float, kept: int | None) -> str:
    """Preempted's line for a step dropped by StopSignals.cut_short: what is kept, what a rerun does."""
    why = f"step {step} would have ended past half of trainer.stop_within={within:g} s, so it was dropped"
    if kept is None:
        return f"{why}; no checkpoint is kept: a rerun starts at step 0"
    again = f"step {kept + 1} is" if kept + 1 == step - 1 else f"steps {kept + 1}-{step - 1} are"
    lost = f" ({again} trained again)" if kept < step - 1 else ""
    return f"{why} without a checkpoint; kept: the checkpoint of step {kept}, which a rerun resumes{lost}"


def hand_over(stop: Preempted) -> NoReturn:
    """After a signal stop: run the handler installed before trmoe's (submitit's requeue), then exit with
    128 + signum if it returned."""
    previous = stop.previous_handler
    if (
        callable(previous) and previous is not signal.default_int_handler
    ):  # (it would raise KeyboardInterrupt)
        log.info("handing %s to the previous handler (%s)", signal.Signals(stop.signum).name, previous)
        previous(stop.signum, None)
    sys.exit(stop.exit_code)
