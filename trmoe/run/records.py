"""The run directory: .hydra/, train.log, run_config.json, metrics.csv, checkpoints/.

Nothing is written before the config is valid; files are written whole (temporary name, then rename).
An existing run's records are never overwritten: a resume continues metrics.csv from its checkpoint's step
(`trim_csv`, then `StepCsv(..., append=True, migrate=True)` in this run's column set), and trmoe.run.launch
decides, before any write, what a launch may do. The file
names are trmoe.run.rundir's.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
import shutil
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from trmoe.durable import json_text, nofollow, write_file
from trmoe.errors import UserError
from trmoe.run.rundir import HYDRA, LOG, RANK_LOGS, RunDir

SCHEMA_VERSION = 1


def write_hydra_files(run_dir: Path, cfg: DictConfig) -> None:
    """What Hydra itself would write to <run dir>/.hydra: the job config, Hydra's config, the overrides."""
    from hydra.core.hydra_config import HydraConfig

    hydra_dir = RunDir(run_dir).hydra
    hydra_dir.mkdir(parents=True, exist_ok=True)
    write_file(hydra_dir / "config.yaml", OmegaConf.to_yaml(cfg))
    if HydraConfig.initialized():
        hc = HydraConfig.get()
        write_file(hydra_dir / "hydra.yaml", OmegaConf.to_yaml(OmegaConf.create({"hydra": hc})))
        write_file(hydra_dir / "overrides.yaml", OmegaConf.to_yaml(list(hc.overrides.task)))


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from `path`; None if it is missing, unreadable or holds anything else."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def start_up_config(run: RunDir, held: list[str]) -> dict[str, Any] | None:
    """The config of a launch killed in its start-up (a ladder's branch as it starts, any run): its writes
    began (.hydra/, train.log, status.json) but it wrote no run_config.json and trained nothing (no
    metrics.csv, no checkpoint: `held` names the rest), so it may start again from step 0 (trmoe.run.launch).
    Its .hydra/config.yaml, resolved; None when the directory holds more or the file is unreadable."""
    if not set(held) <= {HYDRA, LOG, RANK_LOGS}:
        return None
    try:
        config = OmegaConf.to_container(
            OmegaConf.load(run.hydra / "config.yaml"), resolve=True, enum_to_str=True
        )
    except Exception:  # missing, unreadable, not YAML, an interpolation that does not resolve
        return None
    return config if isinstance(config, dict) else None


class EarlyLog(logging.Handler):
    """Keeps the run's messages logged before its log file may be written (the resume plan's warnings, a
    forced resume's differences), so that the file, once attached, starts with them."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.split(".")[0] == "trmoe":
            self.records.append(record)


LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"


def attach_log_file(path: Path, early: EarlyLog | None = None) -> logging.Handler:
    """Log into `path` from now on, after what `early` kept (which stops keeping)."""
    from trmoe.run.storage import LogFile

    path.parent.mkdir(parents=True, exist_ok=True)
    handler = LogFile(path)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    if early is not None:
        logging.getLogger().removeHandler(early)
        for record in early.records:
            handler.handle(record)
    logging.getLogger().addHandler(handler)
    logging.getLogger("trmoe").setLevel(logging.INFO)  # the run's own messages, whatever the root level
    return handler


def attach_rank_log(run_dir: Path, rank: int, early: EarlyLog | None = None) -> logging.Handler:
    """Rank r > 0: log into <run dir>/logs/rank_<r>.log instead of the console, starting with what `early`
    kept. Returns the file handler (the caller removes it at the end of the job)."""
    from trmoe.runtime.distributed import quiet_console

    quiet_console()
    return attach_log_file(RunDir(run_dir).rank_log(rank), early)


def write_run_config(run_dir: Path, record: dict[str, Any]) -> None:
    write_file(RunDir(run_dir).run_config, json_text({"schema_version": SCHEMA_VERSION, **record}, indent=2))


def _fmt(value: Any) -> str:
    if value is None:
        return "nan"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.9g}"  # a 1e-4 loss difference at loss ~12 survives
    return str(value)


class StepCsv:
    """A per-step CSV (metrics.csv, telemetry.csv): a header of `columns`, then one line per row, each value
    formatted by `_fmt`, flushed as written. `append=True` continues a file that already holds a header and
    `rows` rows (a resume: trmoe.run.launch trimmed it to the checkpoint's step, `trim_csv`); otherwise the
    file is started with the header. `continuing` decides that from the file.

    Appending, the file's header may name the same columns in another order, or others: rows are matched by
    name. By default the file keeps its extra columns; with `migrate` (metrics.csv) it is rewritten in
    `columns` (new columns nan), keeping only the extra per-run family columns (`eval_loss/<source>`, with a
    "/"), the original kept as <name>.orig."""

    def __init__(
        self,
        path: Path,
        columns: Sequence[str],
        *,
        append: bool = False,
        rows: int = 0,
        migrate: bool = False,
    ):
        self.path = path
        self.columns = tuple(columns)
        self.rows = rows if append else 0
        if append:
            header, _ = read_step_rows(path, 0)
            extra = [c for c in header or () if c not in self.columns and (not migrate or "/" in c)]
            self.columns = (*self.columns, *extra)
            if header is not None and tuple(header) != self.columns:
                if migrate:
                    _set_aside(path, [c for c in header if c not in self.columns])
                _rewrite(path, self.columns, header)
        self._file = open(path, "a" if append else "w", newline="", opener=nofollow)
        self._writer = csv.writer(self._file)
        if not append:
            self._writer.writerow(self.columns)
            self._file.flush()

    @classmethod
    def continuing(cls, path: Path, columns: Sequence[str]) -> StepCsv:
        """Append to `path` if its header names these columns, in any order (a resumed run's file), else start
        it. (`rows`
        then counts the rows this writer wrote.)"""
        header = read_step_rows(path, 0)[0] if path.is_file() else None
        return cls(path, columns, append=header is not None and set(header) == set(columns))

    def write(self, row: dict[str, Any]) -> None:
        self.write_rows([row])

    def write_rows(self, rows: Iterable[dict[str, Any]]) -> None:
        for row in rows:
            unknown = set(row) - set(self.columns)
            if unknown:
                raise KeyError(f"unknown {self.path.name} columns: {sorted(unknown)}")
            self._writer.writerow([_fmt(row.get(col)) for col in self.columns])
            self.rows += 1
        self._file.flush()

    def sync(self) -> dict[str, int]:
        """fsync (a checkpoint never gets ahead of the rows it covers) and return the position."""
        self._file.flush()
        os.fsync(self._file.fileno())
        return {"rows": self.rows, "bytes": self._file.tell()}

    def rewind(self, step: int) -> None:
        """Drop the rows after `step` (a rollback to that step's checkpoint) and go on appending."""
        self._file.close()
        self.rows = trim_csv(self.path, step)
        self._file = open(self.path, "a", newline="", opener=nofollow)
        self._writer = csv.writer(self._file)

    def close(self) -> None:
        self._file.close()


def read_step_rows(path: Path, through_step: int) -> tuple[list[str] | None, list[list[str]]]:
    """The header of a per-step CSV (metrics.csv, telemetry.csv; None if it is empty) and its complete rows
    up to `through_step` (a line a kill cut short is dropped). The step is read from the column named
    `step`, wherever the header puts it: every column is matched by name, never by position. A file that
    cannot be read as CSV text (binary garbage, a directory, a link), or whose header has no `step` column,
    raises UserError naming it: a resume checks this before it writes anything."""
    try:
        with open(path, newline="", opener=nofollow) as f:
            reader = csv.reader(f)
            header = next(reader, None)
            rows = list(reader)
    except (OSError, ValueError, csv.Error) as e:  # UnicodeDecodeError is a ValueError
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise UserError(f"{path} is unreadable ({reason}); move it aside to resume without it") from None
    if header is None:
        return None, []
    if "step" not in header or len(set(header)) != len(header):
        what = "no `step` column" if "step" not in header else "a column named twice"
        raise UserError(f"{path}: its header has {what}; move it aside to resume without it") from None
    at = header.index("step")
    kept = []
    for row in rows:
        try:
            step = int(row[at])
        except (ValueError, IndexError):
            continue  # a line a kill cut short
        if step <= through_step and len(row) == len(header):
            kept.append(row)
    return header, kept


def _set_aside(path: Path, dropped: Sequence[str]) -> None:
    """Keep `path` as <name>.orig before its columns are migrated to this trmoe's set."""
    shutil.copyfile(path, path.with_name(path.name + ".orig"))
    logging.getLogger("trmoe").warning(
        "%s: columns migrated to this trmoe's set (new columns nan%s); original kept as %s.orig",
        path.name,
        f"; dropped {list(dropped)}" if dropped else "",
        path.name,
    )


def _rewrite(
    path: Path, columns: Sequence[str], header: Sequence[str], through_step: int | None = None
) -> int:
    """Rewrite `path` (header `header`) atomically with the header `columns`, each kept row's values moved
    to the columns of the same name (nan where it has none); rows after `through_step` are dropped (None:
    none are). Returns the number of rows kept."""
    _, rows = read_step_rows(path, through_step if through_step is not None else sys.maxsize)
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(columns)
    for row in rows:
        named = dict(zip(header, row, strict=True))
        writer.writerow([named.get(col, "nan") for col in columns])
    write_file(path, out.getvalue())
    return len(rows)


def trim_csv(path: Path, through_step: int) -> int:
    """Keep the header and the rows whose `step` column is <= through_step, atomically (for
    per-step CSVs besides metrics.csv, e.g. telemetry.csv). Returns the number of rows kept."""
    header, kept = read_step_rows(path, through_step)
    out = io.StringIO()
    writer = csv.writer(out)
    if header is not None:
        writer.writerow(header)
    writer.writerows(kept)
    write_file(path, out.getvalue())
    return len(kept)
