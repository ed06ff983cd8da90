"""When the run directory cannot be written: a full disk, a quota, a read-only filesystem, an I/O error.

Such a failure ends the run with one line and exit code 3 (`RunFailed`), never a traceback: the line names
the file and the newest complete checkpoint, `status.json` says failed (rewritten in place when there is no
room for a new file: `trmoe.train.status.write_status`), and no temporary file is left behind. A failed
periodic checkpoint is not such a failure: the run goes on (docs/reliability.md).
"""

from __future__ import annotations

import errno
import logging
import os
import sys
from pathlib import Path

from trmoe.errors import RunFailed

STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG, errno.EACCES})


def is_storage_error(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS


def failure(exc: OSError, run_dir: Path, newest: str | None) -> RunFailed:
    """The one line of a run stopped by its storage."""
    where = f" ({exc.filename})" if exc.filename else ""
    return RunFailed(
        f"cannot write the run directory {run_dir}: {exc.strerror}{where}; the newest complete checkpoint "
        f"is {newest or 'none'}"
    )


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
