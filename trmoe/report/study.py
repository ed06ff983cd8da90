"""A hyper-parameter search (hparams_search=<preset>: Hydra's Optuna sweeper) read back as a study: its name,
direction, searched keys and best trial, so that the report ranks its jobs as trials instead of comparing
them as arms of a grid."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from trmoe.report.runs import Run, _load_yaml, _obj, override_key

RESULTS = "optimization_results.yaml"  # what the Optuna sweeper writes into the sweep directory at its end


@dataclass
class Study:
    name: str
    direction: str  # minimize | maximize
    params: list[str]  # the searched keys, in the preset's order
    best_value: float | None

    def ranked(self, runs: list[Run], value: dict[str, float | None]) -> list[Run]:
        """The trials best first by `value` (the final held-out loss each job returned); none last."""
        sign = 1 if self.direction == "minimize" else -1

        def key(run: Run) -> tuple:
            v = value.get(run.name)
            missing = v is None or not math.isfinite(v)
            return (missing, 0.0 if missing else sign * v, run.name)

        return sorted(runs, key=key)


def save_multirun_config(sweep_dir: Path, config) -> None:
    """Hydra's basic sweeper keeps the sweep's config as multirun.yaml (the report reads the swept keys from
    it); the Optuna sweeper does not, so the report callback writes it once the sweep is over."""
    path = sweep_dir / "multirun.yaml"
    if not path.exists():
        OmegaConf.save(config, path)


def load_study(sweep_dirs: list[Path]) -> Study | None:
    """The study of the one sweep directory the runs come from, or None (a grid, separate runs)."""
    if len(sweep_dirs) != 1:
        return None
    sweep_dir = sweep_dirs[0]
    sweeper = _obj(_obj(_obj(_load_yaml(sweep_dir / "multirun.yaml")).get("hydra")).get("sweeper"))
    if "optuna" not in str(sweeper.get("_target_", "")).lower():
        return None
    direction = sweeper.get("direction", "minimize")
    direction = direction[0] if isinstance(direction, list) else direction
    best = _obj(_load_yaml(sweep_dir / RESULTS)).get("best_value")
    return Study(
        name=str(sweeper.get("study_name") or "study"),
        direction=str(direction),
        params=[override_key(str(k)) for k in _obj(sweeper.get("params"))],
        best_value=float(best) if isinstance(best, int | float) else None,
    )


def search_config(hc, sweep_dir: Path) -> dict:
    """An Optuna search's Hydra config as a trial saw it, resolved then (its sweep.dir may name the time),
    for the report should every trial fail (trmoe.report.callback.report_failed_search)."""
    try:
        hydra_cfg = OmegaConf.to_container(hc, resolve=True)
    except Exception:  # a key that resolves only inside Hydra: the report needs the sweeper's keys only
        hydra_cfg = OmegaConf.to_container(hc, resolve=False)
    hydra_cfg["sweep"] = {**hydra_cfg.get("sweep", {}), "dir": str(sweep_dir)}
    return hydra_cfg
