"""The harness's index of its own task YAMLs, kept on disk between processes.

lm-evaluation-harness indexes every YAML under lm_eval/tasks (~15,000 files, ~7 s of CPU) in each process
that builds a TaskManager with its default tasks: `python -m trmoe.eval`, training with `downstream.tasks`,
`trmoe-lm-eval`. `CachedTaskManager` is the harness's TaskManager with that part read from a file while the
folder is unchanged; a local `include_path` is indexed afresh every time (small, and edited by its user), and
its tasks override default ones of the same name, as the harness's own order does.

The file: `<cache_dir()>/lm_eval_tasks-<key>.json`. The key is a SHA-256 of the lm_eval version, the folder's
path, and every file under it (relative path, size, mtime in ns; every file, since a YAML's `include:` may
name one without the .yaml ending; the harness's own YAMLs include files of this folder only, 10,453
includes in lm_eval 0.4.13): a file added, removed or edited gives a new key, so a stale index is never
read; an index naming a YAML file that no longer exists is not read either (it is built and written again,
and the log names the cache file); writing a new file deletes the older ones. An index that JSON cannot
hold exactly (checked before writing), an lm_eval whose index entries or manager differ from the shape
known here, or a cache folder that cannot be read or written: the harness's own indexing, as without the
cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
from importlib.metadata import version
from pathlib import Path

import lm_eval.tasks
from lm_eval.tasks import TaskManager
from lm_eval.tasks._index import Entry, Kind

from trmoe.durable import json_text, write_file

log = logging.getLogger("trmoe")

FORMAT = 1  # of the cache file; a change gives new keys
FIELDS = ("name", "kind", "yaml_path", "cfg", "tags")  # lm_eval's index Entry, as encoded here
_IGNORED = {"__pycache__", ".ipynb_checkpoints"}  # folders the harness skips (and Python writes into)
_MANAGER = ("_index", "_all_tasks", "_all_subtasks", "_all_groups", "_all_tags")


def cache_dir() -> Path:
    """$TRMOE_CACHE_DIR, else $XDG_CACHE_HOME/trmoe, else ~/.cache/trmoe."""
    if os.environ.get("TRMOE_CACHE_DIR"):
        return Path(os.environ["TRMOE_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trmoe"


def folder_key(root: Path) -> str:
    """SHA-256 of the lm_eval version, `root` and (relative path, size, mtime_ns) of every file under it."""
    digest = hashlib.sha256(f"{FORMAT}\0{version('lm_eval')}\0{root.resolve()}\0".encode())
    for folder, dirs, files in os.walk(root, followlinks=True):
        dirs[:] = sorted(d for d in dirs if d not in _IGNORED)
        for name in sorted(files):
            path = os.path.join(folder, name)
            st = os.stat(path)
            digest.update(f"{os.path.relpath(path, root)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def is_cached(root: Path) -> bool:
    """Whether `folder_index(root)` reads its index from the cache (no indexing of the harness's own)."""
    try:
        return (cache_dir() / f"lm_eval_tasks-{folder_key(root)}.json").is_file()
    except OSError:
        return False


_NAME = re.compile(rb"^[\s-]*(?:task|group|tag)\s*:\s*[\"']?([\w.\-]+)", re.MULTILINE)
_NOT_YAML = (".py", ".pyc", ".md", ".json", ".jsonl", ".txt", ".csv", ".ipynb")


def unwritten(root: Path, names: list[str]) -> tuple[list[str], list[str]]:
    """(those of `names` that no file under `root` contains at all, the task, group and tag names its YAMLs
    declare): a name written nowhere cannot be in the harness's index of `root`, so it can be refused,
    with a close name, after a read of the files (~1.5 s of CPU) instead of the first full indexing (~7 s
    of CPU, a minute of wall on a slow disk). The declared names are a reading of the YAML lines, good for
    suggestions only."""
    missing = {name: name.encode() for name in names}
    declared: set[bytes] = set()
    for folder, dirs, files in os.walk(root, followlinks=True):
        dirs[:] = [d for d in dirs if d not in _IGNORED]
        for name in files:
            if name.endswith(_NOT_YAML):
                continue
            try:
                data = Path(folder, name).read_bytes()
            except OSError:
                continue
            declared.update(_NAME.findall(data))
            for task, encoded in list(missing.items()):
                if encoded in data:
                    del missing[task]
    return list(missing), sorted(n.decode(errors="replace") for n in declared)


def _encode(index: dict[str, Entry]) -> dict:
    return {
        name: [e.name, e.kind.name, None if e.yaml_path is None else str(e.yaml_path), e.cfg, sorted(e.tags)]
        for name, e in index.items()
    }


def _decode(entries: dict) -> dict[str, Entry]:
    return {
        key: Entry(name, Kind[kind], None if path is None else Path(path), cfg, set(tags))
        for key, (name, kind, path, cfg, tags) in entries.items()
    }


def folder_index(root: Path) -> dict[str, Entry]:
    """The harness's index of `root` ({name: Entry}, as TaskManager builds it), from the cache when its key
    matches, else built by the harness and written there."""
    try:
        key = folder_key(root)
    except OSError:  # a file gone while the folder was walked (an upgrade under way): no cache this time
        return _build(root)
    file = cache_dir() / f"lm_eval_tasks-{key}.json"
    try:
        stored = json.loads(file.read_text())
        if stored.get("key") == key:
            index = _decode(stored["entries"])
            # the key stands for the folder's files, but an entry is only as good as its YAML: one whose file
            # is gone (the cache copied or edited, a path outside the folder) is never handed to the harness
            gone = next(
                (e.yaml_path for e in index.values() if e.yaml_path and not e.yaml_path.is_file()), None
            )
            if gone is None:
                return index
            log.info("lm_eval task index %s names %s, which no longer exists: indexed again", file, gone)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass  # absent, unreadable or of another shape: built again below
    index = _build(root)
    _store(file, key, index)
    return index


def _build(root: Path) -> dict[str, Entry]:
    return TaskManager(include_path=str(root), include_defaults=False)._index


def _store(file: Path, key: str, index: dict[str, Entry]) -> None:
    """Written whole (trmoe.durable: a reader sees no file or the whole one; two processes writing the same
    key write the same bytes), only when JSON gives back exactly these entries (JSON has no tuple, date or
    non-string key); the older index files of the folder (other keys: never read again) are deleted either
    way. No fsync: a lost file is indexed again."""
    try:
        entries = _encode(index)
        text = json_text({"key": key, "entries": entries})
        if json.loads(text)["entries"] != entries:
            text = None
    except (TypeError, ValueError):  # a YAML date, bytes, a set...
        text = None
    try:
        if text is not None:
            file.parent.mkdir(parents=True, exist_ok=True)
            write_file(file, text, fsync=False)
        for old in file.parent.glob("lm_eval_tasks-*.json"):
            if old != file:
                old.unlink(missing_ok=True)
    except OSError as e:  # a read-only or full cache folder: the next process indexes again
        log.debug("lm_eval task index not cached at %s: %s", file, e)


class CachedTaskManager(TaskManager):
    """The harness's TaskManager (same arguments) whose default tasks' index comes from `folder_index`."""

    defaults = Path(lm_eval.tasks.__file__).parent  # the folder the harness indexes as its defaults

    def __init__(self, verbosity=None, include_path=None, include_defaults: bool = True, metadata=None):
        super().__init__(verbosity, include_path=include_path, include_defaults=False, metadata=metadata)
        if not include_defaults:
            return
        if [f.name for f in dataclasses.fields(Entry)] != list(FIELDS) or not all(
            hasattr(self, a) for a in _MANAGER
        ):  # another lm_eval's internals: its own full indexing
            super().__init__(verbosity, include_path=include_path, include_defaults=True, metadata=metadata)
            return
        index = {**folder_index(self.defaults), **self._index}  # later paths override earlier, as the harness
        self._index = index
        self._all_tasks = sorted(index)
        self._all_subtasks = sorted(n for n, e in index.items() if e.kind in (Kind.TASK, Kind.PY_TASK))
        self._all_groups = sorted(n for n, e in index.items() if e.kind is Kind.GROUP)
        self._all_tags = sorted(n for n, e in index.items() if e.kind is Kind.TAG)
