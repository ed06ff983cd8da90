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
from trmoe.run import lock
from trmoe.run.rundir import LOCK as LOCK_FILE
from trmoe.run.rundir import STATUS as STATUS_FILE

RUNNING, FINISHED, FAILED = "running", "finished", "failed"
KILLED = "killed"  # was running, and the launch has ended without saying how (SIGKILL, OOM, a lost node)
ENDED_UNSAID = (
    "the launch that was running it ended without recording how (killed: SIGKILL, out of memory, a lost "
    "node, a crash); a rerun resumes from its newest complete checkpoint"
)


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
    """status.json as its writer left it, except that `running` is read as `killed` (ENDED_UNSAID) once no
    live launch holds the run's lock (trmoe.run.lock.held): a SIGKILL leaves no chance to write anything, so
    a stale `running` is recognised here, as a dead holder's lock is. The file is rewritten too, under the
    lock, so that a launch starting meanwhile (which writes `running` only once it holds it) is not undone.
    Where flock holds within one node only (Lustre -o localflock, NFS -o nolock: trmoe.run.lock), a reader on
    another node reads a live run as killed too; the run's own final status still replaces it."""
    record = _read(run_dir)
    if isinstance(record, dict) and record.get("status") == RUNNING and not lock.held(run_dir):
        record = {**record, "status": KILLED, "error": ENDED_UNSAID, "running_since": record.get("time")}
        _settle_killed(run_dir, record)
    return record


def _read(run_dir: Path) -> dict | None:
    try:
        with open(run_dir / STATUS_FILE, opener=nofollow) as f:  # (a link: no status of this run)
            return json.loads(f.read())
    except (OSError, ValueError):
        return None


def _settle_killed(run_dir: Path, record: dict) -> None:
    """Rewrite a stale `running` status.json as `record`, holding the run's lock file exclusively meanwhile
    (not when there is none, or a launch has taken it since; nothing if the directory is read-only)."""
    import fcntl

    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return  # no lock file: the reader's answer is the record; the next launch writes its own status
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # a launch may have come and gone since the check (its own status, its lock file removed): only the
        # same stale record, under the lock file still at the path, is rewritten
        now = _read(run_dir)
        stale = (RUNNING, record["running_since"])
        same = isinstance(now, dict) and (now.get("status"), now.get("time")) == stale
        if not same or not os.path.samestat(os.fstat(fd), os.stat(run_dir / LOCK_FILE)):
            return
        fields = {k: v for k, v in record.items() if k not in ("status", "time")}
        write_status(run_dir, KILLED, **fields)
    except OSError:
        pass  # a launch holds it now, or the disk refuses: status.json stays, the answer above holds
    finally:
        os.close(fd)


def settle_complete(run_dir: Path, step: int, meta: dict) -> str:
    """The status of a run relaunched whose newest checkpoint is its last step (nothing to train), written
    so that status.json, the log and the report say one thing; returns the log line. `meta`: that
    checkpoint's meta.json.

    Killed after its final checkpoint before it said so (no status, running, killed), or failed after it was
    saved (a tracker, a downstream evaluation, closing a file): it finished. A checkpoint a guard's halt saved
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
    if said in (None, RUNNING, KILLED, FAILED):
        write_status(run_dir, FINISHED, final_eval_loss=final)
    if said == FAILED:
        return (
            f"{run_dir} is complete at step {step}: status.json said failed ({error}) after its final "
            "checkpoint was saved; now finished"
        )
    return f"{run_dir} is complete at step {step}: nothing to do"
