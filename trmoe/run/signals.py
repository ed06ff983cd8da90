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
from typing import Any, NoReturn

log = logging.getLogger("trmoe")

STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
PREEMPTED = "preempted"  # status.json of a run stopped by a signal after its checkpoint was saved


class Preempted(BaseException):  # noqa: N818 — not an error: a requested stop (BaseException like SystemExit)
    """Raised by the train loop at the step boundary after a stop signal, once the checkpoint of that step
    is saved (unless checkpoint.enabled=false) and the run's files are closed."""

    def __init__(self, signum: int, step: int, previous_handler: Any, *, saved: bool = True):
        self.signum = signum
        self.step = step
        self.previous_handler = previous_handler
        how = (
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

    def __init__(self, signals: tuple[int, ...] = STOP_SIGNALS):
        self.signals = signals
        self.requested: int | None = None
        self._previous: dict[int, Any] = {}
        self._flag = None  # agreed(): the all-reduced stop flag, on the collective's device

    def _handle(self, signum: int, frame) -> None:
        if signum == signal.SIGINT and self.requested == signal.SIGINT:
            raise KeyboardInterrupt  # Ctrl-C twice: stop now
        if self.requested is None:
            self.requested = signum
            # os.write: safe inside a signal handler (no locks), and visible even if logging is mid-call
            name = signal.Signals(signum).name
            os.write(2, f"trmoe: {name} received: saving a checkpoint at the end of this step\n".encode())

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
