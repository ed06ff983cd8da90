"""Experiment trackers (the `logger` config group): TensorBoard, MLflow, Weights & Biases beside metrics.csv.

metrics.csv is always written and stays the source of truth; each chosen tracker gets the same scalars
(every finite column of each metrics row at the row's step, named in sections as TensorBoard and W&B group
them: each column's declared `section` (trmoe.run.columns), e.g. train_loss -> train/loss, tok_s ->
throughput/tok_s; docs/training.md has the table), the resolved config as hyper-parameters (plain values:
`modulo_cyclic`, filterable) and the run's identity (run name, directory, trmoe version, config hash).
Only rank 0 logs.

With telemetry.moe=true each logged step's telemetry.csv rows (one per layer) go along with its metrics row:
every finite column as a scalar named moe/layer_<i>/<column>, and in TensorBoard each layer's expert shares
also as a histogram, moe/layer_<i>/shares.

MLflow's default store is its recommended local database, sqlite:///<runs>/mlflow.db beside the run
directories (`mlflow ui --backend-store-uri sqlite:///runs/mlflow.db`, or MlflowClient, open it with no
setting); a file store already there (<runs>/mlruns, from older trmoe) is read on as it was. An experiment
trmoe creates in a local database keeps its artifacts beside it, <runs>/mlartifacts (MLflow's own default
is ./mlruns under whatever folder the run was launched from). When the run ends (finished, failed or
stopped) its run_config.json, metrics.csv, resolved config (config.yaml) and Hydra's own records (hydra/)
are logged as the run's artifacts.

TensorBoard's event files go straight into the run directory (`logger.tensorboard.dir=.`), so that
`tensorboard --logdir runs` lists each run by its name. Neither trackers.json nor TensorBoard's text
summary holds an absolute local path: a local store is recorded relative to the run directory, and the
run's directory is its TensorBoard run name.

A resumed run continues the same tracker run: MLflow's run id and W&B's id are kept in
<run dir>/trackers.json, and no step is logged twice — TensorBoard purges what the killed attempt logged after
the checkpoint (a SessionLog START at the resumed step, which TensorBoard's readers honour); MLflow and W&B,
whose histories only append, get the rows after the last step they already hold (a CPU resume recomputes those
rows bit for bit). A tracker chosen only at a resume (none of its records in the run) gets the metrics.csv
rows up to the resumed step first, so it holds the whole run; telemetry's per-layer scalars of those steps
are not replayed, and the log says so.

The trackers are optional extras (`pip install trmoe[trackers]`), imported only when chosen.

Over 400 lines on purpose: the three backends share one contract (one run per run directory across
resumes, no step logged twice, no absolute local path recorded, artifacts at the end), and its bookkeeping
(trackers.json, the stores' URIs, the backfill of a tracker added at a resume) is read beside each backend's
adapter; split by backend, that contract would be restated three times.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from typing import Any

from trmoe.config.schema import LoggerConfig
from trmoe.durable import json_text, write_file
from trmoe.errors import UserError
from trmoe.run.rundir import TRACKERS as TRACKERS_FILE

log = logging.getLogger("trmoe")

# the package each tracker needs, and the extra that installs it
_PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}


def _require(name: str) -> None:
    import importlib.util

    if importlib.util.find_spec(_PACKAGES[name]) is None:
        raise UserError(
            f"config error: logger={name}: the {_PACKAGES[name]} package is not installed; "
            "allowed: pip install 'trmoe[trackers]', or a logger that is installed (csv is always written)"
        )


def chosen(cfg: LoggerConfig) -> list[str]:
    return [name for name in _PACKAGES if getattr(cfg, name) is not None]


def check_installed(cfg: LoggerConfig) -> None:
    """Before anything is written: every chosen tracker's package can be imported."""
    for name in chosen(cfg):
        _require(name)


def tracker_name(column: str, sections: Mapping[str, str]) -> str:
    """The tracker scalar of a metrics.csv column: its declared section (`sections`: column -> name, from the
    producers' declarations); a column "<base>/<x>" that is not declared is named after its base, then
    "/<x>"; any other column is under other/ (a column an older header kept)."""
    if column in sections:
        return sections[column]
    base, slash, rest = column.partition("/")
    family = [s.rpartition("/")[0] for c, s in sections.items() if c.partition("/")[0] == base and "/" in c]
    return (family[0] if family else sections.get(base, f"other/{base}")) + slash + rest


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config as dotted keys with scalar values (None as the string 'null'), lists as text."""
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    key = prefix.rstrip(".")
    if node is None:
        return {key: "null"}
    if isinstance(node, Enum):  # its value, not "RoutingStrategy.modulo_cyclic"
        return {key: node.value}
    if isinstance(node, bool | int | float | str):
        return {key: node}
    return {key: json_text(node)}


def scalars(row: dict[str, Any], skip: tuple[str, ...] = ("step",)) -> dict[str, float]:
    """The finite numeric columns of a metrics row, step excluded (it is the x axis)."""
    out = {}
    for key, value in row.items():
        if key in skip or value is None or isinstance(value, bool):
            continue
        value = float(value)
        if math.isfinite(value):
            out[key] = value
    return out


def layer_scalars(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The per-layer telemetry rows of one step as scalars named moe/layer_<i>/<column>."""
    out = {}
    for row in rows:
        prefix = f"moe/layer_{row['layer']}/"
        out.update({prefix + key: v for key, v in scalars(row, skip=("step", "layer")).items()})
    return out


def _shares(row: dict[str, Any]) -> list[float]:
    """A telemetry row's expert shares (share_0, share_1, ...; none for a layer without routed slots)."""
    return [v for k, v in row.items() if k.startswith("share_") and v is not None]


class _TensorBoard:
    def __init__(
        self, cfg, run_dir: Path, identity: dict, config: dict, resume_step: int | None, eval_loss: str
    ):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.dir = run_dir / cfg.dir
        # a resumed run: the killed attempt's events after the checkpoint are dropped by TensorBoard's readers
        self.writer = SummaryWriter(
            str(self.dir), purge_step=None if resume_step is None else resume_step + 1
        )
        if resume_step is None:
            exp, ssi, sei = hparams(flatten(config), {eval_loss: math.nan})
            for summary in (exp, ssi, sei):
                self.writer.file_writer.add_summary(summary)
            # the run's directory is TensorBoard's run name already: no local path in what may be shared
            shown = {k: v for k, v in identity.items() if k != "run_dir"}
            self.writer.add_text("run", "\n\n".join(f"**{k}**: {v}" for k, v in shown.items()))
        self.state: dict = {}

    def log(self, values: dict[str, float], step: int, layers: list[dict[str, Any]]) -> None:
        for key, value in (values | layer_scalars(layers)).items():
            self.writer.add_scalar(key, value, step)
        for row in layers:
            shares = _shares(row)
            if shares:
                import numpy as np

                self.writer.add_histogram(f"moe/layer_{row['layer']}/shares", np.array(shares), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _MLflow:
    def __init__(
        self, cfg, run_dir: Path, identity: dict, config: dict, previous: dict | None, every_row: str
    ):
        """`every_row`: the scalar of a column every row has (its history gives the last step logged)."""
        from mlflow.tracking import MlflowClient

        recorded = local_uri((previous or {}).get("tracking_uri"), run_dir)
        uri = local_uri(cfg.tracking_uri, Path.cwd()) or recorded or default_store(run_dir)
        if uri.startswith("file:"):  # a file store from older trmoe: MLflow 3 opens it only when asked to
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        self.last_step = -1
        self.run_dir, self.config = run_dir, config
        if previous and recorded == uri:
            self.run_id = previous["run_id"]
            history = self.client.get_metric_history(self.run_id, every_row)
            self.last_step = max((m.step for m in history), default=-1)
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            experiment = self.client.get_experiment_by_name(cfg.experiment)
            exp_id = (
                experiment.experiment_id
                if experiment is not None
                else self.client.create_experiment(cfg.experiment, artifact_location=artifact_location(uri))
            )
            run = self.client.create_run(exp_id, run_name=identity["run_name"], tags=_tags(identity))
            self.run_id = run.info.run_id
            from mlflow.entities import Param

            params = [Param(k, str(v)[:6000]) for k, v in flatten(config).items()]
            for i in range(0, len(params), 100):  # MLflow's batch limit
                self.client.log_batch(self.run_id, params=params[i : i + 100])
        self.state = {"tracking_uri": portable_uri(uri, run_dir), "run_id": self.run_id}

    def log(self, values: dict[str, float], step: int, layers: list[dict[str, Any]]) -> None:
        if step <= self.last_step:  # the killed attempt logged it already (append-only history)
            return
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in (values | layer_scalars(layers)).items()]
        for i in range(0, len(metrics), 1000):  # MLflow's batch limit (per-layer telemetry can exceed it)
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])
        self.last_step = step

    def close(self, status: str = "FINISHED") -> None:
        """The run's records as its artifacts (what an MLflow user looks for beside the params), then
        its end. A resumed run logs them again at its end: the same names, the newer files."""
        from trmoe.run.rundir import RunDir

        files = RunDir(self.run_dir)
        for path in (files.run_config, files.metrics):
            if path.is_file():
                self.client.log_artifact(self.run_id, str(path))
        plain = json.loads(
            json_text(self.config, default=lambda v: v.value if isinstance(v, Enum) else str(v))
        )
        self.client.log_dict(self.run_id, plain, "config.yaml")
        if files.hydra.is_dir():
            self.client.log_artifacts(self.run_id, str(files.hydra), "hydra")
        self.client.set_terminated(self.run_id, status=status)


class _Wandb:
    def __init__(self, cfg, run_dir: Path, identity: dict, config: dict, previous: dict | None):
        import wandb

        run_id = previous["id"] if previous else None
        self.last_step = previous.get("last_step", -1) if previous else -1
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            group=cfg.group,
            mode=cfg.mode.value,
            dir=str(run_dir),
            name=identity["run_name"],
            id=run_id,
            resume="allow" if run_id else None,
            config=config,
            tags=[f"trmoe-{identity['trmoe_version']}"],
            notes=identity["run_dir"],
        )
        self.run_dir = run_dir
        self.state = {"id": self.run.id, "last_step": self.last_step}

    def log(self, values: dict[str, float], step: int, layers: list[dict[str, Any]]) -> None:
        if step <= self.last_step:
            return
        self.run.log(values | layer_scalars(layers), step=step)
        self.last_step = self.state["last_step"] = step

    def close(self, status: str = "FINISHED") -> None:
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)


def default_store(run_dir: Path) -> str:
    """MLflow's store beside the run directories: the file store older trmoe made there when it exists,
    else MLflow's recommended local database, <runs>/mlflow.db."""
    runs = run_dir.resolve().parent
    if (runs / "mlruns").is_dir() and not (runs / "mlflow.db").exists():
        return (runs / "mlruns").as_uri()
    return f"sqlite:///{runs / 'mlflow.db'}"


def _holds_records(name: str, cfg: LoggerConfig, run_dir: Path, previous: dict) -> bool:
    """Whether tracker `name` already holds this run's earlier steps: TensorBoard's event files in its
    directory, MLflow's and W&B's run ids in trackers.json."""
    if name == "tensorboard":
        return any((run_dir / cfg.tensorboard.dir).glob("events.out.tfevents.*"))
    return bool(previous.get(name))


def _sqlite_path(uri: str) -> str | None:
    return uri[len("sqlite:///") :] if uri.startswith("sqlite:///") else None


def local_uri(uri: str | None, base: Path) -> str | None:
    """A store URI with its local path made absolute against `base` (the launch folder for a configured
    URI, as MLflow reads it; the run directory for one trackers.json recorded); others unchanged."""
    if not uri:
        return uri
    path = _sqlite_path(uri)
    if path is not None and path and not Path(path).is_absolute():
        return f"sqlite:///{(base / path).resolve()}"
    if uri.startswith("file:") and not uri.startswith("file:/"):
        return (base / uri[len("file:") :]).resolve().as_uri()
    return uri


def portable_uri(uri: str, run_dir: Path) -> str:
    """A local store's URI relative to the run directory (trackers.json holds no absolute local path:
    the runs folder can move or be shared); a server's URI as it is."""
    path = _sqlite_path(uri)
    if path is not None and Path(path).is_absolute():
        return f"sqlite:///{os.path.relpath(path, run_dir.resolve())}"
    if uri.startswith("file:/"):
        from urllib.parse import unquote, urlparse

        return f"file:{os.path.relpath(unquote(urlparse(uri).path), run_dir.resolve())}"
    return uri


def artifact_location(uri: str) -> str | None:
    """Where a new experiment keeps its artifacts: beside a local database (<its folder>/mlartifacts),
    not MLflow's default ./mlruns under the launch folder; a file store or server's own default otherwise."""
    path = _sqlite_path(uri)
    if path is None or not Path(path).is_absolute():
        return None
    return (Path(path).parent / "mlartifacts").as_uri()


def _tags(identity: dict) -> dict[str, str]:
    return {f"trmoe.{k}": str(v) for k, v in identity.items()}


class Trackers:
    """The chosen trackers of a run (rank 0): `log(row, layers)` beside each metrics.csv row (and its
    telemetry.csv rows), `close()` at the end."""

    def __init__(
        self,
        cfg: LoggerConfig,
        run_dir: Path,
        *,
        identity: dict[str, Any],
        config: dict[str, Any],
        resume_step: int | None,
        sections: Mapping[str, str],
    ):
        """`resume_step`: None for a new run; else the step the run continues after (its checkpoint's, or
        -1 for a run restarted from the beginning), whose tracker runs (trackers.json) go on. `sections`:
        metrics.csv column -> tracker scalar (trmoe.run.columns.sections of the producers' declarations)."""
        self.run_dir, self.sections = run_dir, dict(sections)
        self._trackers: dict[str, Any] = {}
        names = chosen(cfg)
        if not names:
            return
        check_installed(cfg)
        path = run_dir / TRACKERS_FILE
        previous = json.loads(path.read_text()) if resume_step is not None and path.is_file() else {}
        added = []  # chosen at this resume: nothing of the steps before it is in them yet
        for name in names:
            resumed = resume_step is not None and resume_step > 0
            if resumed and not _holds_records(name, cfg, run_dir, previous):
                added.append(name)
            if name == "tensorboard":
                eval_loss = tracker_name("eval_loss", self.sections)
                start = None if name in added else resume_step  # a new one: its hparams, nothing to purge
                tracker = _TensorBoard(cfg.tensorboard, run_dir, identity, config, start, eval_loss)
            elif name == "mlflow":
                tokens = tracker_name("tokens", self.sections)
                tracker = _MLflow(cfg.mlflow, run_dir, identity, config, previous.get("mlflow"), tokens)
            else:
                tracker = _Wandb(cfg.wandb, run_dir, identity, config, previous.get("wandb"))
            self._trackers[name] = tracker
        self._save()
        log.info("trackers: %s", ", ".join(names))
        if added:
            self._backfill(added, resume_step)

    def _backfill(self, names: list[str], through_step: int) -> None:
        """The metrics.csv rows up to `through_step` into the trackers `names` (added at this resume)."""
        from trmoe.run.records import read_step_rows
        from trmoe.run.rundir import METRICS

        header, rows = read_step_rows(self.run_dir / METRICS, through_step)
        for row in rows:
            values = {}
            for key, text in zip(header or [], row, strict=True):
                try:
                    values[key] = float(text)
                except ValueError:
                    continue  # an empty cell: not logged at that step
            named = {tracker_name(k, self.sections): v for k, v in scalars(values).items()}
            for name in names:
                self._trackers[name].log(named, int(values["step"]), [])
        self._save()
        log.info(
            "trackers: %s added at this resume: %d metrics.csv rows up to step %d logged first (per-layer "
            "telemetry scalars start after step %d)",
            ", ".join(names),
            len(rows),
            through_step,
            through_step,
        )

    def _save(self) -> None:
        state = {name: t.state for name, t in self._trackers.items() if t.state}
        if state:
            write_file(self.run_dir / TRACKERS_FILE, json_text(state, indent=2))

    def log(self, row: dict[str, Any], layers: list[dict[str, Any]] | None = None) -> None:
        """A metrics row and the telemetry.csv rows of the same step (`layers`, telemetry.moe), at once:
        a tracker that skips the steps it already holds skips both."""
        if not self._trackers:
            return
        values = {tracker_name(k, self.sections): v for k, v in scalars(row).items()}
        for tracker in self._trackers.values():
            tracker.log(values, int(row["step"]), layers or [])
        if "wandb" in self._trackers:
            self._save()  # W&B's high-water mark: a resume logs only the steps after it

    def close(self, status: str = "FINISHED") -> None:
        for name, tracker in self._trackers.items():
            try:
                tracker.close() if name == "tensorboard" else tracker.close(status)
            except Exception as e:  # a tracker must not turn a finished run into a failed one
                log.warning("tracker %s did not close cleanly: %s", name, e)
        self._trackers = {}

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        from trmoe.run.signals import Preempted

        if exc_type is None:
            self.close("FINISHED")
        else:  # a preempted run is resumed into the same tracker run (RUNNING again)
            self.close("KILLED" if issubclass(exc_type, Preempted | KeyboardInterrupt) else "FAILED")
