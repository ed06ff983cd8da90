"""Find a run's checkpoint: a run directory, its checkpoints/ directory or one checkpoint (step_XXXXXXXX)
-> the verified checkpoint (the newest complete one, or a chosen step), or one line naming what is allowed.

The one way every reader of a finished run finds its weights: loading a model (`trmoe/load.py`: sample,
export, eval), `trmoe-lm-eval`'s checks before the harness starts, and `trainer.init_from` (a branch from
another run). It reads the run directory's layout (`rundir`) and the store's checks (`checkpoint`) only.
"""

from __future__ import annotations

from pathlib import Path

from trmoe.errors import UserError
from trmoe.run.checkpoint import META, CheckpointError, CheckpointInfo, CheckpointStore
from trmoe.run.rundir import RunDir

ALLOWED_PATHS = "a run directory, its checkpoints/ directory or one checkpoint step_XXXXXXXX"


def find_checkpoint(path: str | Path, step: int | None = None) -> CheckpointInfo:
    """The verified checkpoint of `path` at `step` (None: the newest complete one)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"run {path}: no such file or directory; allowed: {ALLOWED_PATHS}")
    if (path / META).is_file():  # one checkpoint
        store, only = CheckpointStore(path.parent), path
    else:
        checkpoints = RunDir(path).checkpoints
        store = CheckpointStore(checkpoints if checkpoints.is_dir() else path)
        only = None
    if only is not None:
        try:
            info = store.verify(only)
        except CheckpointError as e:
            raise UserError(f"checkpoint {e}") from None
        if step is not None and info.step != step:
            raise UserError(f"step={step}: {only} is step {info.step}; allowed: {info.step}")
        return info
    steps = store.step_dirs()
    if not steps:
        raise UserError(f"run {path}: holds no checkpoint; allowed: {ALLOWED_PATHS} with one")
    if step is not None:
        found = [p for s, p in steps if s == step]
        if not found:
            raise UserError(
                f"step={step}: {path} has no checkpoint of that step; allowed: {[s for s, _ in steps]}"
            )
        try:
            return store.verify(found[0])
        except CheckpointError as e:
            raise UserError(f"checkpoint {e}") from None
    info = store.newest_good()
    if info is None:
        raise UserError(f"run {path}: no complete checkpoint (every one failed its check; see the warnings)")
    return info
