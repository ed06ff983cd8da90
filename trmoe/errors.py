"""User-facing errors: one clear line, exit code 2, no traceback."""

from __future__ import annotations

import os
from pathlib import Path


class UserError(Exception):
    """Bad input from the user (config, file, override). The message is one line that names
    the key or file and what is allowed; the app prints it and exits with code 2."""

    exit_code = 2


class RunFailed(Exception):
    """A run that cannot go on (fault guards tripped, the final checkpoint could not be written). The message
    is one line saying why and which checkpoint holds the last good state; the app exits with code 3."""

    exit_code = 3


def file_in_the_way(path: Path) -> Path | None:
    """The file that stops a directory from being made at `path`: `path` itself or the nearest existing
    parent, when it is not a directory; None when the directory exists or can be made."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return None if candidate.is_dir() else candidate
    return None


def require_directory(path: Path, option: str, allowed: str) -> None:
    """UserError naming `option` unless a directory exists at `path` or can be made there."""
    blocker = file_in_the_way(path)
    if blocker is not None:
        where = "it" if blocker == path else str(blocker)
        raise UserError(f"{option} {path}: {where} is a file, not a directory; allowed: {allowed}")


def require_writable(path: Path, name: str, allowed: str) -> None:
    """UserError ("<name>: ...; <allowed>") unless the file `path` can be written: a file in the way of its
    folder, or `path` (or its nearest existing folder) not writable (a read-only filesystem, for root too:
    access(2) answers EROFS; no permission). Checked before a tool's work, whose result would else be lost."""
    blocker = file_in_the_way(path.parent)
    if blocker is not None:
        raise UserError(f"{name}: {blocker} is a file, not a directory; {allowed}")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not os.access(existing, os.W_OK):
        raise UserError(f"{name}: {existing} is not writable; {allowed}")


def differences(was: dict, now: dict, whose: str, limit: int = 4) -> str:
    """The keys on which two records differ, each with both values, in first-seen order (at most `limit`, then
    a count): `key: <whose> 1, this run's 2`. A refusal that says only that something differs leaves the
    reader to diff by hand. "" when nothing differs."""
    changed = [k for k in dict.fromkeys([*was, *now]) if was.get(k, "<absent>") != now.get(k, "<absent>")]
    shown = [
        f"{k}: {whose} {was.get(k, '<absent>')}, this run's {now.get(k, '<absent>')}" for k in changed[:limit]
    ]
    return "; ".join(shown) + (f"; {len(changed) - limit} more" if len(changed) > limit else "")


def shape_difference(old: dict[str, tuple], new: dict[str, tuple], whose: str) -> tuple[int, str]:
    """How many tensors differ, and the first as `name: <whose> (16,), this run's (32,)`: two bare shapes
    side by side leave the reader to guess which is which."""
    name = min(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    count = sum(old.get(k) != new.get(k) for k in old.keys() | new.keys())
    return count, f"{name}: {whose} {old.get(name, '<absent>')}, this run's {new.get(name, '<absent>')}"
