"""What a run's records say about its end: the final step, the loss there, and whether it diverged or its
records disagree.

A report must never show a figure from another step as the final one (a diverged run's NaN dropped, its
step-0 loss shown instead), nor pair a diverged run with the control: such a run is flagged, its final
figure is its non-finite value, and the paired statistics leave it out and count it with the reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trmoe.durable import number
from trmoe.report.runs import Run
from trmoe.run.status import FINISHED

# status.json's final_eval_loss and metrics.csv's last eval_loss are the same float, written once with
# repr and once with 9 significant digits
_SAME = 1e-7


@dataclass
class Integrity:
    final_step: int | None  # the run's final step: trainer.steps if it finished, else its last logged step
    final_eval: (
        float | None
    )  # the held-out loss at final_step (NaN/inf kept), None if none was recorded there
    diverged: str | None = None  # why the run counts as diverged (a non-finite loss), else None
    disagreements: list[str] = field(default_factory=list)  # records that contradict each other


def value_at(run: Run, step: float | None, column: str) -> float | None:
    """The value of `column` in the row of `step` (NaN and inf kept; None if that row or column is missing,
    or if rows of that step disagree on it: no figure is taken from one of two conflicting rows. metrics.csv
    writes an empty evaluation as 'nan', so only the final row, always evaluated, tells)."""
    if step is None:
        return None
    values = [row[column] for row in run.rows if row.get("step") == step and column in row]
    if len({"nan" if math.isnan(v) else v for v in values}) != 1:
        return None
    return values[-1]


def assess(run: Run) -> Integrity:
    steps = [r["step"] for r in run.rows if math.isfinite(r.get("step", math.nan))]
    last_logged = int(max(steps)) if steps else None
    planned = run.config_value("trainer.steps")
    status_record = run.status_record
    recorded = number(status_record.get("final_eval_loss"))  # "NaN" (json_text) included
    finished = run.status == FINISHED
    final_step = planned if finished and isinstance(planned, int) else last_logged
    out = Integrity(final_step=final_step, final_eval=None)

    logged = value_at(run, final_step, "eval_loss") if final_step is not None else None
    twins = [r for r in run.rows if r.get("step") == final_step]
    if len(twins) > 1:
        out.disagreements.append(
            f"metrics.csv has {len(twins)} rows for the final step {final_step}: a figure they disagree on "
            "is unknown"
        )
    if finished and last_logged != final_step:
        where = f"ends at step {last_logged}" if last_logged is not None else "has no rows"
        out.disagreements.append(
            f"metrics.csv {where}, but status.json says finished at step {final_step} (truncated?)"
        )
    if finished and recorded is not None and logged is not None and not _same(recorded, logged):
        out.disagreements.append(
            f"status.json says final eval loss {recorded:.6g}, metrics.csv {logged:.6g} at step {final_step}"
        )
    # The final figure comes from the final step only: its metrics.csv row, else status.json's figure (written
    # at that step). The final step is always evaluated, so a NaN there is the run's (a diverged run's); in
    # an unfinished run's last row it may only mean "not evaluated at this step".
    if finished:
        out.final_eval = logged if logged is not None else recorded
    elif logged is not None and math.isfinite(logged):
        out.final_eval = logged

    reasons = []
    if out.final_eval is not None and not math.isfinite(out.final_eval):
        reasons.append(f"eval loss {out.final_eval} at the final step {final_step}")
    elif recorded is not None and not math.isfinite(recorded):
        reasons.append(f"status.json's final eval loss is {recorded}")
    last_train = value_at(run, last_logged, "train_loss") if last_logged else None
    if last_train is not None and not math.isfinite(last_train):
        reasons.append(f"train loss {last_train} at step {last_logged}")
    out.diverged = "; ".join(reasons) or None
    return out


def _same(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= _SAME * max(1.0, abs(a))


def held_out_windows(run: Run) -> int | None:
    """The size of the run's held-out set at its final step, in windows (run_config.json's
    derived.eval_windows; for a run recorded before it, trainer.eval_batches x trainer.micro_batch); None
    if unknown."""
    recorded = (run.record.get("derived") or {}).get("eval_windows")
    if isinstance(recorded, int) and not isinstance(recorded, bool):
        return recorded
    batches, micro = run.config_value("trainer.eval_batches"), run.config_value("trainer.micro_batch")
    return batches * micro if isinstance(batches, int) and isinstance(micro, int) else None


def held_out_changes(run: Run) -> list[tuple[int, str]]:
    """(step, what) for each resume that changed the held-out set: the evaluations up to that step scored
    other windows than the ones after it."""
    resumes = run.record.get("resumes")
    out = []
    for entry in resumes if isinstance(resumes, list) else []:
        changes = entry.get("volatile_changes") if isinstance(entry, dict) else None
        step = entry.get("from_step") if isinstance(entry, dict) else None
        if not isinstance(changes, dict) or not isinstance(step, int):
            continue
        old, new = (changes.get("derived.eval_windows") or [None, None])[:2]
        if isinstance(old, int) and isinstance(new, int):
            if old != new:
                out.append((step, f"{old} -> {new} windows"))
        elif any(k in changes for k in ("trainer.micro_batch", "trainer.eval_batches")):
            out.append((step, "trainer.eval_batches or trainer.micro_batch changed"))
    return out
