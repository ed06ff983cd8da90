"""The run directory: .hydra/, train.log, run_config.json, metrics.csv, checkpoints/.

Nothing is written before the config is valid; files are written whole (temporary name, then rename)
and an existing run's records are never overwritten.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from trmoe.errors import UserError

SCHEMA_VERSION = 1

# Fixed column order. Expert columns are NaN unless telemetry fills them.
METRIC_COLUMNS = (
    "step",
    "tokens",
    "train_loss",  # pure cross-entropy of the step's batch (mean over its tokens)
    "train_ppl",
    "train_objective",  # what was optimised: smoothed CE + z-loss term
    "eval_loss",  # pure cross-entropy on the fixed held-out batches
    "eval_ppl",
    "lr",
    "grad_norm",  # global gradient norm before clipping
    "tok_s",  # training tokens per second over the logging window, evaluation time excluded
    "elapsed_s",
    "shared_gate",
    "routed_gate",
    "expert_imbalance",
    "expert_dead",
)

RUN_FILES = ("run_config.json", "metrics.csv")


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def check_fresh(run_dir: Path) -> None:
    """Refuse to reuse a directory that already holds a run's records."""
    existing = [name for name in RUN_FILES if (run_dir / name).exists()]
    if existing:
        raise UserError(
            f"run directory {run_dir} already holds a run ({', '.join(existing)}); "
            "choose another run.name (nothing was changed)"
        )


def write_hydra_files(run_dir: Path, cfg: DictConfig) -> None:
    """What Hydra itself would write to <run dir>/.hydra: the job config, Hydra's config, the overrides."""
    from hydra.core.hydra_config import HydraConfig

    hydra_dir = run_dir / ".hydra"
    hydra_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(hydra_dir / "config.yaml", OmegaConf.to_yaml(cfg))
    if HydraConfig.initialized():
        hc = HydraConfig.get()
        write_atomic(hydra_dir / "hydra.yaml", OmegaConf.to_yaml(OmegaConf.create({"hydra": hc})))
        write_atomic(hydra_dir / "overrides.yaml", OmegaConf.to_yaml(list(hc.overrides.task)))


def attach_log_file(run_dir: Path) -> logging.Handler:
    handler = logging.FileHandler(run_dir / "train.log")
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    logging.getLogger().addHandler(handler)
    logging.getLogger("trmoe").setLevel(logging.INFO)  # the run's own messages, whatever the root level
    return handler


def write_run_config(run_dir: Path, record: dict[str, Any]) -> None:
    write_atomic(
        run_dir / "run_config.json", json.dumps({"schema_version": SCHEMA_VERSION, **record}, indent=2)
    )


def _fmt(value: Any) -> str:
    if value is None:
        return "nan"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.6g}"
    return str(value)


class MetricsWriter:
    """metrics.csv: one row per logged step, flushed as written."""

    def __init__(self, path: Path):
        self._file = open(path, "w", newline="")
        self._writer = csv.writer(self._file)
        self._writer.writerow(METRIC_COLUMNS)
        self._file.flush()

    def write(self, row: dict[str, Any]) -> None:
        unknown = set(row) - set(METRIC_COLUMNS)
        if unknown:
            raise KeyError(f"unknown metric columns: {sorted(unknown)}")
        self._writer.writerow([_fmt(row.get(col)) for col in METRIC_COLUMNS])
        self._file.flush()

    def close(self) -> None:
        self._file.close()
