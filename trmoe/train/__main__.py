"""`python -m trmoe.train [overrides]` (also installed as `trmoe-train`): compose, validate, train.

Hydra composes the config from the groups in conf/; trmoe validates it and owns every file of the run
directory, so a bad config or input exits with one line and code 2, leaving nothing on disk.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import trmoe.config.schema  # noqa: F401  (registers the schemas before Hydra composes)
from trmoe.errors import UserError

_task_started = False


def _remove_empty_dirs(path: Path) -> None:
    """Undo the run directory (and its parents up to the launch directory) that Hydra created before the
    config was validated. rmdir only succeeds on empty directories: nothing a user wrote is ever removed."""
    cwd = Path.cwd().resolve()
    path = path.resolve()
    while path != cwd and cwd in path.parents:
        try:
            path.rmdir()
        except OSError:
            return
        path = path.parent


@hydra.main(version_base="1.3", config_path="pkg://trmoe.conf", config_name="config")
def _app(cfg: DictConfig) -> float:
    global _task_started
    _task_started = True
    from trmoe.train.loop import train

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        return train(cfg, run_dir)
    except UserError as e:
        _remove_empty_dirs(run_dir)
        print(f"trmoe: {e}", file=sys.stderr)
        sys.exit(e.exit_code)


def main() -> None:
    try:
        _app()
    except SystemExit as e:
        # Hydra reports composition errors (unknown key, bad override, missing group option) itself and
        # exits 1; those are user errors too, so they exit 2 like the rest.
        if e.code == 1 and not _task_started:
            sys.exit(2)
        raise


if __name__ == "__main__":
    main()
