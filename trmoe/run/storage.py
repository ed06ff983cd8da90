"""When the run directory cannot be written: a full disk, a quota, a read-only filesystem, an I/O error.

Such a failure ends the run with one line and exit code 3 (`RunFailed`), never a traceback, wherever it
is met: Hydra making the run directory, the lock, or any later write, of a new run or of one that exists.
The line names the file and the newest complete checkpoint, `status.json` says failed (rewritten in place
when there is no room for a new file: `trmoe.run.status.write_status`), and no temporary file is left
behind. A failed periodic checkpoint is not such a failure: the run goes on (docs/reliability.md).
Something of the wrong kind in the way (a file where the run directory or a folder above it goes, a
directory where the lock file goes) is another class: bad input, exit 2, nothing made (`cannot_create`).
"""

from __future__ import annotations

import errno
import logging
import os
import sys
from pathlib import Path

from trmoe.durable import FULL_OR_READ_ONLY
from trmoe.errors import RunFailed, UserError, file_in_the_way

# the filesystem refusing a write for lack of permission (a path of the run directory's own, see below)
NO_PERMISSION = frozenset({errno.EACCES, errno.EPERM})


def is_storage_error(exc: BaseException, run_dir: Path) -> bool:
    """An OSError of the run directory's storage: a full or read-only filesystem, or no permission on a file
    of the run directory (not on an input: reading the data is another error)."""
    if not isinstance(exc, OSError):
        return False
    if exc.errno in FULL_OR_READ_ONLY:
        return True
    if exc.errno in NO_PERMISSION and exc.filename is not None:
        run = Path(run_dir).absolute()
        path = Path(str(exc.filename)).absolute()
        return path == run or run in path.parents
    return False


def failure(exc: OSError, run_dir: Path, newest: str | None) -> RunFailed:
    """The one line of a run stopped by its storage."""
    where = f" ({exc.filename})" if exc.filename else ""
    return RunFailed(
        f"cannot write the run directory {run_dir}: {exc.strerror}{where}; the newest complete checkpoint "
        f"is {newest or 'none'}"
    )


def cannot_create(exc: OSError, run_dir: Path) -> RunFailed | UserError:
    """The one line of a run directory that cannot be made (by Hydra, or for its lock). The filesystem
    refusing it (read-only, full, no permission, an I/O error) is a storage failure like any later write:
    RunFailed, exit 3. A file in the way of the directory is bad input: UserError, exit 2 (nothing made)."""
    blocker = file_in_the_way(run_dir)
    if blocker is None and (exc.errno in FULL_OR_READ_ONLY or exc.errno in NO_PERMISSION):
        return RunFailed(f"cannot create the run directory {run_dir}: {exc.strerror}")
    if blocker is not None:
        where = "" if blocker == run_dir else f" ({blocker})"
        return UserError(f"cannot create the run directory {run_dir}: a file is in the way{where}")
    return UserError(f"cannot create the run directory {run_dir}: {exc.strerror}")


class LogFile(logging.FileHandler):
    """train.log. A write that fails (a full disk) is said once, in one line on stderr, and the log stops
    there; the run itself stops at its next write of metrics or a checkpoint. (logging's default prints a
    traceback for every message.)"""

    def __init__(self, path: Path):
        super().__init__(path)
        self.broken = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.broken:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 (logging's name)
        exc = sys.exc_info()[1]
        if self.broken or not isinstance(exc, OSError):
            return super().handleError(record)
        self.broken = True
        os.write(
            2, f"trmoe: cannot write {self.baseFilename}: {exc.strerror}; train.log stops here\n".encode()
        )

    def close(self) -> None:
        try:
            super().close()
        except OSError:  # the buffer a full disk refused: already said by handleError
            self.broken = True
