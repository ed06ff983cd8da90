"""The launch decision: what a launch does with its run directory, decided before anything is written.

`decide` reads only (the run directory, its checkpoints, the stored config) and returns a `Launch`:

    fresh     the directory holds no run (or trainer.resume=never run.overwrite=true replaces its run)
    resume    continue from a complete checkpoint (trainer.resume=auto: the directory's newest one that
              verifies; trainer.resume=<path>: that one)
    restart   the directory holds this same run but no complete checkpoint yet: start it again from step 0
              (a launch killed in its start-up, before run_config.json: compared with its .hydra/config.yaml)
    complete  the newest checkpoint is the last step: nothing to do

A resumed run must be the same experiment (trmoe.run.identity): a training-critical difference stops the
launch with a diff (exit 2); trainer.force_resume=true continues and records the difference in
run_config.json. Then, once every check has passed, `Launch.prepare` makes the launch's writes at once.

Run lifecycle, not training: this module must not import the training internals (controls, optim,
schedule; tests/test_layout.py checks it). The checks that need a model or the schedules run on the
training side (trmoe.train.preflight).
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from trmoe.config.schema import Config
from trmoe.errors import UserError
from trmoe.run import records
from trmoe.run.checkpoint import (
    CheckpointError,
    CheckpointInfo,
    CheckpointStore,
    load_local_state,
    read_pointer,
    resolve_checkpoint,
)
from trmoe.run.identity import (
    ConfigDiff,
    compare,
    config_container,
    critical_hash,
    derived_record,
    flatten,
    training_view,
)
from trmoe.run.rundir import RunDir, named_by

log = logging.getLogger("trmoe")


@dataclass
class Launch:
    mode: str  # fresh | restart | resume | complete
    run: RunDir
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
    metrics_expected: int | None = None  # metrics.csv rows up to the resumed step, as its checkpoint says
    start_up: bool = False  # a restart of a launch killed in its start-up: nothing recorded but its config

    @property
    def start_step(self) -> int:
        return self.checkpoint.step if self.checkpoint is not None else 0

    @property
    def final_eval_loss(self) -> float:
        return float(self.checkpoint.meta.get("eval_loss", float("nan"))) if self.checkpoint else float("nan")

    def check_data(self, data, data_info: dict, *, rank: int, force: bool) -> None:
        """Compare the data identity with the stored run's and load the data cursor (still before writes)."""
        self.view.update(training_view({}, None, data_info))
        if self.mode in ("fresh", "complete") or self.start_up:  # (start_up: no data identity recorded)
            return
        diff = compare(self.stored_view, self.view, data_only=True)
        self.diff.volatile.update(diff.volatile)
        if diff.critical:
            where = self.checkpoint.path if self.checkpoint else self.run.run_config
            _mismatch(diff, where, force=force, restart=self.run.path if self.mode == "restart" else None)
            self.forced.update(diff.as_record())
        if self.checkpoint is not None:
            cursor = load_local_state(self.checkpoint, rank).get("data")
            if cursor is not None:
                if diff.critical:
                    log.warning("data differs from the checkpoint's (forced): its data cursor is not loaded")
                else:
                    data.load_state_dict(cursor)

    def prepare(self, store: CheckpointStore) -> None:
        """The launch's writes, once everything is checked: replace, trim or continue the run's records."""
        run, metrics = self.run, self.run.metrics
        run.path.mkdir(parents=True, exist_ok=True)
        if self.overwrite:
            files, dirs = run.removable()
            for path in files:
                path.unlink(missing_ok=True)
            for path in dirs:  # (logs/: the ranks > 0 of a distributed run)
                shutil.rmtree(path, ignore_errors=True)
            log.warning("run.overwrite=true: replaced the run in %s", run.path)
        if self.mode == "restart":
            for path in run.step_csvs():
                path.unlink(missing_ok=True)
        if self.mode != "resume":
            return
        step = self.checkpoint.step
        if self.external:
            for source in self.continued_csvs():
                shutil.copyfile(source, run.path / source.name)
        else:
            moved = store.set_aside(step)
            if moved:
                log.warning(
                    "resuming from step %d: newer checkpoints set aside as %s",
                    step,
                    ", ".join(p.name for p in moved),
                )
        for path in run.step_csvs():  # metrics.csv's columns are migrated by the Trainer's output, by name
            if path.is_file():
                kept = records.trim_csv(path, step)
                if path == metrics:
                    self.metrics_rows = kept
        expected = self.metrics_expected = self.checkpoint.meta.get("metrics", {}).get("rows")
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
        where = RunDir(self.checkpoint.path.parent.parent) if self.external else self.run
        return where.step_csvs()

    def identity(self, raw_cfg: DictConfig, data_info: dict) -> dict[str, Any]:
        """What every checkpoint's meta.json carries to be compared with a later launch."""
        return {
            "config": config_container(raw_cfg),
            "derived": derived_record(self.view),
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
                    "metrics_rows": [self.metrics_rows, self.metrics_expected],  # fewer kept: a gap (report)
                }
            )
        return {
            "config_hash": critical_hash(self.view),
            "derived": derived_record(self.view),
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


def _mismatch(diff: ConfigDiff, where: Path, *, force: bool, restart: Path | None = None) -> None:
    """Refuse (`force`: let pass) the critical differences from `where`, in `restart`'s run directory."""
    if restart is not None:
        raise UserError(
            f"run directory {restart} holds a different run and no complete checkpoint; "
            f"training-critical keys differ from its {where.relative_to(restart)}:\n{diff.render()}\n"
            f"choose another {named_by()}, or replace it: trainer.resume=never run.overwrite=true "
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
            f"this would silently continue another experiment; use another {named_by()}, restore the keys "
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


def _history(previous: dict[str, Any] | None) -> list[dict[str, Any]]:
    """run_config.json's `resumes`: the entries that are records (a hand-edited file may hold anything)."""
    resumes = (previous or {}).get("resumes")
    return [entry for entry in resumes if isinstance(entry, dict)] if isinstance(resumes, list) else []


def _stored_view(record: dict[str, Any]) -> dict[str, Any]:
    """The view of a checkpoint's meta.json or a run_config.json (both hold config, derived and data)."""
    return training_view(record.get("config", {}), record.get("derived"), record.get("data"))


def decide(cfg: Config, view: dict[str, Any], run: RunDir, store: CheckpointStore) -> Launch:
    """Decide fresh / resume / restart / complete; raise UserError (exit 2) for anything that would overwrite
    or silently continue a different run. Reads only."""
    t = cfg.trainer
    how = t.resume.strip()
    run_dir = run.path
    store.check_paths()
    previous = records.read_json(run.run_config)
    held = run.held()
    if previous is None and run.run_config.name in held:
        log.warning(
            "%s is no readable JSON object: the history of this run's earlier attempts is lost",
            run.run_config,
        )
    if store.step_dirs():
        held.append("checkpoints")
    launch = Launch(mode="fresh", run=run, view=view, previous=previous)

    if how == "never":
        if held and not cfg.run.overwrite:
            raise UserError(
                f"run directory {run_dir} already holds a run ({', '.join(held)}); trainer.resume=never "
                "starts from scratch: add run.overwrite=true to replace it, trainer.resume=auto to continue "
                f"it, or choose another {named_by()} (nothing was changed)"
            )
        launch.overwrite = bool(held)
        return launch
    if cfg.run.overwrite and how == "auto":
        log.warning("run.overwrite=true applies with trainer.resume=never or <path>, not with auto")

    if how == "auto":
        info = store.newest_good()
        if info is None:
            if not held:
                return launch
            dirs = store.step_dirs()
            if dirs:  # complete checkpoints, all damaged: never train over them from step 0
                raise UserError(
                    f"run directory {run_dir}: none of its {len(dirs)} checkpoints verifies (newest "
                    f"{dirs[-1][1].name}; the reasons are logged above); resume from a good copy with "
                    "trainer.resume=<checkpoint>, or start over: trainer.resume=never run.overwrite=true "
                    "(nothing was changed)"
                )
            recorded = isinstance((previous or {}).get("config"), dict)
            started = None if recorded else records.start_up_config(run, held)  # killed in its start-up?
            if not recorded and started is None:
                raise UserError(
                    f"run directory {run_dir} holds files of a run ({', '.join(held)}) but neither a "
                    f"readable run_config.json nor a complete checkpoint; choose another {named_by()}, or "
                    "replace it: trainer.resume=never run.overwrite=true (nothing was changed)"
                )
            launch.mode, launch.start_up = "restart", started is not None
            launch.stored_view = _stored_view({"config": started} if started is not None else previous)
            # (killed in its start-up: its config alone was recorded, not its derived values or data)
            diff = compare(launch.stored_view, view, data_only=False, derived=started is None)
            if diff.critical:
                where = run.hydra / "config.yaml" if started is not None else run.run_config
                _mismatch(diff, where, force=False, restart=run.path)
            launch.diff = diff
            log.warning(
                "run directory %s holds this run but no complete checkpoint: restarting at step 0", run_dir
            )
            return launch
    else:
        path = Path(how).expanduser()
        launch.requested = str(path.resolve())
        # The same command again (a requeued job) in a directory that already continues <path>: its own
        # progress comes first, whatever became of <path> since (pruned, or a run directory that moved on).
        again = held and not cfg.run.overwrite and _started_from(previous, launch.requested)
        own = store.newest_good() if again else None
        if own is not None:
            log.info("%s already continues %s: resuming its own newest checkpoint", run_dir, how)
            info = own
        else:
            try:
                info = store.verify(resolve_checkpoint(path))
            except CheckpointError as e:
                raise UserError(f"trainer.resume={how}: {e}") from None
            launch.external = info.path.resolve().parent != store.directory.resolve()
            if launch.external and held:
                if again:  # stopped before its first checkpoint: nothing of its own to keep
                    log.warning("%s continues %s, no checkpoint of its own: starting again", run_dir, how)
                elif not cfg.run.overwrite:
                    raise UserError(
                        f"trainer.resume={how}: run directory {run_dir} already holds a run "
                        f"({', '.join(held)}); continue another run's checkpoint in a new run.name, or add "
                        "run.overwrite=true (nothing was changed)"
                    )
                launch.overwrite = True

    pointer = read_pointer(store.directory)
    if how == "auto" and pointer not in (None, info.path.name):
        log.info("using %s, the newest complete checkpoint (`latest` says %s)", info.path.name, pointer)
    launch.checkpoint = info
    launch.stored_view = _stored_view(info.meta)
    launch.diff = compare(launch.stored_view, view, data_only=False)
    _warn_if_eval_set_changes(launch.stored_view, view)
    if launch.diff.critical:
        _mismatch(launch.diff, info.path, force=t.force_resume)
        launch.forced = launch.diff.as_record()
    if info.step > t.steps:  # before the schedule check, whose advice (pin the horizon) would not help
        raise UserError(
            f"config error: trainer.steps={t.steps}: the checkpoint {info.path} is at step {info.step}; "
            f"allowed: >= {info.step}"
        )
    if launch.external and info.step == t.steps:
        raise UserError(
            f"trainer.resume={how}: the checkpoint is at step {info.step} = trainer.steps: nothing to train "
            f"in {run_dir}; allowed: trainer.steps > {info.step} to continue it (nothing was changed)"
        )
    launch.mode = "complete" if info.step == t.steps else "resume"
    if launch.mode == "resume":  # the records the resume continues: readable, or nothing is written
        for path in launch.continued_csvs():
            records.read_step_rows(path, info.step)
    return launch


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
