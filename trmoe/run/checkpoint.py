"""Checkpoints that are complete or absent, never half-written.

    <run dir>/checkpoints/
      step_00000040/          one complete checkpoint
        meta.json             step, tokens, config and its hash, metrics position, size + CRC32 of every file
        model_optim.pt        model and optimizer state (format "torch": one torch.save file)
          or .metadata, __<rank>_<i>.distcp ...  (format "dcp": torch.distributed.checkpoint, per rank)
        rank_00000.pt         rank-local train state: RNG states, data cursor, metrics window, guard state
      latest                  name of the newest complete checkpoint (replaced atomically, after it)
      .step_00000048.tmp/     a save in progress (or killed): never read, removed by the next save

A save writes everything into the temporary directory, fsyncs each file, writes meta.json last, fsyncs the
directory, renames it to step_XXXXXXXX and fsyncs the parent: a kill at any instant leaves either the old set
of checkpoints or the old set plus the new one. Only then is `latest` replaced (temporary file, fsync,
rename) and are checkpoints beyond `keep_last` pruned, oldest first (never those of `at_steps`); the newest
is never pruned. A load checks every file against meta.json (size and CRC32) first, so a truncated or
corrupted checkpoint is reported and the previous complete one is used instead (`newest_good`).

The store owns its cadence (`due`, a trmoe.run.cadence.Cadence): every `every_steps` steps and the last
step; with checkpoint.enabled=false never, and `save` refuses: such a run cannot be resumed (a rerun starts
again at step 0).

Distributed (world size > 1, or checkpoint.format=dcp): every rank calls `save` and `load`; model and
optimizer go through torch.distributed.checkpoint (each rank writes its own part), each rank writes its own
rank_XXXXX.pt, and rank 0 alone writes meta.json, renames, updates `latest` and prunes.

Over 400 lines on purpose: the durability contract above (write, verify, load, prune, the cadence) is one
mechanism whose steps depend on each other's invariants; split, its crash-safety could no longer be read in
one place.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import time
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trmoe.config.schema import CheckpointConfig
from trmoe.durable import fsync_dir, json_text, number, write_file
from trmoe.errors import UserError
from trmoe.run.cadence import NEVER, Cadence
from trmoe.run.rundir import CHECKPOINTS, LATEST, RunDir

log = logging.getLogger("trmoe")

# 2: meta.json carries `meta_crc32`, the CRC32 of its own content (a single flipped bit cannot turn the 2
# into the 1 of the unsealed format, nor make the seal's key vanish unnoticed). 1 is still read.
FORMAT_VERSION = 2
READ_VERSIONS = (1, 2)
SEAL = "meta_crc32"
META = "meta.json"
TORCH_PAYLOAD = "model_optim.pt"
STEP_DIR = re.compile(r"^step_(\d{8,})$")
# The copy a re-save of the same step set aside (`_move_into_place`): the checkpoint itself while no
# step_N stands beside it (a kill between the re-save's two renames).
REPLACED_DIR = re.compile(r"^\.(step_\d{8,})\.old$")
_CHUNK = 8 << 20


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message says which file and why."""


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    meta: dict[str, Any]

    @property
    def content_hash(self) -> str:
        """What a run started from this checkpoint records of it (trainer.init_from, routing=distilled):
        files_digest of its verified file records."""
        return files_digest(self.meta["files"])

    def model_weights(self) -> dict[str, torch.Tensor]:
        """The model's tensors, on the CPU (a dcp checkpoint through load_checkpoint)."""
        if self.meta.get("format", "torch") == "torch":
            return torch.load(self.path / TORCH_PAYLOAD, map_location="cpu", weights_only=True)["model"]
        return load_checkpoint(self.path)["model"]


def files_digest(files: dict[str, Any]) -> str:
    """SHA-256 of file records (name -> size and CRC32): a content identity that reads no payload."""
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


# ------------------------------------------------------------------------------------------- durable files


class _ChecksumWriter:
    """A binary file wrapper that counts and CRC32s what goes through it (so the checksum in meta.json is
    of the bytes that were written, not of a later re-read)."""

    def __init__(self, f):
        self._f = f
        self.bytes = 0
        self.crc32 = 0

    def write(self, data) -> int:
        written = self._f.write(data)
        self.crc32 = zlib.crc32(memoryview(data)[:written], self.crc32)
        self.bytes += written
        return written

    def flush(self) -> None:
        self._f.flush()


def _write_durable(path: Path, obj: Any) -> dict[str, int]:
    """torch.save(obj) to path (in the temporary directory), fsynced; returns its size and CRC32."""

    def save(f) -> dict[str, int]:
        writer = _ChecksumWriter(f)
        torch.save(obj, writer)
        return {"bytes": writer.bytes, "crc32": writer.crc32}

    return write_file(path, save, atomic=False)


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError (ENOSPC, EIO, ...) behind an exception: torch.save's zip writer turns a failed write into
    a RuntimeError while it unwinds, DCP into a CheckpointException."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError):
            return exc
        seen.add(id(exc))
        failures = getattr(exc, "failures", None)  # DCP: {rank: exception}
        if isinstance(failures, dict):
            for failure in failures.values():
                if isinstance(failure, BaseException) and (found := _os_error(failure)) is not None:
                    return found
        exc = exc.__cause__ or exc.__context__
    return None


def file_crc32(path: Path) -> dict[str, int]:
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return {"bytes": size, "crc32": crc}


def write_pointer(directory: Path, name: str) -> None:
    """Atomically replace `latest` with `name` (latest.partial, fsync, rename, directory fsync)."""
    write_file(directory / LATEST, name + "\n")


def read_pointer(directory: Path) -> str | None:
    try:
        return (directory / LATEST).read_text().strip() or None
    except (OSError, ValueError):  # missing, or not text (UnicodeDecodeError): no pointer
        return None


# --------------------------------------------------------------------------------------------------- store


def _dist_active() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """DCP's state-dict helpers take torch optimizers; trmoe's OptimizerSet (muon_tr) holds several."""
    inner = getattr(optimizer, "optimizers", None)
    return list(inner.values()) if isinstance(inner, dict) else [optimizer]


def _sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _shard_like_params(optimizer) -> None:
    """After loading a full (single-process) optimizer state into an FSDP run: each state tensor of a
    parameter's shape becomes this rank's shard of it, placed as the parameter is. Without FSDP: nothing."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for opt in _optimizers(optimizer):
        for param, state in opt.state.items():
            if not isinstance(param, DTensor):
                continue
            for key, value in state.items():
                if torch.is_tensor(value) and not isinstance(value, DTensor) and value.shape == param.shape:
                    # every rank holds the whole tensor: each keeps its own part, nothing is sent
                    state[key] = distribute_tensor(
                        value, param.device_mesh, param.placements, src_data_rank=None
                    )


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns on every save/load without a process group ("assuming ... a single process"): expected."""
    with warnings.catch_warnings():
        if not _dist_active():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield


def _barrier() -> None:
    if _dist_active():
        torch.distributed.barrier()


def _agree(failure: BaseException | None) -> None:
    """Every rank raises when any rank's part of a save failed (ENOSPC on one disk, say), so that all of
    them go on the same way, none left waiting in a collective; a no-op when none failed. Collective."""
    if _dist_active():
        from trmoe.runtime.distributed import collective_device

        flag = torch.tensor([0 if failure is None else 1], device=collective_device())
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        if flag.item() and failure is None:
            raise OSError("the checkpoint write failed on another rank (see its log)")
    if failure is not None:
        raise failure


def _empty(optimizer) -> bool:
    return not any(o.state for o in _optimizers(optimizer))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_file_record(value: Any) -> bool:
    return (
        isinstance(value, dict) and value.keys() == {"bytes", "crc32"} and all(map(_is_int, value.values()))
    )


# What the store and a resume read from meta.json, and what each must be; the last five may be absent. Valid
# JSON of another shape (a hand edit, another tool's file) makes the checkpoint unusable (the previous one
# is used), not the resume crash.
_META_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "step": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "format": (lambda v: v in ("torch", "dcp"), '"torch" or "dcp"'),
    "files": (
        lambda v: isinstance(v, dict) and all(map(_is_file_record, v.values())),
        'an object of {"bytes": int, "crc32": int} per file',
    ),
    "config": (lambda v: isinstance(v, dict), "an object"),
    "derived": (lambda v: isinstance(v, dict), "an object"),
    "data": (lambda v: isinstance(v, dict), "an object"),
    "metrics": (lambda v: isinstance(v, dict), "an object"),
    "eval_loss": (lambda v: number(v) is not None, "a number"),
}
_OPTIONAL = ("config", "derived", "data", "metrics", "eval_loss")


def _meta_text(record: dict[str, Any], *, legacy: bool = False) -> str:
    """meta.json's canonical text (`legacy`: as written before json_text, bare NaN for a diverged loss)."""
    return (json.dumps if legacy else json_text)(record, indent=1, sort_keys=True) + "\n"


def seal_meta(record: dict[str, Any]) -> str:
    """meta.json's text: `record` with the CRC32 of its canonical text (`meta_crc32`), so that every byte a
    resume relies on is verified, the step and the other files' checksums included."""
    record = {k: v for k, v in record.items() if k != SEAL}
    record["format_version"] = FORMAT_VERSION
    return _meta_text({**record, SEAL: zlib.crc32(_meta_text(record).encode())})


def _check_seal(path: Path, meta: dict[str, Any]) -> None:
    """The seal of a version-2 meta.json, and its step against the directory's name (`step_N`)."""
    if meta["format_version"] >= 2:
        content = {k: v for k, v in meta.items() if k != SEAL}
        sealed = {zlib.crc32(_meta_text(content, legacy=legacy).encode()) for legacy in (False, True)}
        if SEAL not in meta or meta[SEAL] not in sealed:
            raise CheckpointError(f"{path}: {META}: CRC32 mismatch (corrupted)")
    named = STEP_DIR.match(path.name) or REPLACED_DIR.match(path.name)
    if named is not None:
        name_step = int(named.group(1).removeprefix("step_"))
        if name_step != meta["step"]:
            raise CheckpointError(
                f"{path}: {META} says step {meta['step']}, the directory's name {name_step}"
            )


def _check_meta_fields(path: Path, meta: dict[str, Any]) -> None:
    for key, (valid, expected) in _META_FIELDS.items():
        if key in meta and not valid(meta[key]):
            shown = json.dumps(meta[key])[:60]
            raise CheckpointError(f"{path}: {META}: {key} = {shown}; expected {expected}")
        if key not in meta and key not in _OPTIONAL:
            raise CheckpointError(f"{path}: {META} has no {key}")


class CheckpointStore:
    """Save, list, verify, load and prune the checkpoints of one run directory, at its cadence.

    `format`: "torch" (one torch.save file, single process) or "dcp" (torch.distributed.checkpoint; required
    when world_size > 1). Every rank calls save/load with the same arguments; only rank 0 writes meta.json,
    the rename, `latest` and the pruning. `every_steps`, `last_step` and `enabled`: the save cadence (`due`,
    `maybe_save`; every_steps=0 = only the last step, `at_steps` and the saves a caller forces)."""

    def __init__(
        self,
        directory: Path,
        *,
        keep_last: int = 2,
        format: str = "torch",
        rank: int = 0,
        world_size: int = 1,
        every_steps: int = 0,
        last_step: int | None = None,
        enabled: bool = True,
        at_steps: tuple[int, ...] = (),
    ):
        if format not in ("torch", "dcp"):
            raise ValueError(f"checkpoint format must be torch or dcp, got {format!r}")
        if world_size > 1 and format != "dcp":
            raise ValueError("a distributed run (world_size > 1) checkpoints with format dcp")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.kept_steps = frozenset(at_steps) if enabled else frozenset()  # asked for by step: never pruned
        self.format = format
        self.rank = rank
        self.world_size = world_size
        self.every_steps = every_steps
        self.enabled = enabled
        self.cadence = (
            Cadence(every_steps, at=(*at_steps, *(() if last_step is None else (last_step,))))
            if enabled
            else NEVER
        )
        self.last_saved: int | None = None  # the step this process saved last (maybe_save)
        self.last_failure = ""  # why the last save failed (for the run's one line)

    @classmethod
    def for_run(
        cls,
        cfg: CheckpointConfig,
        run: RunDir,
        rank: int = 0,
        world_size: int = 1,
        last_step: int | None = None,
    ) -> CheckpointStore:
        """The store of a run directory as checkpoint.* configures it (`last_step`: the run's trainer.steps,
        always saved); format `auto` is resolved here, once: dcp when distributed, torch otherwise."""
        fmt = cfg.format.value
        if fmt == "auto":
            fmt = "dcp" if world_size > 1 else "torch"
        if fmt == "torch" and world_size > 1:
            raise UserError(
                "config error: checkpoint.format=torch: distributed runs use dcp; allowed: auto, dcp"
            )
        return cls(
            run.checkpoints,
            keep_last=cfg.keep_last,
            format=fmt,
            rank=rank,
            world_size=world_size,
            every_steps=cfg.every_steps,
            last_step=last_step,
            enabled=cfg.enabled,
            at_steps=tuple(cfg.at_steps),
        )

    # -------------------------------------------------------------------------------------------- cadence

    def due(self, step: int, *, final: bool = False) -> bool:
        """Whether step `step` is saved: every `every_steps` steps (0 = none), the last step, and when
        `final` (a guard's stop, a stop signal); never when the store is disabled."""
        return self.enabled and (final or self.cadence.due(step))

    def maybe_save(
        self, step: int, state: Callable[[], dict[str, Any]], *, final: bool = False
    ) -> bool | None:
        """Save `step` if it is due; `state()` gives `save`'s keyword arguments (asked only then). None when
        nothing was due, else whether the checkpoint was written (see `try_save`)."""
        return self.try_save(step, state) if self.due(step, final=final) else None

    def try_save(self, step: int, state: Callable[[], dict[str, Any]]) -> bool:
        """Save `step` now; a failed write (full disk, I/O error) is logged and returns False (the reason in
        `last_failure`): the previous checkpoints stay, and the caller decides whether the run can go on
        without this one."""
        try:
            self.save(step, **state())
        except OSError as e:
            good = self.newest_good()
            # (a failure after the checkpoint was complete is no failed save: `_record_newest`)
            newest = f"is still {good.path.name}" if good else "is none"
            self.last_failure = f"{e}; the newest complete checkpoint {newest}"
            log.error("checkpoint at step %d failed: %s", step, self.last_failure)
            return False
        self.last_saved = step
        return True

    # -------------------------------------------------------------------------------------------- listing

    def step_dirs(self) -> list[tuple[int, Path]]:
        """(step, path) of every directory named like a complete checkpoint, oldest first; a set-aside copy
        of a step (`.step_N.old`) stands in for step_N when a kill left no step_N."""
        if not self.directory.is_dir():
            return []
        paths = [p for p in self.directory.iterdir() if p.is_dir()]
        names = {p.name for p in paths}
        found = []
        for path in paths:
            match = STEP_DIR.match(path.name)
            replaced = REPLACED_DIR.match(path.name)
            if match:
                found.append((int(match.group(1)), path))
            elif replaced and replaced.group(1) not in names:
                found.append((int(replaced.group(1).removeprefix("step_")), path))
        return sorted(found)

    def verify(self, path: Path) -> CheckpointInfo:
        """Read meta.json and check every file it lists (size, CRC32). Raises CheckpointError."""
        try:
            meta = json.loads((path / META).read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{path}: no readable {META} ({e})") from None
        if not isinstance(meta, dict) or meta.get("format_version") not in READ_VERSIONS:
            raise CheckpointError(
                f"{path}: {META} is not a trmoe checkpoint of version {' or '.join(map(str, READ_VERSIONS))}"
            )
        _check_meta_fields(path, meta)
        _check_seal(path, meta)
        for name, expected in sorted(meta["files"].items()):
            file = path / name
            try:
                actual = file_crc32(file)
            except OSError as e:
                raise CheckpointError(f"{file}: unreadable ({e.strerror or e})") from None
            if actual["bytes"] != expected["bytes"]:
                raise CheckpointError(
                    f"{file}: {actual['bytes']} bytes, {META} says {expected['bytes']} (truncated?)"
                )
            if actual["crc32"] != expected["crc32"]:
                raise CheckpointError(f"{file}: CRC32 mismatch (corrupted)")
        return CheckpointInfo(path=path, step=int(meta["step"]), meta=meta)

    def check_paths(self) -> None:
        """Refused at launch, before a step is trained: a checkpoints/ that is not a directory (every save
        would fail) and a `latest` that is not a file (the run's one line would misname the checkpoint)."""
        if not self.enabled:
            return
        where, latest = self.directory, self.directory / LATEST
        if where.exists() and not where.is_dir():
            raise UserError(
                f"{where}: not a directory, no checkpoint could be saved; allowed: a directory (move or "
                "remove the file), or checkpoint.enabled=false (nothing was changed)"
            )
        if latest.is_symlink() or (latest.exists() and not latest.is_file()):
            raise UserError(
                f"{latest}: not a regular file; allowed: the text file naming the newest checkpoint (remove "
                "it: the newest complete checkpoint is found without it) (nothing was changed)"
            )

    def newest_good(self, *, at_most: int | None = None) -> CheckpointInfo | None:
        """The newest checkpoint that verifies; each unusable newer one is reported (warning) and skipped."""
        for step, path in reversed(self.step_dirs()):
            if at_most is not None and step > at_most:
                continue
            try:
                return self.verify(path)
            except CheckpointError as e:
                log.warning("checkpoint %s is unusable: %s; trying the previous one", path.name, e)
        return None

    # ---------------------------------------------------------------------------------------------- save

    def save(
        self,
        step: int,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        local_state: dict[str, Any],
        meta: dict[str, Any],
    ) -> Path:
        """Write checkpoint `step` (every rank calls this). Raises OSError (e.g. ENOSPC) with the previous
        checkpoints untouched and the temporary directory removed."""
        if not self.enabled:  # validate.py refuses what would need one (guard.spike_policy=rollback)
            raise RuntimeError(f"checkpoint {step}: checkpoints are disabled (checkpoint.enabled=false)")
        started = time.perf_counter()
        final = self.directory / step_name(step)
        tmp = self.directory / f".{step_name(step)}.tmp"
        try:
            failure = None
            if self.rank == 0:
                try:
                    self.directory.mkdir(parents=True, exist_ok=True)
                    self._remove_leftovers()
                    tmp.mkdir()
                except OSError as e:
                    failure = e
            _agree(failure)
            empty = _empty(optimizer)  # (no step taken yet: the state must stay empty, see _write_payload)
            files = self._write_payload(tmp, model, optimizer)
            try:
                files[rank_file(self.rank)] = _write_durable(tmp / rank_file(self.rank), local_state)
            except OSError as e:
                failure = e
            _agree(failure)
            files = self._gather_files(files, tmp)
            if self.rank == 0:
                record = {"format_version": FORMAT_VERSION, "format": self.format, "step": step, **meta}
                record["world_size"] = self.world_size
                record["files"] = files
                record["optimizer_empty"] = empty
                try:
                    write_file(tmp / META, seal_meta(record), atomic=False)
                    fsync_dir(tmp)
                    self._move_into_place(tmp, final)
                except OSError as e:
                    failure = e
                else:
                    self._record_newest(final)
            _agree(failure)
        except BaseException as e:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            cause = _os_error(e)
            if cause is not None and cause is not e:  # torch and DCP wrap a failed write: report the OSError
                raise cause from e
            raise
        _barrier()
        if self.rank == 0:
            size = sum(f["bytes"] for f in files.values())
            log.info(
                "checkpoint %s saved (%.1f MB, %.2f s)", final.name, size / 1e6, time.perf_counter() - started
            )
        return final

    def _write_payload(self, tmp: Path, model, optimizer) -> dict[str, dict[str, int]]:
        if self.format == "torch":
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            return {TORCH_PAYLOAD: _write_durable(tmp / TORCH_PAYLOAD, state)}
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        empty = _empty(optimizer)
        model_state, optim_state = get_state_dict(model, _optimizers(optimizer))
        if empty:  # get_state_dict initialises an empty state with a zero-lr step: step counts would be 1
            for inner in _optimizers(optimizer):
                inner.state.clear()
        writer = dcp.FileSystemWriter(str(tmp), sync_files=True)
        with _single_process_quiet():
            dcp.save({"model": model_state, "optimizer": optim_state}, storage_writer=writer)
        return {}  # DCP's own files are checksummed by rank 0 in _gather_files

    def _gather_files(self, files: dict, tmp: Path) -> dict[str, dict[str, int]]:
        """Rank 0 collects every rank's file records and checksums the files DCP wrote."""
        if _dist_active() and self.world_size > 1:
            gathered: list[Any] = [None] * self.world_size
            torch.distributed.all_gather_object(gathered, files)
            files = {k: v for part in gathered for k, v in part.items()}
        if self.rank == 0 and self.format == "dcp":
            # DCP fsynced its files (sync_files=True); their checksums are read back once here.
            for path in sorted(tmp.iterdir()):
                if path.is_file() and path.name not in files and path.name != META:
                    files[path.name] = file_crc32(path)
        return files

    def _move_into_place(self, tmp: Path, final: Path) -> None:
        if final.exists():  # a re-save of the same step: the new copy replaces it (a kill between the two
            # renames leaves the old copy as .step_N.old, which step_dirs and _remove_leftovers take back)
            old = final.with_name(f".{final.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(tmp, final)
            fsync_dir(self.directory)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
            fsync_dir(self.directory)

    def _record_newest(self, final: Path) -> None:
        """After `final` is complete and in place: `latest` names it, older checkpoints are pruned. Neither
        failing undoes the checkpoint (it verifies; every reader takes the newest that verifies when `latest`
        is missing or no file), so each is a warning, never a failed save that would name this very
        checkpoint as the newest complete one. A `latest` left naming an older one is removed: no reader
        (trainer.resume=<run>, trmoe.eval, trmoe.sample) must be sent back to it."""
        latest = self.directory / LATEST
        try:
            write_pointer(self.directory, final.name)
        except OSError as e:
            with contextlib.suppress(OSError):
                if latest.is_file() and not latest.is_symlink():
                    latest.unlink()
            log.warning(
                "checkpoint %s is complete, but %s could not be made to name it (%s): readers take the "
                "newest checkpoint that verifies, which is this one",
                final.name,
                latest,
                e.strerror or e,
            )
        try:
            self._prune()
        except OSError as e:
            log.warning("checkpoint %s is complete; pruning older checkpoints failed (%s)", final.name, e)

    def _remove_leftovers(self) -> None:
        """Temporary directories of saves or prunes that a kill interrupted (rank 0, before a save); the
        set-aside copy of an interrupted re-save goes back under its checkpoint's name."""
        for path in list(self.directory.iterdir()):
            replaced = REPLACED_DIR.match(path.name)
            if replaced and path.is_dir() and not (self.directory / replaced.group(1)).exists():
                os.rename(path, self.directory / replaced.group(1))
            elif path.name.startswith(".step_") and path.is_dir():
                shutil.rmtree(path, ignore_errors=True)

    def _prune(self) -> None:
        """Keep the newest `keep_last` complete checkpoints (0 = all) besides those of `at_steps`, which were
        asked for by step (a ladder's branch points) and so are never pruned: counted among the newest, they
        would silently go once keep_last newer ones exist. Each victim is renamed first, so a kill during the
        deletion never leaves a half-deleted directory under a checkpoint's name."""
        if self.keep_last <= 0:
            return
        dirs = [(step, path) for step, path in self.step_dirs() if step not in self.kept_steps]
        for _, path in dirs[: max(0, len(dirs) - self.keep_last)]:
            doomed = path.with_name(f".{path.name}.deleting")
            os.rename(path, doomed)
            shutil.rmtree(doomed, ignore_errors=True)

    def set_aside(self, newer_than: int) -> list[Path]:
        """Rename checkpoints after step `newer_than` to discarded_step_XXXXXXXX (rank 0; when a run resumes
        from an older checkpoint, the newer ones belong to an abandoned trajectory). Returns the new names."""
        moved = []
        for step, path in self.step_dirs():
            if step > newer_than:
                target = path.with_name(f"discarded_{path.name}")
                shutil.rmtree(target, ignore_errors=True)
                os.rename(path, target)
                moved.append(target)
        if moved:
            fsync_dir(self.directory)
            write_pointer(self.directory, step_name(newer_than))
        return moved

    # ---------------------------------------------------------------------------------------------- load

    def load(
        self, info: CheckpointInfo, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> dict[str, Any]:
        """Load model and optimizer in place; return this rank's local state. Expects a verified `info`.
        The optimizer takes its state (moments, step counts) from the checkpoint and keeps the
        hyper-parameters this run's config set (base_lr, weight decay, betas, ...): they are the same unless
        trainer.force_resume let one change, and then the change must apply, as run_config.json records."""
        device = next(model.parameters()).device
        groups = optimizer.param_groups if optimizer is not None else []
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        if info.meta.get("format", "torch") == "torch":
            state = torch.load(info.path / TORCH_PAYLOAD, map_location=device, weights_only=True)
            if _sharded(model):  # one process wrote it, an FSDP run goes on: each rank keeps its shards
                from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

                set_model_state_dict(model, state["model"], options=StateDictOptions(full_state_dict=True))
            else:
                try:
                    model.load_state_dict(state["model"], strict=True)
                except RuntimeError as e:  # e.g. written by another trmoe version: other parameters
                    detail = " ".join(str(e).split("\n\t")[1:2]).strip() or str(e).splitlines()[0]
                    raise UserError(
                        f"checkpoint {info.path} does not fit this model ({detail[:200]}); resume it with "
                        "the trmoe version that wrote it (no step was trained)"
                    ) from None
            if optimizer is not None:
                optimizer.load_state_dict(state["optimizer"])
                _shard_like_params(optimizer)
        else:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            optimizers = _optimizers(optimizer) if optimizer is not None else []
            model_state, optim_state = get_state_dict(model, optimizers)
            with _single_process_quiet():
                dcp.load({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(info.path))
            set_state_dict(model, optimizers, model_state_dict=model_state, optim_state_dict=optim_state)
            if info.meta.get("optimizer_empty"):  # saved before any step: what DCP holds is its own init
                for inner in optimizers:
                    inner.state.clear()
        if optimizer is not None:
            for group, values in zip(optimizer.param_groups, hyper, strict=True):
                group.update(values)
        return load_local_state(info, self.rank)


def load_local_state(info: CheckpointInfo, rank: int) -> dict[str, Any]:
    """This rank's train state. A checkpoint written with fewer ranks has no file for this rank: it then
    gets rank 0's (the run goes on with the same global batch; see docs/reliability.md)."""
    path = info.path / rank_file(rank)
    if not path.exists():
        path = info.path / rank_file(0)
    # weights_only=False: the file holds Python RNG states; a checkpoint is trusted input, like any pickle.
    return torch.load(path, map_location="cpu", weights_only=False)


def model_shapes(info: CheckpointInfo) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every model tensor a verified checkpoint holds, without reading the tensors (format
    torch: the payload memory-mapped; dcp: its metadata): what a resume checks against the model it builds
    before anything is written. Raises CheckpointError."""
    try:
        if info.meta["format"] == "torch":
            state = torch.load(info.path / TORCH_PAYLOAD, map_location="cpu", mmap=True, weights_only=True)
            return {name: tuple(tensor.shape) for name, tensor in state["model"].items()}
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        entries = FileSystemReader(str(info.path)).read_metadata().state_dict_metadata
        return {  # DCP flattens the saved {"model": ..., "optimizer": ...} to dotted keys
            key.removeprefix("model."): tuple(entry.size)
            for key, entry in entries.items()
            if key.startswith("model.") and isinstance(entry, TensorStorageMetadata)
        }
    except Exception as e:  # a payload that verifies but holds no trmoe state (another tool's, torch's)
        first = next(iter(str(e).splitlines()), "")
        raise CheckpointError(f"{info.path}: no readable model state ({type(e).__name__}: {first})") from None


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint directory from itself, a checkpoints/ directory or a run directory (via `latest`, else the
    newest step_XXXXXXXX)."""
    path = Path(path)
    if (path / META).exists():
        return path
    if (path / CHECKPOINTS).is_dir():
        path = path / CHECKPOINTS
    name = read_pointer(path)
    if name and (path / name / META).exists():
        return path / name
    dirs = CheckpointStore(path).step_dirs()
    if not dirs:
        raise CheckpointError(f"{path}: holds no checkpoint")
    return dirs[-1][1]


def load_checkpoint(path: Path) -> dict[str, Any]:
    """A whole checkpoint as one dict (for tools and tests): step, model, optimizer, meta and rank 0's train
    state. `path`: a checkpoint, checkpoints/ or run directory."""
    info = CheckpointStore(Path(path)).verify(resolve_checkpoint(path))
    if info.meta["format"] == "torch":
        state = torch.load(info.path / TORCH_PAYLOAD, map_location="cpu", weights_only=True)
    else:
        import tempfile

        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as scratch:
            dcp_to_torch_save(info.path, Path(scratch) / "state.pt")
            state = torch.load(Path(scratch) / "state.pt", map_location="cpu", weights_only=True)
    return {
        "step": info.step,
        "model": state["model"],
        "optimizer": state["optimizer"],
        "meta": info.meta,
        "train_state": load_local_state(info, 0),
    }
