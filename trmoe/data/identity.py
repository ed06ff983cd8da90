"""The identity of a data file is its content, not its name, size or location: a file edited to the same
byte size must not pass for the original on resume, and the same file moved must."""

from __future__ import annotations

import hashlib
from pathlib import Path

_CHUNK = 1 << 22


def file_sha256(path: Path) -> str:
    """SHA-256 of the file's bytes, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
