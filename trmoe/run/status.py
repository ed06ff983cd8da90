"""<run dir>/status.json: whether a run is running, finished or failed (with its error line).

Written by the train loop once the run directory exists, and by the app for a sweep job that failed before
it had a run directory (a bad config in one arm), so that a sweep report can show every job.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from trmoe.durable import json_text, nofollow, write_file
from trmoe.run.rundir import STATUS as STATUS_FILE

RUNNING, FINISHED, FAILED = "running", "finished", "failed"


def error_line(exc: BaseException) -> str:
    """One line that names the error: `Type: first line of the message` (UserError: the message itself)."""
    from trmoe.errors import UserError

    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if isinstance(exc, UserError):
        return message
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def write_status(run_dir: Path, status: str, **fields: Any) -> None:
    """status.json, written whole (temporary file, rename). When that fails (a full disk: no room for the
    temporary file) the existing file is rewritten in place: its blocks already hold a status, so a failure
    can still be recorded; only if that fails too does the OSError propagate (status.json keeps its last
    value, and the run's one line on stderr is the record)."""
    record = {"status": status, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **fields}
    text = json_text(record, indent=2) + "\n"
    path = run_dir / STATUS_FILE
    try:
        write_file(path, text)
    except OSError:
        if not path.is_file():
            raise
        with open(path, "r+", opener=nofollow) as f:
            f.write(text)
            f.truncate()
            f.flush()
            os.fsync(f.fileno())


def read_status(run_dir: Path) -> dict | None:
    try:
        with open(run_dir / STATUS_FILE, opener=nofollow) as f:  # (a link: no status of this run)
            return json.loads(f.read())
    except (OSError, ValueError):
        return None


def settle_complete(run_dir: Path, step: int, meta: dict) -> str:
    """The status of a run relaunched whose newest checkpoint is its last step (nothing to train), written
    so that status.json, the log and the report say one thing; returns the log line. `meta`: that
    checkpoint's meta.json.

    Killed after its final checkpoint before it said so (no status, running), or failed after it was saved
    (a tracker, a downstream evaluation, closing a file): it finished. A checkpoint a guard's halt saved
    (meta `halted`; unknown in checkpoints written before it was recorded) stays failed, and the line says
    so rather than "complete"."""
    from trmoe.durable import number

    final = number(meta.get("eval_loss"))
    final = float("nan") if final is None else final
    recorded = read_status(run_dir)
    said = recorded.get("status") if isinstance(recorded, dict) else None
    error = (recorded.get("error") if isinstance(recorded, dict) else None) or "no error recorded"
    if said == FAILED and meta.get("halted") is not False:
        return (
            f"{run_dir}: its final checkpoint (step {step}) was saved by the failure it records ({error}): "
            "nothing to retrain, it stays failed (run.overwrite=true trains it again)"
        )
    if said in (None, RUNNING, FAILED):
        write_status(run_dir, FINISHED, final_eval_loss=final)
    if said == FAILED:
        return (
            f"{run_dir} is complete at step {step}: status.json said failed ({error}) after its final "
            "checkpoint was saved; now finished"
        )
    return f"{run_dir} is complete at step {step}: nothing to do"
