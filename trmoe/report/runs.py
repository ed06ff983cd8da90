"""Read run directories: run_config.json, metrics.csv, status.json, .hydra/ and the sweep's multirun.yaml.

Everything is optional: a run that failed before training has only status.json; metrics columns are read by
name, and a column a run did not record reads as missing (the report shows n/a). A record that is there but
cannot be read (not JSON, not an object where one belongs) reads as missing too, and the run carries a note
that says so (Run.unreadable), which the report shows.

What the report knows of a metrics column (its unit, whether it gets a figure, its meaning) is the run's own
record of its producers' declarations, run_config.json's `metrics_declared` (trmoe.run.columns): a run is
reported with the knowledge of the code that wrote it, and a column a new producer declares is reported with
no change here (`Run.declaration`). Runs written before the declarations were recorded (only the names,
`metrics_columns`) wrote the columns of BEFORE_DECLARATIONS: their units and plots are that frozen table, not
today's declarations, which live in train/ (below which the report sits) and describe the code that reads, not
the code that wrote; those versions never change, so neither does the table (tests/test_metric_columns.py
checks it against the producers' declarations of the same columns).
"""

from __future__ import annotations

import csv
import fnmatch
import io
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from trmoe.durable import nofollow
from trmoe.run.columns import MetricColumn
from trmoe.run.rundir import MARKERS as RUN_MARKERS
from trmoe.run.rundir import RUN_CONFIG as RECORD_FILE
from trmoe.run.rundir import RunDir
from trmoe.run.status import FINISHED, RUNNING, STATUS_FILE, read_status

# Keys of run_config.json that hold an object (or null); anything else there is an unreadable part of it.
RECORD_OBJECTS = tuple("config model_spec params git backend data controls param_match derived".split())
SEED_KEY = "trainer.seed"
# Overrides that never define an arm: where the run is written and how it is displayed.
IGNORED_KEYS = ("run.name", "run.progress")
# The columns trmoe wrote before runs recorded `metrics_declared`, by unit (a family `acc/<task>` by its
# name `acc`; any other column is a plain number, unit "1"), and those the report plotted.
BEFORE_DECLARATIONS = {
    "step": "step", "tokens": "tokens", "nats/token": "train_loss train_objective eval_train_loss eval_loss",
    "bits/byte": "eval_bpb", "tokens/s": "tok_s", "s": "elapsed_s", "GiB": "peak_mem_gib",
    "experts": "expert_dead", "steps": "skipped_steps loss_spikes", "accuracy": "acc acc_norm",
}  # fmt: skip
PLOTTED_BEFORE_DECLARATIONS = ("train_loss", "eval_loss", "tok_s", "acc/*", "acc_norm/*")


def undeclared(column: str) -> MetricColumn:
    """A column of a run that recorded no declaration of it, as the code before the declarations wrote it."""
    name = column.split("/", 1)[0]
    unit = next((u for u, names in BEFORE_DECLARATIONS.items() if name in names.split()), "1")
    section = f"other/{column}"
    plot = any(fnmatch.fnmatchcase(column, p) for p in PLOTTED_BEFORE_DECLARATIONS)
    return MetricColumn(column, unit, section, column, plot=plot)


def _natural(path: Path) -> tuple:
    """Sort key with numbers compared as numbers: multirun job 10 after job 9."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.parts)


def find_runs(paths: list[Path]) -> list[Path]:
    """Run directories: the given paths that are runs, and every run below the others."""
    found: set[Path] = set()
    for path in paths:
        if any((path / marker).is_file() for marker in RUN_MARKERS):
            found.add(path)
            continue
        for marker in RUN_MARKERS:
            found.update(p.parent for p in path.rglob(marker))
    return sorted(found, key=_natural)


def override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def override_dict(overrides: list[str]) -> dict[str, str]:
    return {override_key(o): o.split("=", 1)[1] if "=" in o else "" for o in overrides}


def _load_yaml(path: Path) -> Any:
    try:
        return OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception:  # a missing or unreadable file is a missing record, not a crash of the report
        return None


def _obj(value: Any) -> dict:
    """The value if it is a mapping, else {} (a record with another type where a mapping belongs)."""
    return value if isinstance(value, dict) else {}


def _dig(node: Any, dotted: str) -> Any:
    """node["a"]["b"] for "a.b"; None where a key is missing or a node on the way is not a mapping."""
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _json_kind(value: Any) -> str:
    kinds = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


def _float(text: str | None) -> float:
    try:
        return float(text) if text not in (None, "") else math.nan
    except ValueError:
        return math.nan


@dataclass
class Sweep:
    """The launch a run belongs to: one multirun directory, or the run itself when it was a single run."""

    path: Path
    swept: list[str]  # keys whose values vary between the jobs of this launch
    control: str | None = None


def load_sweep(path: Path) -> Sweep:
    """Swept keys of a multirun: hydra.sweeper.params plus the command-line overrides with sweep syntax."""
    hydra = _obj(_obj(_load_yaml(path / "multirun.yaml")).get("hydra"))
    swept = [override_key(str(k)) for k in _obj(_obj(hydra.get("sweeper")).get("params"))]
    task = _obj(hydra.get("overrides")).get("task") or []
    task = task if isinstance(task, list) else []
    if task:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        try:
            parsed = OverridesParser.create().parse_overrides(list(task))
            swept += [override_key(o.get_key_element()) for o in parsed if o.is_sweep_override()]
        except Exception:  # an override the plain parser cannot read (glob of a group): fall back to commas
            swept += [override_key(str(o)) for o in task if "," in str(o).split("=", 1)[-1]]
    control = _obj(_obj(hydra.get("callbacks")).get("report")).get("control")
    return Sweep(path, list(dict.fromkeys(swept)), control if isinstance(control, str) else None)


def find_sweep_dir(run_dir: Path, levels: int = 3) -> Path | None:
    for parent in list(run_dir.parents)[:levels]:
        if (parent / "multirun.yaml").is_file():
            return parent
    return None


@dataclass
class Run:
    path: Path
    name: str  # the run's label in the report: its path relative to the report directory
    record: dict  # run_config.json ({} when the run failed before writing it)
    status: str  # finished | failed | running
    error: str | None
    overrides: list[str]  # the job's task overrides
    choices: dict[str, str]  # Hydra's runtime.choices: config group -> option
    control: str | None  # hydra.callbacks.report.control recorded with the run
    sweep: Sweep
    columns: list[str] = field(default_factory=list)
    rows: list[dict[str, float]] = field(default_factory=list)
    status_inferred: bool = False
    unreadable: list[str] = field(default_factory=list)  # records there but not readable, one note each
    status_record: dict = field(default_factory=dict)  # status.json as written ({} when absent)
    declared: dict[str, MetricColumn] = field(default_factory=dict)  # run_config.json's metrics_declared

    @property
    def config(self) -> dict:
        return _obj(self.record.get("config"))

    def config_value(self, dotted: str) -> Any:
        return _dig(self.config, dotted)

    @property
    def seed(self) -> int | None:
        value = override_dict(self.overrides).get(SEED_KEY)
        if value is None:
            value = self.config_value(SEED_KEY)
        try:
            return int(value) if value is not None else None
        except ValueError:
            return None

    def value_of(self, key: str) -> str:
        """The run's value of a swept key: its override, else the config value or group choice."""
        overrides = override_dict(self.overrides)
        if key in overrides:
            return overrides[key]
        if key in self.choices:
            return str(self.choices[key])
        value = self.config_value(key)
        return "(default)" if value is None else str(value)

    def series(self, column: str) -> list[tuple[float, float, float]]:
        """(step, tokens, value) of the rows where the column holds a finite value."""
        out = []
        for row in self.rows:
            value = row.get(column, math.nan)
            if math.isfinite(value):
                out.append((row.get("step", math.nan), row.get("tokens", math.nan), value))
        return out

    def has_column(self, column: str) -> bool:
        return column in self.columns

    def declaration(self, column: str) -> MetricColumn:
        """The column as the run's producers declared it (unit, plot, meaning), else BEFORE_DECLARATIONS'."""
        return self.declared.get(column) or undeclared(column)


def _read_declared(record: dict, notes: list[str]) -> dict[str, MetricColumn]:
    """run_config.json's `metrics_declared` by column name ({} when the run recorded none; a note when it is
    there but not a list of declarations)."""
    entries = record.get("metrics_declared")
    if entries is None:
        return {}
    try:
        return {c.name: c for c in map(MetricColumn.from_record, entries)}
    except (TypeError, KeyError, AttributeError):
        notes.append(f"{RECORD_FILE} unreadable in part: `metrics_declared` is not a list of declarations")
        return {}


def _read_metrics(path: Path, notes: list[str]) -> tuple[list[str], list[dict[str, float]]]:
    """metrics.csv's columns and its complete rows, in step order, read by column name. A row is complete
    when it has every column and a finite step, and its line ends: a last line without its line end was cut
    short by a kill mid-write (its last value may be a prefix, "3.5" for 3.5373) and is left out. What is
    left out, and rows out of step order (read sorted by step), are noted."""
    try:
        with open(path, newline="", opener=nofollow) as f:  # (a link: not this run's metrics)
            text = f.read()
        lines = list(csv.reader(io.StringIO(text)))
    except FileNotFoundError:
        return [], []
    except OSError as e:
        notes.append(f"{path.name} unreadable: {e.strerror or type(e).__name__}")
        return [], []
    except UnicodeDecodeError:
        notes.append(f"{path.name} unreadable: not UTF-8 text")
        return [], []
    except csv.Error as e:
        notes.append(f"{path.name} unreadable: not CSV ({e})")
        return [], []
    if not lines:
        return [], []
    header, body = lines[0], lines[1:]
    if body and not text.endswith(("\n", "\r")):
        body = body[:-1]
        notes.append(f"{path.name}: its last line is cut short (a write stopped mid-row): left out")
    rows = [
        {k: _float(v) for k, v in zip(header, line, strict=True)} for line in body if len(line) == len(header)
    ]
    incomplete = len(body) - len(rows)
    complete = [r for r in rows if math.isfinite(r.get("step", math.nan))]
    incomplete += len(rows) - len(complete)
    if incomplete:
        notes.append(f"{path.name}: {incomplete} incomplete row(s) (missing values or no step) left out")
    steps = [r["step"] for r in complete]
    if steps != sorted(steps):
        notes.append(f"{path.name}: rows out of step order; read sorted by step")
        complete.sort(key=lambda r: r["step"])
    return header, complete


def _read_record(path: Path, notes: list[str]) -> dict:
    """run_config.json as a mapping: {} when it is absent (the run failed before writing it) or unreadable
    (a note then says why), without the parts that are not the objects they should be (one note)."""
    try:
        record = json.loads((path / RECORD_FILE).read_text())
    except FileNotFoundError:
        return {}
    except OSError as e:
        notes.append(f"{RECORD_FILE} unreadable: {e.strerror or type(e).__name__}")
        return {}
    except ValueError:  # JSONDecodeError, UnicodeDecodeError: a truncated or garbled file
        notes.append(f"{RECORD_FILE} unreadable: not valid JSON")
        return {}
    if not isinstance(record, dict):
        notes.append(f"{RECORD_FILE} unreadable: {_json_kind(record)}, not an object")
        return {}
    bad = [key for key in RECORD_OBJECTS if record.get(key) is not None and not isinstance(record[key], dict)]
    if bad:
        kinds = ", ".join(f"`{key}` is {_json_kind(record.pop(key))}" for key in bad)
        notes.append(
            f"{RECORD_FILE} unreadable in part: {kinds}, not {'an object' if len(bad) == 1 else 'objects'}"
        )
    return record


def _read_status(path: Path, notes: list[str]) -> dict:
    """status.json as a mapping; {} when absent, or unreadable (with a note)."""
    status = read_status(path)
    if status is None and (path / STATUS_FILE).exists():
        notes.append(f"{STATUS_FILE} unreadable: not valid JSON")
    elif status is not None and not isinstance(status, dict):
        notes.append(f"{STATUS_FILE} unreadable: {_json_kind(status)}, not an object")
    return _obj(status)


def _relative_name(path: Path, root: Path) -> str:
    try:
        name = str(path.resolve().relative_to(root.resolve()))
    except ValueError:
        name = str(path)
    return name if name != "." else path.name


def load_run(path: Path, root: Path, sweeps: dict[Path, Sweep]) -> Run:
    notes: list[str] = []
    record = _read_record(path, notes)
    status_record = _read_status(path, notes)
    files = RunDir(path)
    overrides = _load_yaml(files.hydra / "overrides.yaml")
    if not isinstance(overrides, list):
        overrides = status_record.get("overrides")
        overrides = overrides if isinstance(overrides, list) else []
    hydra = _obj(_obj(_load_yaml(files.hydra / "hydra.yaml")).get("hydra"))
    choices = {k: v for k, v in _obj(_obj(hydra.get("runtime")).get("choices")).items() if v is not None}
    control = _obj(_obj(hydra.get("callbacks")).get("report")).get("control")
    columns, rows = _read_metrics(files.metrics, notes)

    sweep_dir = find_sweep_dir(path)
    if sweep_dir is None:
        sweep = Sweep(path, [])
    else:
        if sweep_dir not in sweeps:
            sweeps[sweep_dir] = load_sweep(sweep_dir)
        sweep = sweeps[sweep_dir]

    # status.json says finished / failed / running, or another state its writer knows (e.g. preempted).
    status, error, inferred = status_record.get("status"), status_record.get("error"), False
    if not isinstance(status, str) or not status:
        # Runs written before status.json existed: finished when the last logged step is the last step.
        steps = _dig(record.get("config"), "trainer.steps")
        last = max((r.get("step", math.nan) for r in rows), default=math.nan)
        status = FINISHED if steps is not None and last == steps else RUNNING
        inferred = True
    return Run(
        path=path,
        name=_relative_name(path, root),
        record=record,
        status=status,
        error=error,
        overrides=[str(o) for o in overrides],
        choices={str(k): str(v) for k, v in choices.items()},
        control=(control if isinstance(control, str) else None) or sweep.control,
        sweep=sweep,
        columns=columns,
        rows=rows,
        status_inferred=inferred,
        unreadable=notes,
        status_record=status_record,
        declared=_read_declared(record, notes),
    )


def common_root(paths: list[Path]) -> Path:
    """The deepest directory that holds every path."""
    resolved = [p.resolve() for p in paths]
    root = resolved[0]
    while not all(p == root or root in p.parents for p in resolved):
        root = root.parent
    return root


def load_runs(paths: list[Path]) -> list[Run]:
    """Every run under paths, named by its path relative to the directory that holds them all (a sweep's
    jobs: their job numbers)."""
    found = find_runs(paths)
    root = common_root(found) if found else Path(".")
    sweeps: dict[Path, Sweep] = {}
    return [load_run(p, root, sweeps) for p in found]


HIDDEN_ROOTS = ("hydra", "logger")  # Hydra itself; the trackers, which record a run and do not change it


def is_hidden_key(key: str) -> bool:
    """Overrides of Hydra itself (hydra.*, hydra/launcher=...), of the trackers (logger=tensorboard,
    logger.mlflow.*: what records a run, not what it trains) and of run naming never define an arm."""
    return re.split(r"[./]", key, maxsplit=1)[0].lstrip("+~") in HIDDEN_ROOTS or key in IGNORED_KEYS
