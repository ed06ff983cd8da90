"""trmoe.durable on real files: a replaced file is whole or absent; no other copy of the mechanism."""

from __future__ import annotations

import ast
import os
import stat
from pathlib import Path

import pytest

import trmoe
from trmoe import durable
from trmoe.durable import AtomicFile, partial_path, staged_dir, write_file

PACKAGE = Path(trmoe.__file__).parent


class Boom(Exception):
    pass


def test_text_bytes_and_a_writer_give_the_exact_bytes(tmp_path):
    target = tmp_path / "f"
    write_file(target, "a\r\nb\né\n")  # newlines as given, UTF-8
    assert target.read_bytes() == "a\r\nb\né\n".encode()
    write_file(target, b"\x00\x01")
    assert target.read_bytes() == b"\x00\x01"
    assert write_file(target, lambda f: f.write(b"xyz") and "result") == "result"
    assert target.read_bytes() == b"xyz"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


@pytest.mark.parametrize("fsync", [True, False])
def test_a_writer_that_fails_half_way_leaves_the_old_content_and_no_partial_file(tmp_path, fsync):
    target = tmp_path / "state.json"
    target.write_text("old\n")

    def half(f):
        f.write(b"new, half")
        f.flush()
        assert partial_path(target).read_bytes() == b"new, half"  # written aside, not over the target
        raise Boom

    with pytest.raises(Boom):
        write_file(target, half, fsync=fsync)
    assert target.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_a_full_disk_at_the_fsync_leaves_the_old_content(tmp_path, monkeypatch):
    target = tmp_path / "f"
    target.write_text("old")

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        write_file(target, "new")
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_a_partial_file_a_kill_left_is_replaced_by_the_next_write(tmp_path):
    target = tmp_path / "latest"
    partial_path(target).write_text("step_00000009 cut sh")
    assert partial_path(target).name == ".latest.partial"  # hidden: a listing of the directory skips it
    write_file(target, "step_00000010\n")
    assert target.read_text() == "step_00000010\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_a_new_file_has_the_mode_a_plain_open_gives(tmp_path, mask):
    """Not a temporary file's 0600: what open(path, "w") would make under the process's umask."""
    old = os.umask(mask)
    try:
        write_file(tmp_path / "durable", "x")
        write_file(tmp_path / "quick", "x", fsync=False)
        with open(tmp_path / "plain", "w") as f:
            f.write("x")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes == dict.fromkeys(("durable", "quick", "plain"), 0o666 & ~mask)


def _fsync_spy(monkeypatch) -> list[str]:
    """What os.fsync was called on, in order ('dir:<name>' or 'file:<name>'), passing each call through."""
    calls: list[str] = []
    real = os.fsync

    def spy(fd):
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        calls.append(f"{'dir' if path.is_dir() else 'file'}:{path.name}")
        return real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return calls


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads /proc/self/fd")
def test_the_file_is_fsynced_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    calls = _fsync_spy(monkeypatch)
    replace = os.replace

    def seen_replace(src, dst):
        calls.append(f"replace:{Path(src).name}->{Path(dst).name}")
        return replace(src, dst)

    monkeypatch.setattr(os, "replace", seen_replace)
    (tmp_path / "d").mkdir()
    write_file(tmp_path / "d" / "f", "x")
    assert calls == ["file:.f.partial", "replace:.f.partial->f", "dir:d"]
    calls.clear()
    write_file(tmp_path / "d" / "g", "x", fsync=False)
    assert calls == ["replace:.g.partial->g"]
    calls.clear()
    write_file(tmp_path / "d" / "h", "x", atomic=False)  # in a directory renamed into place as a whole
    assert calls == ["file:h"]


def test_an_atomic_file_streams_aside_until_commit(tmp_path):
    target = tmp_path / "tokens.bin"
    target.write_bytes(b"old")
    out = AtomicFile(target)
    out.file.write(b"new ")
    out.file.write(b"tokens")
    assert target.read_bytes() == b"old"
    out.commit()
    assert target.read_bytes() == b"new tokens" and sorted(p.name for p in tmp_path.iterdir()) == [
        "tokens.bin"
    ]

    aborted = AtomicFile(target)
    aborted.file.write(b"never")
    aborted.discard()
    assert target.read_bytes() == b"new tokens" and sorted(p.name for p in tmp_path.iterdir()) == [
        "tokens.bin"
    ]

    with pytest.raises(Boom), AtomicFile(target) as f:
        f.write(b"half")
        raise Boom
    assert target.read_bytes() == b"new tokens" and sorted(p.name for p in tmp_path.iterdir()) == [
        "tokens.bin"
    ]


def test_a_staged_directory_appears_whole_or_not_at_all(tmp_path):
    out = tmp_path / "export"
    partial_path(out).mkdir()
    (partial_path(out) / "stale").write_text("a killed run's")
    with staged_dir(out) as tmp:
        assert tmp == partial_path(out) and list(tmp.iterdir()) == []  # the leftover was removed first
        (tmp / "model.safetensors").write_bytes(b"weights")
        assert not out.exists()
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]

    empty = tmp_path / "empty"
    empty.mkdir()
    with staged_dir(empty) as tmp:
        (tmp / "config.json").write_text("{}")
    assert [p.name for p in empty.iterdir()] == ["config.json"]  # an empty directory is replaced

    failed = tmp_path / "failed"
    with pytest.raises(Boom), staged_dir(failed) as tmp:
        (tmp / "half").write_text("x")
        raise Boom
    assert not failed.exists() and not partial_path(failed).exists()


# ----------------------------------------------------------------------------------- the only copy of it

# Where a file-system primitive of the mechanism may still be called outside trmoe/durable.py, and why.
EXCEPTIONS = {
    ("run/checkpoint.py", "os.rename"): "checkpoint directories: a save's rename into place, a re-save's "
    "set-aside copy, pruning and set_aside (the store's directory protocol; its files go through durable)",
    ("run/records.py", "os.fsync"): "StepCsv.sync: an append-only CSV fsynced in place before a checkpoint",
    ("run/status.py", "os.fsync"): "status.json rewritten in place when a full disk leaves no room for a "
    "partial file (its blocks already hold a status)",
    (
        "report/build.py",
        "NamedTemporaryFile",
    ): "a probe of whether the report folder is writable; nothing is kept",
}
TEMPORARY = {"NamedTemporaryFile", "mkstemp"}  # a file written aside (a scratch directory is not)


def primitives(tree: ast.AST) -> set[str]:
    """The calls of the mechanism's primitives in a module: os.replace/rename/fsync, Path.replace/rename (one
    argument: str.replace takes two) and tempfile's temporary files."""
    found = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "os":
            if name in ("replace", "rename", "fsync"):
                found.add(f"os.{name}")
        elif name in ("replace", "rename") and len(node.args) == 1 and not node.keywords:
            found.add(f"Path.{name}")
        elif name in TEMPORARY:
            found.add(name)
    return found


# the modules that each wrote their own copy before trmoe.durable, and what they use of it now
FORMER_COPIES = {
    "run/records.py": {"write_file"},
    "run/checkpoint.py": {"write_file", "fsync_dir"},
    "run/status.py": {"write_file"},
    "data/prepare.py": {"write_file"},
    "data/shards.py": {"AtomicFile", "write_file"},
    "sample.py": {"write_file"},
    "export/__init__.py": {"staged_dir"},
    "eval/__main__.py": {"write_file"},
    "convert/__init__.py": {"staged_dir", "write_file"},
    "run/trackers.py": {"write_file"},
    "report/build.py": {"write_file"},
}


def test_no_copy_of_the_mechanism_outside_durable():
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel != "durable.py":
            found |= {(rel, name) for name in primitives(ast.parse(path.read_text()))}
    unexplained = sorted(found - set(EXCEPTIONS))
    assert unexplained == [], (
        f"write through trmoe.durable, or list the call here with its reason: {unexplained}"
    )
    stale = sorted(set(EXCEPTIONS) - found)
    assert stale == [], f"exceptions no longer needed: {stale}"


def test_every_former_copy_imports_the_mechanism():
    for rel, names in FORMER_COPIES.items():
        tree = ast.parse((PACKAGE / rel).read_text())
        imported = {
            alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module == "trmoe.durable"
            for alias in node.names
        }
        assert names <= imported, (rel, imported)


def test_durable_is_ground_floor():
    tree = ast.parse(Path(durable.__file__).read_text())
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }
    assert not {m for m in modules if m and (m.startswith("trmoe") or m.split(".")[0] in ("torch", "numpy"))}
