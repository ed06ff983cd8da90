"""Fault guards, decided once per step between the backward pass and the optimizer step.

- A non-finite loss or gradient norm skips the step: no parameter or optimizer-state change (the gradients
  are dropped); the step counter, the LR schedule and the data cursor still advance, so the batch is simply
  not learned from. After `guard.max_skips` consecutive skips the run stops (with a checkpoint of the last
  good state).
- A loss spike is a step loss above `guard.spike_factor` x the median of the previous `guard.spike_window`
  accepted steps (a robust running estimate: one wild step does not move it). Policy `log` counts and logs
  it and applies the step; policy `rollback` reloads the last good checkpoint, recomputes the steps since
  (a transient fault such as silent data corruption is not repeated) and skips the offending batch.

The guard sees the loss and the gradient norm as host floats: one device sync per step while any guard
is on. The loss must be the global one (all ranks agree on every decision).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from trmoe.config.schema import GuardConfig, SpikePolicy
from trmoe.run.columns import MetricColumn

APPLY, SKIP, ROLLBACK = "apply", "skip", "rollback"


@dataclass(frozen=True)
class Verdict:
    action: str  # apply | skip | rollback
    reason: str = ""


class StepGuard:
    COLUMNS = (
        MetricColumn(
            "skipped_steps",
            "steps",
            "guard/skipped_steps",
            "steps skipped so far: non-finite loss or gradient, or a batch dropped by a rollback",
            slot=30,
        ),
        MetricColumn(
            "loss_spikes",
            "steps",
            "guard/loss_spikes",
            "loss spikes detected so far (guard.spike_factor)",
            slot=31,
        ),
    )

    def __init__(self, cfg: GuardConfig):
        self.cfg = cfg
        self.recent: deque[float] = deque(maxlen=cfg.spike_window)  # accepted step losses
        self.consecutive_skips = 0
        self.skipped = 0  # steps not applied: non-finite, or a batch dropped by a rollback
        self.spikes = 0  # loss spikes detected
        self.rollbacks = 0
        self.dropped: set[int] = set()  # steps whose batch a rollback skips

    @property
    def active(self) -> bool:
        """Whether the loop must give the guard host values every step (a device sync)."""
        return self.cfg.skip_nonfinite or self.cfg.spike_factor > 0

    def check(self, step: int, loss: float, objective: float, grad_norm: float) -> Verdict:
        """`loss`: the step's mean cross-entropy; `objective`: what was backpropagated; `grad_norm`: the
        global gradient norm before clipping."""
        if not all(math.isfinite(v) for v in (loss, objective, grad_norm)):
            if self.cfg.skip_nonfinite:
                self.skipped += 1
                self.consecutive_skips += 1
                return Verdict(SKIP, f"non-finite loss {loss:.4g} or gradient norm {grad_norm:.4g}")
            return Verdict(APPLY)
        self.consecutive_skips = 0
        if self.cfg.spike_factor > 0 and len(self.recent) == self.recent.maxlen:
            median = statistics.median(self.recent)
            if loss > self.cfg.spike_factor * median:
                self.spikes += 1
                reason = (
                    f"loss spike {loss:.4f} > {self.cfg.spike_factor:g} x running median {median:.4f} "
                    f"(last {len(self.recent)} steps)"
                )
                if self.cfg.spike_policy == SpikePolicy.rollback:
                    return Verdict(ROLLBACK, reason)
                self.recent.append(loss)
                return Verdict(APPLY, reason)
        self.recent.append(loss)
        return Verdict(APPLY)

    def verdict(self, step: int, ce, objective, tokens: int, grad_norm, world_size: int = 1) -> Verdict:
        """The verdict on `step` from this rank's loss sums (device tensors: summed over the ranks here, so
        every rank reaches the same verdict) and the global gradient norm; one host sync while active."""
        if step in self.dropped:
            self.drop(step)
            return Verdict(SKIP, "batch dropped by an earlier rollback")
        if not self.active:
            return Verdict(APPLY)
        if world_size > 1:
            from trmoe.runtime.distributed import all_reduce_sum

            ce, objective = all_reduce_sum(ce, objective)
            tokens *= world_size
        loss, obj, norm = torch.stack([ce / tokens, objective / tokens, grad_norm.to(ce.dtype)]).tolist()
        return self.check(step, loss, obj, norm)

    def halt_reason(self, step: int, saved: bool) -> str:
        """Why the run stops at `step` (too_many_skips), and where its last good state is."""
        kept = f"in checkpoint step_{step:08d}" if saved else "not saved (checkpoint.enabled=false)"
        return (
            f"stopped at step {step}: {self.consecutive_skips} consecutive steps had a non-finite loss or "
            f"gradient (guard.max_skips={self.cfg.max_skips}); the last good state is {kept}"
        )

    def drop(self, step: int) -> None:
        """Count a batch that a rollback skips (when the replay reaches it)."""
        self.skipped += 1

    def columns_declared(self) -> tuple[MetricColumn, ...]:
        return self.COLUMNS

    def row(self, step: int, row) -> dict[str, Any]:
        """Its metrics columns (a producer, trmoe.run.columns)."""
        return {"skipped_steps": self.skipped, "loss_spikes": self.spikes}

    @property
    def too_many_skips(self) -> bool:
        return self.consecutive_skips >= self.cfg.max_skips

    # ------------------------------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return {
            "recent": list(self.recent),
            "consecutive_skips": self.consecutive_skips,
            "skipped": self.skipped,
            "spikes": self.spikes,
            "rollbacks": self.rollbacks,
            "dropped": sorted(self.dropped),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.recent = deque(state["recent"], maxlen=self.cfg.spike_window)
        self.consecutive_skips = int(state["consecutive_skips"])
        self.skipped = int(state["skipped"])
        self.spikes = int(state["spikes"])
        self.rollbacks = int(state["rollbacks"])
        self.dropped = set(state["dropped"])

    def rollback_carry(self, spike_step: int) -> dict[str, Any]:
        """What a rollback keeps across the reload of a checkpoint's guard state: the spike count, the
        rollback itself and the batch to skip. The rest (running median, skip counts) is the checkpoint's,
        and the replay of the steps since rebuilds it exactly."""
        dropped = self.dropped | {spike_step}
        return {"spikes": self.spikes, "rollbacks": self.rollbacks + 1, "dropped": dropped}

    def apply_carry(self, carry: dict[str, Any]) -> None:
        self.spikes, self.rollbacks, self.dropped = carry["spikes"], carry["rollbacks"], set(carry["dropped"])


def rollback_note(restored: int, step: int) -> str:
    """What a rollback from `step` to the checkpoint of step `restored` redoes, in words: the steps between
    them are recomputed (none when the checkpoint is the step just before) and batch `step` is skipped."""
    first, last = restored + 1, step - 1
    if first > last:
        redo = "no step is recomputed"
    elif first == last:
        redo = f"step {first} is recomputed"
    else:
        redo = f"steps {first}..{last} are recomputed"
    return f"{redo}, batch {step} is skipped"
