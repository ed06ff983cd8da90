"""What a launch does with its run directory, and whether an existing run may be continued with this config.

`plan_run` decides, reading only, before anything is written:

    fresh     the directory holds no run (or trainer.resume=never run.overwrite=true replaces its run)
    resume    continue from a complete checkpoint (trainer.resume=auto: the directory's newest one that
              verifies; trainer.resume=<path>: that one)
    restart   the directory holds this same run but no complete checkpoint yet: start it again from step 0
    complete  the newest checkpoint is the last step: nothing to do

A resumed run must be the same experiment. The stored config (in the checkpoint's meta.json) and the new one
are flattened to dotted keys and compared; a key is *volatile* (may change) only if it matches a pattern in
VOLATILE_KEYS, so every other key, including keys added to the schema later, is *training-critical*.
Derived values join the comparison: the global batch in tokens and the effective precision are critical
(micro_batch, grad_accum, world size and hardware may change as long as they are kept), and so is the data
identity (`data_info.*`, from the data pipeline's record). A critical difference stops the run with a diff
(exit 2); trainer.force_resume=true continues and records the difference in run_config.json.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from trmoe.config.schema import Config
from trmoe.data.pipeline import global_batch_tokens
from trmoe.errors import UserError
from trmoe.train import records
from trmoe.train.checkpoint import (
    CheckpointError,
    CheckpointInfo,
    CheckpointStore,
    load_local_state,
    model_shapes,
    read_pointer,
    resolve_checkpoint,
)

log = logging.getLogger("trmoe")

STATE_VERSION = 1
ABSENT = "<absent>"
STEP_CSVS = ("telemetry.csv",)  # other per-step records, trimmed like metrics.csv on resume

# Keys that may differ between the attempts of one run (fnmatch patterns over dotted keys). Everything else
# is training-critical. Add a key here only if changing it mid-run cannot change what is learned.
VOLATILE_KEYS = (
    "run.*",  # name, progress display, overwrite
    "trainer.steps",  # extend or shorten a run (the schedules' past must stay the same: see _check_schedules)
    "optimizer.decay_steps",  # pin the old horizon to extend a run: _check_schedules refuses any change
    "optimizer.warmup_steps",  # that would bend the LR of the steps already run
    "trainer.log_every",
    "trainer.eval_every",
    "trainer.eval_batches",
    "trainer.resume",
    "trainer.force_resume",
    "trainer.micro_batch",  # with grad_accum and the world size: how the global batch is split;
    "trainer.grad_accum",  # derived.global_batch_tokens is the critical value
    "trainer.activation_checkpointing",  # memory, not math
    "trainer.shared_chunk_tokens",  # memory, not math
    "trainer.compile",  # execution, not math
    "trainer.compile_backend",
    "checkpoint.*",
    "guard.*",
    "telemetry.*",  # observation only
    "logger.*",  # experiment trackers: observation only
    "downstream.every",  # downstream evaluation: observation only (tasks and limit define metrics.csv's
    "downstream.include_path",  # columns and what they mean, so they stay fixed within a run)
    "downstream.batch_size",
    "debug.anomaly",  # checks, not math
    "debug.profile*",
    "hardware.*",  # device, threads, determinism; derived.precision is the critical value
    "loss.chunk_tokens",  # memory, not math
    "data.text_path",  # where the file is; its content hash (data_info.sha256) is critical
    "data.path",  # where the token shards / Parquet files are; their content hashes (data_info) are critical
    "data.eval_path",
    "data.workers",  # reader parallelism
    "data.pin_memory",
    "data.verify",
    "derived.world_size",
    "data_info.path",  # location; the content is identified by its hashes
    "data_info.*.path",  # (nested: data_info.shards.train.path, data_info.stream.path)
    "data_info.*.paths",  # the Parquet files' locations (their hashes: data_info.stream.files)
    "data_info.name",  # a text corpus is named by its file's location ("text:/abs/path")
    "data_info.eval_*",  # the evaluation set's size follows trainer.eval_batches and micro_batch
    "data_info.metric_streams",
    "data.sources.*.text_path",  # data=mixture: as data.text_path, for each source
    "data_info.sources.*.path",
    "data_info.sources.*.eval_*",
    "data_info.sources.*.metric_streams",
    "data_info.plan.*",  # a mixture's samples and epochs per source over trainer.steps (which may change)
)


def is_volatile(key: str) -> bool:
    """A pattern names a key or a whole subtree: `data_info.metric_streams` covers its flattened keys
    (`data_info.metric_streams.eval_loss`), which a plain fnmatch of the pattern never matched."""
    return any(
        fnmatch.fnmatchcase(key, pattern) or fnmatch.fnmatchcase(key, f"{pattern}.*")
        for pattern in VOLATILE_KEYS
    )


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists and scalars are leaves."""
    if isinstance(tree, dict) and tree:
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def config_container(raw_cfg: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(raw_cfg, resolve=True, enum_to_str=True)  # type: ignore[return-value]


def derived_values(cfg: Config, world_size: int, amp_dtype: torch.dtype | None) -> dict[str, Any]:
    t = cfg.trainer
    return {
        "global_batch_tokens": global_batch_tokens(t, world_size),
        "precision": "fp32" if amp_dtype is None else str(amp_dtype).replace("torch.", ""),
        "world_size": world_size,
    }


def training_view(config: dict, derived: dict | None, data_info: dict | None) -> dict[str, Any]:
    """The flat key -> value map that two attempts of a run are compared on."""
    view = flatten(config)
    view.update(flatten({"derived": derived or {}}))
    if data_info is not None:
        view.update(flatten({"data_info": json.loads(json.dumps(data_info, default=str))}))
    return view


def _in_effect(view: dict[str, Any]) -> dict[str, Any]:
    """The view with model.num_kv_heads as the attention kind uses it: mha takes one per query head and
    mqa one, whatever the key says (two runs that differ only there build the same model)."""
    kind = view.get("attention.kind")
    if kind in ("mha", "mqa") and "model.num_kv_heads" in view:
        return {**view, "model.num_kv_heads": view.get("model.num_heads") if kind == "mha" else 1}
    return view


def critical_hash(view: dict[str, Any]) -> str:
    """sha256 of the training-critical part of a view: equal hashes, same experiment."""
    critical = {k: v for k, v in _in_effect(view).items() if not is_volatile(k)}
    return hashlib.sha256(json.dumps(critical, sort_keys=True, default=str).encode()).hexdigest()


@dataclass
class ConfigDiff:
    critical: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    volatile: dict[str, tuple[Any, Any]] = field(default_factory=dict)

    def render(self, which: str = "critical") -> str:
        items = self.critical if which == "critical" else self.volatile
        width = max((len(k) for k in items), default=0)
        lines = []
        for key, (old, new) in sorted(items.items()):
            note = _NOTES.get(key, "")
            lines.append(f"  {key:<{width}}  {_show(old)} -> {_show(new)}{note}")
        return "\n".join(lines)

    def as_record(self, which: str = "critical") -> dict[str, list[Any]]:
        items = self.critical if which == "critical" else self.volatile
        return {k: [old, new] for k, (old, new) in sorted(items.items())}


_NOTES = {
    "derived.global_batch_tokens": "  (micro_batch x seq_len x world size x grad_accum)",
    "derived.precision": "  (the autocast dtype hardware.precision resolves to on this device)",
}


def _show(value: Any) -> str:
    return value if value == ABSENT else json.dumps(value, default=str)


def compare(old: dict[str, Any], new: dict[str, Any], *, data_only: bool | None = None) -> ConfigDiff:
    """Differences between two views. data_only=True compares only data_info.* keys, False all but them."""
    diff = ConfigDiff()
    old, new = _in_effect(old), _in_effect(new)
    for key in sorted(set(old) | set(new)):
        if data_only is not None and key.startswith("data_info.") != data_only:
            continue
        a, b = old.get(key, ABSENT), new.get(key, ABSENT)
        if a != b:
            (diff.volatile if is_volatile(key) else diff.critical)[key] = (a, b)
    return diff


# ----------------------------------------------------------------------------------------- train state


def rng_state() -> dict[str, Any]:
    """Every generator a step could draw from: Python, numpy, torch CPU, each CUDA device, and MPS."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": cuda,
        "mps": torch.mps.get_rng_state() if _mps_available() else None,
    }


def _mps_available() -> bool:
    return getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("mps") is not None and _mps_available():
        torch.mps.set_rng_state(state["mps"])
    if state["cuda"] and torch.cuda.is_available():
        if len(state["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(state["cuda"])
        else:
            log.warning(
                "checkpoint holds RNG states of %d CUDA devices, this process sees %d: CUDA RNG not restored",
                len(state["cuda"]),
                torch.cuda.device_count(),
            )


def capture(
    *,
    step: int,
    tokens: int,
    next_sample: int,
    data,
    window,
    window_totals: dict[str, Any],
    telemetry: dict[str, Any] | None,
    guard,
    train_time: float,
    eval_loss: float,
) -> dict[str, Any]:
    """This rank's part of a checkpoint besides model and optimizer. `window_totals`: the metrics window
    summed over ranks (distributed.window_totals); `telemetry`: the expert telemetry's open window, likewise
    summed (MoETelemetry.state_dict), or None when it is off."""
    return {
        "version": STATE_VERSION,
        "step": step,
        "tokens": tokens,
        "next_sample": next_sample,  # the global sample index the next step starts at
        "data": data.state_dict() if hasattr(data, "state_dict") else None,
        "rng": rng_state(),
        "window": window.state_dict(),
        "window_totals": window_totals,
        "telemetry": telemetry,
        "guard": guard.state_dict(),
        "train_time": train_time,
        "eval_loss": eval_loss,
    }


def restore(
    state: dict[str, Any],
    *,
    data,
    window,
    guard,
    load_data: bool,
    telemetry=None,
    rank: int = 0,
    world_size: int = 1,
) -> None:
    if state.get("version") != STATE_VERSION:
        raise CheckpointError(f"train state version {state.get('version')}; this trmoe reads {STATE_VERSION}")
    if load_data and state.get("data") is not None and hasattr(data, "load_state_dict"):
        data.load_state_dict(state["data"])
    totals = state.get("window_totals")
    if totals is None or totals["world_size"] == world_size:
        window.load_state_dict(state["window"])  # this rank's own share, as it was
    else:  # another number of ranks: the window's sums on rank 0, its tokens shared out as a step shares them
        window.load_state_dict(
            {
                "ce": totals["ce"] if rank == 0 else 0.0,
                "objective": totals["objective"] if rank == 0 else 0.0,
                "tokens": totals["tokens"] // world_size,
                "time": state["window"]["time"],
            }
        )
    guard.load_state_dict(state["guard"])
    if telemetry is not None and state.get("telemetry") is not None:  # on then and now: its open window
        telemetry.load_state_dict(state["telemetry"], rank)
    set_rng_state(state["rng"])  # last: nothing after it may draw


# ------------------------------------------------------------------------------------------------ plan


@dataclass
class Plan:
    mode: str  # fresh | restart | resume | complete
    run_dir: Path
    view: dict[str, Any]  # this launch's training view (without data_info until check_data)
    checkpoint: CheckpointInfo | None = None
    external: bool = False  # the checkpoint lives in another run directory
    overwrite: bool = False  # delete the run the directory holds first (resume=never run.overwrite=true)
    requested: str | None = None  # trainer.resume=<path> as given, resolved (a requeue gives it again)
    diff: ConfigDiff = field(default_factory=ConfigDiff)
    forced: dict[str, list[Any]] = field(default_factory=dict)  # critical differences force_resume let pass
    previous: dict[str, Any] | None = None  # the directory's run_config.json
    stored_view: dict[str, Any] = field(default_factory=dict)
    metrics_rows: int = 0

    @property
    def start_step(self) -> int:
        return self.checkpoint.step if self.checkpoint is not None else 0

    @property
    def final_eval_loss(self) -> float:
        return float(self.checkpoint.meta.get("eval_loss", float("nan"))) if self.checkpoint else float("nan")

    def check_data(self, data, data_info: dict, *, rank: int, force: bool) -> None:
        """Compare the data identity with the stored run's and load the data cursor (still before writes)."""
        self.view.update(training_view({}, None, data_info))
        if self.mode in ("fresh", "complete"):
            return
        diff = compare(self.stored_view, self.view, data_only=True)
        self.diff.volatile.update(diff.volatile)
        if diff.critical:
            where = self.checkpoint.path if self.checkpoint else self.run_dir / "run_config.json"
            _mismatch(diff, where, force=force, restart=self.mode == "restart")
            self.forced.update(diff.as_record())
        if self.checkpoint is not None:
            cursor = load_local_state(self.checkpoint, rank).get("data")
            if cursor is not None and hasattr(data, "load_state_dict"):
                if diff.critical:
                    log.warning("data differs from the checkpoint's (forced): its data cursor is not loaded")
                else:
                    data.load_state_dict(cursor)

    def prepare(self, store: CheckpointStore) -> None:
        """The plan's writes, once everything is checked: replace, trim or continue the run's records."""
        run_dir, metrics = self.run_dir, self.run_dir / "metrics.csv"
        run_dir.mkdir(parents=True, exist_ok=True)
        if self.overwrite:
            for name in (*records.RUN_FILES, *STEP_CSVS, "metrics.csv.orig", "train.log", "status.json"):
                (run_dir / name).unlink(missing_ok=True)
            (run_dir / "trackers.json").unlink(missing_ok=True)  # the tracker runs of the replaced run
            # logs/: the ranks > 0 of a distributed run; the trackers' and the profiler's files
            for name in ("checkpoints", ".hydra", "logs", "tensorboard", "wandb", "profile"):
                shutil.rmtree(run_dir / name, ignore_errors=True)
            log.warning("run.overwrite=true: replaced the run in %s", run_dir)
        if self.mode == "restart":
            for name in ("metrics.csv", *STEP_CSVS):
                (run_dir / name).unlink(missing_ok=True)
        if self.mode != "resume":
            return
        step = self.checkpoint.step
        if self.external:
            for source in self.continued_csvs():
                shutil.copyfile(source, run_dir / source.name)
        else:
            moved = store.set_aside(step)
            if moved:
                log.warning(
                    "resuming from step %d: newer checkpoints set aside as %s",
                    step,
                    ", ".join(p.name for p in moved),
                )
        for name in STEP_CSVS:
            if (run_dir / name).is_file():
                records.trim_csv(run_dir / name, step)
        if metrics.is_file():
            self.metrics_rows = records.continue_metrics(metrics, step)
        else:
            records.MetricsWriter(metrics).close()
            self.metrics_rows = 0
        expected = self.checkpoint.meta.get("metrics", {}).get("rows")
        if expected is not None and expected != self.metrics_rows:
            log.warning(
                "metrics.csv has %d rows up to step %d, the checkpoint recorded %d",
                self.metrics_rows,
                step,
                expected,
            )

    def continued_csvs(self) -> list[Path]:
        """The per-step CSVs a resume continues: the run's own, or those of the run whose checkpoint it
        continues (copied here first)."""
        where = self.checkpoint.path.parent.parent if self.external else self.run_dir
        return [where / name for name in ("metrics.csv", *STEP_CSVS) if (where / name).exists()]

    def identity(self, raw_cfg: DictConfig, data_info: dict) -> dict[str, Any]:
        """What every checkpoint's meta.json carries to be compared with a later launch."""
        return {
            "config": config_container(raw_cfg),
            "derived": {k[len("derived.") :]: v for k, v in self.view.items() if k.startswith("derived.")},
            "data": data_info,
            "config_hash": critical_hash(self.view),
        }

    def record(self, git: dict[str, Any], backend: dict[str, Any]) -> dict[str, Any]:
        """Fields for run_config.json: the config hash and the history of this run's attempts. `git` and
        `backend` describe this attempt (run_config.json's own "git" and "backend"); each resume entry keeps
        the ones of the attempt before it (`before`), so the history names every attempt's code and
        machine, and a resume on other code, torch, threads or processor is logged: exact continuation
        holds on the same ones only."""
        history = _history(self.previous) if self.mode != "fresh" else []
        if self.mode in ("resume", "restart"):
            before = {k: (self.previous or {}).get(k) for k in ("git", "backend")}
            _warn_if_environment_changes(before, {"git": git, "backend": backend})
            history.append(
                {
                    "before": before,
                    "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "mode": self.mode,
                    "from_step": self.start_step,
                    "checkpoint": None if self.checkpoint is None else str(self.checkpoint.path.resolve()),
                    "requested": self.requested,
                    "volatile_changes": self.diff.as_record("volatile"),
                    "forced": self.forced,  # training-critical differences continued with force_resume
                }
            )
        return {
            "config_hash": critical_hash(self.view),
            "derived": {k[len("derived.") :]: v for k, v in self.view.items() if k.startswith("derived.")},
            "force_resumed": any(entry.get("forced") for entry in history),
            "resumes": history,
        }


# What bit-exact continuation depends on besides the config (docs/reliability.md, determinism).
_ENVIRONMENT = (
    "git.version",
    "git.commit",
    "git.dirty",
    "backend.torch",
    "backend.threads",
    "backend.device_name",
)


def _warn_if_environment_changes(before: dict[str, Any], now: dict[str, Any]) -> None:
    old, new = flatten(before), flatten(now)
    changed = [
        f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in _ENVIRONMENT if k in old and old[k] != new.get(k)
    ]
    if changed:
        log.warning(
            "this attempt runs on other code or another machine than the one before it (%s): it continues, "
            "but not necessarily bit-for-bit as one uninterrupted run would",
            "; ".join(changed),
        )


def _mismatch(diff: ConfigDiff, where: Path, *, force: bool, restart: bool = False) -> None:
    if restart:
        raise UserError(
            f"run directory {where.parent} holds a different run and no complete checkpoint; "
            f"training-critical keys differ from its run_config.json:\n{diff.render()}\n"
            "choose another run.name, or replace it: trainer.resume=never run.overwrite=true "
            "(nothing was changed)"
        )
    batch_changes = "derived.global_batch_tokens" in diff.critical
    if not force:
        also = (
            "or set trainer.force_resume=true to continue anyway (recorded in run_config.json)"
            if not batch_changes  # force_resume refuses that one too (below): do not suggest it
            else "(the tokens per step cannot change even with trainer.force_resume=true: trade "
            "trainer.micro_batch for trainer.grad_accum to keep them)"
        )
        raise UserError(
            f"resume config mismatch with {where}: training-critical keys differ:\n{diff.render()}\n"
            f"this would silently continue a different experiment; use another run.name, restore the keys "
            f"{also} (nothing was changed)"
        )
    if batch_changes:
        old, new = diff.critical["derived.global_batch_tokens"]
        raise UserError(
            f"trainer.force_resume=true cannot change the tokens per step ({old} -> {new}; micro_batch x "
            f"seq_len x world size x grad_accum) of {where}: the steps already run read their samples and "
            "counted their tokens by it; keep it (e.g. trade trainer.micro_batch for trainer.grad_accum) "
            "(nothing was changed)"
        )
    log.warning(
        "trainer.force_resume=true: continuing %s although training-critical keys differ:\n%s",
        where,
        diff.render(),
    )


def _read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from `path`; None if it is missing, unreadable or holds anything else."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _history(previous: dict[str, Any] | None) -> list[dict[str, Any]]:
    """run_config.json's `resumes`: the entries that are records (a hand-edited file may hold anything)."""
    resumes = (previous or {}).get("resumes")
    return [entry for entry in resumes if isinstance(entry, dict)] if isinstance(resumes, list) else []


def _stored_view(record: dict[str, Any]) -> dict[str, Any]:
    """The view of a checkpoint's meta.json or a run_config.json (both hold config, derived and data)."""
    return training_view(record.get("config", {}), record.get("derived"), record.get("data"))


def plan_run(cfg: Config, view: dict[str, Any], run_dir: Path, store: CheckpointStore) -> Plan:
    """Decide fresh / resume / restart / complete; raise UserError (exit 2) for anything that would overwrite
    or silently continue a different run. Reads only."""
    t = cfg.trainer
    how = t.resume.strip()
    previous = _read_json(run_dir / "run_config.json")
    held = [name for name in records.RUN_FILES if (run_dir / name).exists()]
    if previous is None and "run_config.json" in held:
        log.warning(
            "%s is no readable JSON object: the history of this run's earlier attempts is lost",
            run_dir / "run_config.json",
        )
    if store.step_dirs():
        held.append("checkpoints")
    plan = Plan(mode="fresh", run_dir=run_dir, view=view, previous=previous)

    if how == "never":
        if held and not cfg.run.overwrite:
            raise UserError(
                f"run directory {run_dir} already holds a run ({', '.join(held)}); trainer.resume=never "
                "starts from scratch: add run.overwrite=true to replace it, trainer.resume=auto to continue "
                "it, or choose another run.name (nothing was changed)"
            )
        plan.overwrite = bool(held)
        return plan
    if cfg.run.overwrite and how == "auto":
        log.warning("run.overwrite=true applies with trainer.resume=never or <path>, not with auto")

    if how == "auto":
        info = store.newest_good()
        if info is None:
            if not held:
                return plan
            dirs = store.step_dirs()
            if dirs:  # complete checkpoints, all damaged: never train over them from step 0
                raise UserError(
                    f"run directory {run_dir}: none of its {len(dirs)} checkpoints verifies (newest "
                    f"{dirs[-1][1].name}; the reasons are logged above); resume from a good copy with "
                    "trainer.resume=<checkpoint>, or start over: trainer.resume=never run.overwrite=true "
                    "(nothing was changed)"
                )
            if previous is None or not isinstance(previous.get("config"), dict):
                raise UserError(
                    f"run directory {run_dir} holds files of a run ({', '.join(held)}) but neither a "
                    "readable run_config.json nor a complete checkpoint; choose another run.name, or replace "
                    "it: trainer.resume=never run.overwrite=true (nothing was changed)"
                )
            plan.mode = "restart"
            plan.stored_view = _stored_view(previous)
            diff = compare(plan.stored_view, view, data_only=False)
            if diff.critical:
                _mismatch(diff, run_dir / "run_config.json", force=False, restart=True)
            plan.diff = diff
            log.warning(
                "run directory %s holds this run but no complete checkpoint: restarting at step 0", run_dir
            )
            return plan
    else:
        path = Path(how).expanduser()
        plan.requested = str(path.resolve())
        # The same command again (a requeued job) in a directory that already continues <path>: its own
        # progress comes first, whatever became of <path> since (pruned, or a run directory that moved on).
        again = held and not cfg.run.overwrite and _started_from(previous, plan.requested)
        own = store.newest_good() if again else None
        if own is not None:
            log.info("%s already continues %s: resuming its own newest checkpoint", run_dir, how)
            info = own
        else:
            try:
                info = store.verify(resolve_checkpoint(path))
            except CheckpointError as e:
                raise UserError(f"trainer.resume={how}: {e}") from None
            plan.external = info.path.resolve().parent != store.directory.resolve()
            if plan.external and held:
                if again:  # stopped before its first checkpoint: nothing of its own to keep
                    log.warning("%s continues %s, no checkpoint of its own: starting again", run_dir, how)
                elif not cfg.run.overwrite:
                    raise UserError(
                        f"trainer.resume={how}: run directory {run_dir} already holds a run "
                        f"({', '.join(held)}); continue another run's checkpoint in a new run.name, or add "
                        "run.overwrite=true (nothing was changed)"
                    )
                plan.overwrite = True

    pointer = read_pointer(store.directory)
    if how == "auto" and pointer not in (None, info.path.name):
        log.info("using %s, the newest complete checkpoint (`latest` says %s)", info.path.name, pointer)
    plan.checkpoint = info
    plan.stored_view = _stored_view(info.meta)
    plan.diff = compare(plan.stored_view, view, data_only=False)
    _warn_if_eval_set_changes(plan.stored_view, view)
    if plan.diff.critical:
        _mismatch(plan.diff, info.path, force=t.force_resume)
        plan.forced = plan.diff.as_record()
    if info.step > t.steps:  # before the schedule check, whose advice (pin the horizon) would not help
        raise UserError(
            f"config error: trainer.steps={t.steps}: the checkpoint {info.path} is at step {info.step}; "
            f"allowed: >= {info.step}"
        )
    if plan.external and info.step == t.steps:
        raise UserError(
            f"trainer.resume={how}: the checkpoint is at step {info.step} = trainer.steps: nothing to train "
            f"in {run_dir}; allowed: trainer.steps > {info.step} to continue it (nothing was changed)"
        )
    plan.mode = "complete" if info.step == t.steps else "resume"
    if plan.mode == "resume" or plan.forced:  # what the resume will load, or what force may not change
        _check_shapes(info, cfg, forced=bool(plan.forced))
    _check_schedules(info, cfg, plan)
    if plan.mode == "resume":  # the records the resume continues: readable, or nothing is written
        for path in plan.continued_csvs():
            records.read_step_rows(path, info.step)
    return plan


def _started_from(previous: dict[str, Any] | None, requested: str) -> bool:
    """Whether the run a directory holds was launched with this trainer.resume=<path> before."""
    return any(entry.get("requested") == requested for entry in _history(previous))


def _warn_if_eval_set_changes(stored: dict[str, Any], view: dict[str, Any]) -> None:
    """The held-out set is the first eval_batches x micro_batch windows (docs/data.md): both keys may change
    on resume, but then eval_loss before and after is measured on different windows. Say so."""
    keys = ("trainer.eval_batches", "trainer.micro_batch")
    try:
        before, after = (stored[keys[0]] * stored[keys[1]], view[keys[0]] * view[keys[1]])
    except (KeyError, TypeError):
        return
    if before != after:
        log.warning(
            "the held-out set changes from %s to %s windows (trainer.eval_batches x trainer.micro_batch): "
            "eval_loss before and after this resume is measured on different windows",
            before,
            after,
        )


def _stored_config(meta: dict[str, Any]) -> Config | None:
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), meta["config"])
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except Exception:  # a config from another trmoe version: the key diff already reports it
        return None


def _check_shapes(info: CheckpointInfo, cfg: Config, *, forced: bool) -> None:
    """Before anything is written: the checkpoint's tensors (their names and shapes as stored, not as its
    config says: it may come from another trmoe version) must fit the model this config builds, and a
    force_resume may not change how the optimizer groups the parameters either (its saved state loads group
    by group). Both models are built on the meta device: no memory."""
    from trmoe.config.resolve import model_spec
    from trmoe.model.transformer import TRMoETransformer
    from trmoe.train.controls import freeze_scheduled_gates
    from trmoe.train.optim import group_layout
    from trmoe.train.schedule import build_schedules

    def build(config: Config) -> TRMoETransformer:
        with torch.device("meta"):
            model = TRMoETransformer(model_spec(config))
        freeze_scheduled_gates(model, build_schedules(config))
        return model

    try:
        old = model_shapes(info)
    except CheckpointError as e:
        raise UserError(f"checkpoint unusable: {e} (nothing was changed)") from None
    model = build(cfg)
    new = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if old != new:
        changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
        example = f"{changed[0]}: {old.get(changed[0], ABSENT)} -> {new.get(changed[0], ABSENT)}"
        if forced:
            raise UserError(
                f"trainer.force_resume=true cannot change the model's tensors: {len(changed)} differ from "
                f"{info.path} (e.g. {example}) (nothing was changed)"
            )
        raise UserError(
            f"checkpoint {info.path} does not fit this model: {len(changed)} tensors differ "
            f"(e.g. {example}); resume it with the trmoe version that wrote it (nothing was changed)"
        )
    stored = _stored_config(info.meta) if forced else None
    if stored is None:  # not forced (same config, same groups), or a config from another trmoe version
        return
    old_groups, new_groups = group_layout(build(stored), stored.optimizer), group_layout(model, cfg.optimizer)
    if old_groups != new_groups:
        first = next(
            (i for i, (a, b) in enumerate(zip(old_groups, new_groups, strict=False)) if a != b),
            min(len(old_groups), len(new_groups)),
        )
        was = old_groups[first][0] if first < len(old_groups) else "none"
        now = new_groups[first][0] if first < len(new_groups) else "none"
        what = f"{was} -> {now}" if was != now else f"{was} holds other parameters"
        raise UserError(
            f"trainer.force_resume=true cannot change how the optimizer groups the parameters (its saved "
            f"state loads group by group): {len(old_groups)} groups in {info.path}, {len(new_groups)} now; "
            f"group {first}: {what} (nothing was changed)"
        )


def _check_schedules(info: CheckpointInfo, cfg: Config, plan: Plan) -> None:
    """trainer.steps may change, but not what the schedules did in the steps already run (e.g. a cosine
    horizon that moves bends the LR of steps already taken)."""
    from trmoe.train import schedule

    check = getattr(schedule, "check_extension", None)
    stored = _stored_config(info.meta)
    if check is None or stored is None or info.step == 0:
        return
    try:
        check(schedule.build_schedules(stored), schedule.build_schedules(cfg), info.step)
    except UserError as e:
        if not cfg.trainer.force_resume:
            raise UserError(f"{e} (resuming {info.path}; nothing was changed)") from None
        log.warning("trainer.force_resume=true: continuing although %s", e)
        plan.forced["schedules"] = [str(e), "forced"]
