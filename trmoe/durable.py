"""Files that are whole or absent: the one way trmoe replaces a file (and builds a directory) in place.

A new content is written to `.<name>.partial` in the target's directory, flushed and fsynced, renamed over the
target (`os.replace`, atomic on POSIX) and the directory fsynced, so that the rename itself survives a power
loss. A reader sees the old file or the new one, never a mix; a write that fails (a full disk, an exception in
the caller's writer) removes its partial file and leaves the old content. A kill can leave a partial file
(hidden, like every name trmoe writes aside), which nobody reads and the next write of the same target
replaces. A symbolic link at the target is replaced (by the rename), never written through; `nofollow` is
the opener for files written in place.

JSON: `json_text` is the one encoder of every JSON file trmoe writes (and every JSON it prints). JSON has no
NaN or infinity, so a non-finite float is written as the string "NaN", "Infinity" or "-Infinity" (what
`float()` reads back exactly; `number` is the reader's side): a diverged run's records stay valid JSON.

`fsync=False` skips both fsyncs, for outputs a tool can simply make again (a sample, an export): the rename
still makes them whole or absent, but a power loss may lose them. `atomic=False` writes in place, for the
files inside a directory that is itself renamed into place when complete (a checkpoint's): the directory's
rename is the atomic step, and its writer fsyncs the directory once.

Ground floor: imports nothing from trmoe, and no torch.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

PARTIAL = ".partial"
# a full disk or quota, a read-only or failing filesystem: whatever file it hit (trmoe.run.storage's runs and
# trmoe.data.prepare's datasets end in one line on these, not a traceback)
FULL_OR_READ_ONLY = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG})

Content = str | bytes | Callable[[IO[bytes]], Any]


NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _finite(value: Any) -> Any:
    """`value` with every non-finite float replaced by its NON_FINITE name (containers walked)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def json_text(value: Any, **dumps: Any) -> str:
    """`json.dumps(value, **dumps)` that is always valid JSON: non-finite floats become "NaN", "Infinity",
    "-Infinity" (strings). (`default=` still applies to what JSON cannot hold; its results are not
    walked.)"""
    return json.dumps(_finite(value), allow_nan=False, **dumps)


def number(value: Any) -> float | None:
    """A number as `json_text` wrote it: an int or float, or a non-finite float's name; else None (a
    missing, null or non-numeric value). Bare NaN/Infinity of files written before `json_text` read as
    floats too (Python's json accepts them)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    return NON_FINITE.get(value) if isinstance(value, str) else None


def partial_path(path: Path) -> Path:
    """Where `path`'s next content is written before it replaces `path` (the same directory)."""
    return path.with_name(f".{path.name}{PARTIAL}")


def nofollow(path: str | os.PathLike, flags: int) -> int:
    """An `opener` for open() that never follows a symbolic link at `path` (OSError ELOOP instead): a file
    trmoe rewrites must not let a link redirect the write outside its directory."""
    return os.open(path, flags | os.O_NOFOLLOW, 0o666)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in `path` durable (POSIX: the directory entry lives in the directory)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AtomicFile:
    """A binary file written as `.<name>.partial` (`file`) and renamed over `path` by `commit()`; `discard()`
    removes it. As a context manager it yields `file` and commits when the block ends without an error,
    discards otherwise. For a file written over time (a token shard); `write_file` for one write."""

    def __init__(self, path: Path, *, fsync: bool = True):
        self.path = Path(path)
        self.partial = partial_path(self.path)
        self.fsync = fsync
        # the mode a plain open gives (0666 & ~umask); a link planted at the partial name is not followed
        self.file: IO[bytes] = open(self.partial, "wb", opener=nofollow)

    def commit(self) -> None:
        try:
            if self.fsync:
                self.file.flush()
                os.fsync(self.file.fileno())
            self.file.close()
            os.replace(self.partial, self.path)
        except BaseException:
            self.discard()
            raise
        if self.fsync:
            fsync_dir(self.path.parent)

    def discard(self) -> None:
        try:
            self.file.close()
        except OSError:
            pass  # a write already failed (the caller's error is the one raised) or nothing is kept anyway
        finally:
            self.partial.unlink(missing_ok=True)

    def __enter__(self) -> IO[bytes]:
        return self.file

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.discard()


def _put(f: IO[bytes], content: Content) -> Any:
    if callable(content):
        return content(f)
    f.write(content.encode("utf-8") if isinstance(content, str) else content)
    return None


def write_file(path: Path, content: Content, *, fsync: bool = True, atomic: bool = True) -> Any:
    """`path` holds `content` whole, or its previous content. `content`: text (written as UTF-8, newlines
    as given), bytes, or a function that writes into the open binary file (its result is returned).
    `fsync` and `atomic`: see the module's docstring."""
    path = Path(path)
    if atomic:
        with AtomicFile(path, fsync=fsync) as f:
            return _put(f, content)
    with open(path, "wb", opener=nofollow) as f:
        result = _put(f, content)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    return result


@contextlib.contextmanager
def staged_dir(path: Path) -> Iterator[Path]:
    """A directory built as `.<name>.partial` beside `path` (yielded; a leftover of that name is removed
    first) and renamed to `path` when the block ends without an error (an empty directory at `path` is
    replaced); an error removes it. Nothing is fsynced: what is built this way can be made again."""
    path = Path(path)
    tmp = partial_path(path)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
