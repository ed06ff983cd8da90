"""The run directory's file layout: every name in one place (the trainer, the launch decision, the report).

    <run dir>/
      .hydra/                 config.yaml, hydra.yaml, overrides.yaml (written by trmoe, after validation)
      run_config.json         what the run is: config, model, data, attempts (records.write_run_config)
      status.json             running | finished | failed | preempted | killed, with its line (status.py)
      train.log               rank 0's log; logs/rank_<r>.log for the ranks > 0 of a distributed run
      metrics.csv             one row per logged step (records.StepCsv); metrics.csv.orig after a
                              column migration on resume
      telemetry.csv           per-layer expert telemetry (telemetry.moe=true)
      checkpoints/            step_XXXXXXXX/ and `latest` (checkpoint.CheckpointStore)
      .lock                   held by the live launch (lock.py): who holds the run
      trackers.json           the tracker runs this run continues on resume (trackers.py)
      events.out.tfevents.*   TensorBoard's event files (logger=tensorboard): in the run directory itself,
                              so that `tensorboard --logdir runs` names the run by its folder
      tensorboard/, wandb/    the trackers' own folders (tensorboard/: where older trmoe put the events)
      profile/                torch.profiler traces (debug=profile)
      eval/<step>.json        python -m trmoe.eval's results for a checkpoint

Every name but .lock belongs to the run: run.overwrite=true removes them all (`removable`), and any of them
but status.json makes the directory hold a run (`held`). The bookkeeping files (BOOKKEEPING) are never
followed through a symbolic link (`linked`; trmoe.run.lock refuses such a directory).

This module only names paths; it imports nothing of trmoe's, so any tool may use it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# The key that names a run directory, for advice to choose another: run.name, or hydra.sweep.dir for a sweep's
# job, whose directory is <sweep dir>/<job number> whatever run.name says (two sweeps into one sweep dir meet
# in the same job directories). trmoe.train sets it for each job.
_NAMED_BY = ["run.name"]


def named_by(key: str | None = None) -> str:
    """The key that names the run directory (`key`: set it, for the job that starts)."""
    if key is not None:
        _NAMED_BY[0] = key
    return _NAMED_BY[0]


RUN_CONFIG = "run_config.json"
STATUS = "status.json"
LOG = "train.log"
METRICS = "metrics.csv"
TELEMETRY = "telemetry.csv"
CHECKPOINTS = "checkpoints"
HYDRA = ".hydra"
HYDRA_FILES = ("config.yaml", "hydra.yaml", "overrides.yaml")
RANK_LOGS = "logs"
LOCK = ".lock"
TRACKERS = "trackers.json"
TRACKER_DIRS = ("tensorboard", "wandb")
TENSORBOARD_EVENTS = "events.out.tfevents.*"  # a glob: SummaryWriter names its files by time and host
PROFILE = "profile"
EVAL = "eval"

METRICS_BACKUP = METRICS + ".orig"
LATEST = "latest"  # checkpoints/latest: the newest complete checkpoint's name
STEP_CSVS = (TELEMETRY,)  # per-step records besides metrics.csv, trimmed like it on resume
# Everything a run writes into its directory, .lock aside: what run.overwrite=true removes, and what makes a
# directory hold a run (status.json alone does not: the app writes it for a sweep job that failed on its
# config, before it had any record; every launch that got further wrote .hydra/ before status.json).
RUN_FILES = (RUN_CONFIG, METRICS, METRICS_BACKUP, *STEP_CSVS, LOG, TRACKERS)
RUN_DIRS = (CHECKPOINTS, HYDRA, RANK_LOGS, PROFILE, EVAL, *TRACKER_DIRS)
# The bookkeeping files trmoe reads and rewrites in place: never followed when they are symbolic links (a
# link would let a record of this run overwrite, or be read from, a file outside the run directory).
BOOKKEEPING = (LOCK, STATUS, *RUN_FILES, f"{CHECKPOINTS}/{LATEST}", *(f"{HYDRA}/{n}" for n in HYDRA_FILES))
MARKERS = (RUN_CONFIG, STATUS)  # what the report looks for to find the runs of a sweep


@dataclass(frozen=True)
class RunDir:
    """Paths of one run directory (nothing is created here)."""

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def run_config(self) -> Path:
        return self.path / RUN_CONFIG

    @property
    def status(self) -> Path:
        return self.path / STATUS

    @property
    def log(self) -> Path:
        return self.path / LOG

    def rank_log(self, rank: int) -> Path:
        return self.path / RANK_LOGS / f"rank_{rank}.log"

    @property
    def metrics(self) -> Path:
        return self.path / METRICS

    @property
    def metrics_backup(self) -> Path:
        return self.path / METRICS_BACKUP

    @property
    def telemetry(self) -> Path:
        return self.path / TELEMETRY

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    @property
    def hydra(self) -> Path:
        return self.path / HYDRA

    @property
    def lock(self) -> Path:
        return self.path / LOCK

    @property
    def trackers(self) -> Path:
        return self.path / TRACKERS

    def tracker_dir(self, name: str) -> Path:
        """A tracker's own files (tensorboard/, wandb/)."""
        return self.path / name

    @property
    def profile(self) -> Path:
        return self.path / PROFILE

    def eval_result(self, step: int) -> Path:
        return self.path / EVAL / f"{step}.json"

    def step_csvs(self) -> list[Path]:
        """metrics.csv and the other per-step CSVs that exist: what a resume continues."""
        return [p for p in (self.metrics, *(self.path / n for n in STEP_CSVS)) if p.exists()]

    def held(self) -> list[str]:
        """The run files this directory holds (checkpoints/ aside, which the caller inspects): non-empty
        means it holds a run, complete or not (a launch killed before run_config.json leaves .hydra/ and
        train.log). Links count (lexists): a dangling one is still there."""
        named = [n for n in (*RUN_FILES, *RUN_DIRS) if n != CHECKPOINTS and os.path.lexists(self.path / n)]
        return named + [p.name for p in self.tensorboard_events()]

    def tensorboard_events(self) -> list[Path]:
        """TensorBoard's event files in the run directory (logger=tensorboard)."""
        return sorted(self.path.glob(TENSORBOARD_EVENTS))

    def removable(self) -> tuple[list[Path], list[Path]]:
        """(files, directories) that make up a run: what run.overwrite=true removes (every name of this
        layout but .lock, held by the launch that removes them)."""
        files = [self.path / n for n in (*RUN_FILES, STATUS)] + self.tensorboard_events()
        return files, [self.path / n for n in RUN_DIRS]

    def linked(self) -> list[str]:
        """The bookkeeping files (BOOKKEEPING) that are symbolic links, relative to the run directory."""
        return [n for n in BOOKKEEPING if (self.path / n).is_symlink()]
