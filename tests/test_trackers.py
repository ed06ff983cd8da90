"""The `logger` group: TensorBoard and MLflow get the rows of metrics.csv and, with telemetry.moe=true, the
per-layer rows of telemetry.csv, read back with each library's own reader, across a kill (SIGKILL from
outside the code, tests/resume_driver.py) and the resume that follows: one tracker run, the same values, no
step twice. W&B offline: its run directory and id (what can be checked
without the service)."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import TIMING_COLUMNS, cli, compose_config, drive
from presets import TINY_RUN

from trmoe.config.resolve import to_config
from trmoe.errors import UserError
from trmoe.run import trackers
from trmoe.run.columns import sections
from trmoe.run.rundir import RunDir
from trmoe.train.producers import columns_documented

SECTIONS = sections(columns_documented())  # metrics.csv column -> tracker scalar

RUN = [
    *TINY_RUN,
    "hardware=cpu",
    "hardware.threads=1",
    "run.name=r",
    "trainer.steps=8",
    "trainer.log_every=1",
    "trainer.eval_every=4",
    "checkpoint.every_steps=4",
]


def _drive(fault: str, cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    return drive(fault, cwd, *RUN, *overrides, timeout=600)


def _csv_series(run_dir: Path) -> dict[str, dict[int, float]]:
    """metrics.csv as {column: {step: value}} over its finite values."""
    with open(run_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    steps = [int(r["step"]) for r in rows]
    assert len(steps) == len(set(steps)), steps
    series: dict[str, dict[int, float]] = {}
    for row in rows:
        for key, text in row.items():
            if key != "step" and math.isfinite(float(text)):
                series.setdefault(key, {})[int(row["step"])] = float(text)
    return series


def _telemetry_series(run_dir: Path) -> dict[str, dict[int, float]]:
    """telemetry.csv as {moe/layer_<i>/<column>: {step: value}} over its finite values."""
    with open(run_dir / "telemetry.csv") as f:
        rows = list(csv.DictReader(f))
    keys = [(int(r["layer"]), int(r["step"])) for r in rows]
    assert len(keys) == len(set(keys)), keys
    series: dict[str, dict[int, float]] = {}
    for row in rows:
        for key, text in row.items():
            if key not in ("step", "layer") and text and math.isfinite(float(text)):
                series.setdefault(f"moe/layer_{row['layer']}/{key}", {})[int(row["step"])] = float(text)
    return series


def _tensorboard(log_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "histograms": 0})  # every event
    acc.Reload()
    return acc


def _tensorboard_series(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = _tensorboard(log_dir)
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


_READ_MLFLOW = """
import json, sys
from mlflow.tracking import MlflowClient
client = MlflowClient(tracking_uri=sys.argv[1])
out = []
for run in client.search_runs([client.get_experiment_by_name("trmoe").experiment_id]):
    history = {k: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)]
               for k in run.data.metrics}
    out.append({"run_id": run.info.run_id, "name": run.info.run_name, "status": run.info.status,
                "params": run.data.params, "tags": run.data.tags, "history": history})
print(json.dumps(out))
"""


def _read_store(script: str, runs: Path, cwd: Path):
    """What `script` prints (JSON) reading <runs>/mlflow.db with MLflow's own client, in a process that never
    set MLFLOW_ALLOW_FILE_STORE (as a user's script or `mlflow ui` would)."""
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_ALLOW_FILE_STORE"}
    read = subprocess.run(
        [sys.executable, "-c", script, f"sqlite:///{runs / 'mlflow.db'}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )
    assert read.returncode == 0, read.stderr[-3000:]
    return json.loads(read.stdout)


# (the kill, the steps the killed attempt logged that the rerun logs again, what the rerun says)
KILLS = [
    ("step:6:after", {5, 6}, "resumed at step 4"),  # after the checkpoint of step 4
    ("step:3:after", {0, 1, 2, 3}, "=== restart from step 0"),  # before any checkpoint: from the start
]


@pytest.mark.subprocess
@pytest.mark.parametrize("fault,relogged,says", KILLS)
def test_tensorboard_and_mlflow_match_metrics_csv_across_a_kill_and_resume(tmp_path, fault, relogged, says):
    chosen = ["logger=[tensorboard,mlflow]", "telemetry.moe=true"]
    killed = _drive(fault, tmp_path, *chosen)
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = cli([*RUN, *chosen], tmp_path)  # the rerun needs no process of its own: the app's main(argv)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    run_dir = tmp_path / "runs" / "r"
    assert says in (run_dir / "train.log").read_text()
    expected = _csv_series(run_dir)
    assert sorted(expected["train_loss"]) == list(range(1, 9))
    assert set(expected) >= {"train_loss", "eval_loss", "lr", "grad_norm", "tok_s", "mfu", "peak_mem_gib"}
    layers = _telemetry_series(run_dir)  # the tiny model: 2 layers, 4 experts
    assert sorted(layers["moe/layer_1/imbalance"]) == list(range(1, 9))
    assert {f"moe/layer_{i}/{c}" for i in (0, 1) for c in ("share_3", "dead", "grad_norm_0")} <= set(layers)
    # the trackers' names: in sections (train/loss, throughput/mfu, ...), metrics.csv's columns unchanged
    expected = {trackers.tracker_name(k, SECTIONS): v for k, v in expected.items()}
    assert {"train/loss", "eval/loss", "throughput/tok_s", "throughput/mfu", "memory/peak_gib"} <= set(
        expected
    )
    assert {"optim/lr", "optim/grad_norm"} <= set(expected)

    # TensorBoard: what the killed attempt logged past the checkpoint is purged by the reader
    tb = _tensorboard_series(run_dir)
    assert set(tb) == set(expected) | set(layers)
    for tag, points in tb.items():
        steps = [s for s, _ in points]
        want = expected[tag] if tag in expected else layers[tag]
        assert steps == sorted(want), (tag, steps)
        for step, value in points:
            assert value == pytest.approx(want[step], rel=1e-6, abs=1e-12), (tag, step)
    acc = _tensorboard(run_dir)  # each layer's expert shares as a histogram too
    assert {t for t in acc.Tags()["histograms"]} == {"moe/layer_0/shares", "moe/layer_1/shares"}
    for layer in (0, 1):
        events = acc.Histograms(f"moe/layer_{layer}/shares")
        assert [e.step for e in events] == list(range(1, 9))
        for e in events:
            shares = [layers[f"moe/layer_{layer}/share_{x}"][e.step] for x in range(4)]
            h = e.histogram_value
            assert (h.num, h.min, h.max) == (4, pytest.approx(min(shares)), pytest.approx(max(shares)))
            assert h.sum == pytest.approx(1.0)

    # MLflow's local database beside the run directories, read by MLflow's own client in a process that never
    # set MLFLOW_ALLOW_FILE_STORE (as a user's script or `mlflow ui` would): one run, its params, its history
    (run,) = _read_store(_READ_MLFLOW, tmp_path / "runs", tmp_path)
    assert run["run_id"] == json.loads((run_dir / "trackers.json").read_text())["mlflow"]["run_id"]
    assert run["name"] == "r" and run["status"] == "FINISHED"
    params = run["params"]
    assert params["optimizer.lr"] == "0.003" and params["model.name"] == "tiny"
    assert params["routing.strategy"] == "modulo_cyclic"  # plain values: runs filter by them
    assert not [v for v in params.values() if "Strategy." in v or "Source." in v]
    assert run["tags"]["trmoe.run_dir"] == str(run_dir.resolve())
    assert set(run["history"]) == set(expected) | set(layers)
    for key, values in (expected | layers).items():
        history = run["history"][key]
        steps = [step for step, _ in history]
        assert steps == sorted(values), (key, steps)  # no step twice
        # the re-logged steps as the killed attempt logged them: a CPU rerun recomputes them bit for bit
        timing = key in {trackers.tracker_name(c, SECTIONS) for c in TIMING_COLUMNS}
        for step, value in history:
            if not timing or step not in relogged:
                assert value == pytest.approx(values[step], rel=1e-8, abs=1e-12), (key, step)  # %.9g


@pytest.mark.subprocess
def test_wandb_offline_run_keeps_its_id_across_a_resume(tmp_path):
    """W&B offline writes <run dir>/wandb/offline-run-<time>-<id>/run-<id>.wandb (a protobuf record log that
    `wandb sync` uploads); offline there is no API to read the history back (wandb 0.31 has no Python reader
    of it), so this checks the run's id across attempts and that the finished attempt's record file holds
    the logged keys, per-layer telemetry included."""
    pytest.importorskip("wandb")
    env_overrides = ["logger=wandb", "logger.wandb.project=trmoe-test", "telemetry.moe=true"]
    killed = _drive("step:6:after", tmp_path, *env_overrides)
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = _drive("none", tmp_path, *env_overrides)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    run_dir = tmp_path / "runs" / "r"
    state = json.loads((run_dir / "trackers.json").read_text())["wandb"]
    assert state["last_step"] == 8
    offline = sorted((run_dir / "wandb").glob(f"offline-run-*-{state['id']}"))
    assert len(offline) == 2  # one directory per attempt, both the same W&B run id
    for attempt in offline:
        assert (attempt / f"run-{state['id']}.wandb").stat().st_size > 0
    # the resumed attempt, which finished its W&B run (the killed one's records may be lost with its process)
    records = (offline[-1] / f"run-{state['id']}.wandb").read_bytes()
    for key in (b"train/loss", b"moe/layer_0/imbalance", b"moe/layer_1/share_3"):
        assert key in records, key


def test_a_tracker_that_is_not_installed_is_one_line(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name)
    )
    cfg = to_config(compose_config("logger=[tensorboard,mlflow]"))
    with pytest.raises(
        UserError, match=r"logger=mlflow: the mlflow package is not installed.*trmoe\[trackers\]"
    ):
        trackers.check_installed(cfg.logger)


def test_logger_options_compose_alone_and_together(tmp_path):
    assert trackers.chosen(to_config(compose_config()).logger) == []  # csv: metrics.csv only
    both = to_config(compose_config("logger=[tensorboard,mlflow]")).logger
    assert trackers.chosen(both) == ["tensorboard", "mlflow"]
    assert to_config(compose_config("logger=wandb")).logger.wandb.mode.value == "offline"
    out = cli(["logger=nosuch"], tmp_path)
    assert out.returncode == 2 and "allowed: csv, mlflow, tensorboard, wandb" in out.stderr


def test_mlflow_store_is_the_local_database_unless_a_file_store_is_there(tmp_path):
    """MLflow's default store: <runs>/mlflow.db; a file store older trmoe made (<runs>/mlruns) is read on."""
    runs = tmp_path / "runs"
    assert trackers.default_store(runs / "r") == f"sqlite:///{runs.resolve() / 'mlflow.db'}"
    (runs / "mlruns").mkdir(parents=True)
    assert trackers.default_store(runs / "r") == (runs / "mlruns").resolve().as_uri()
    assert trackers.tracker_name("eval_loss/help", SECTIONS) == "eval/loss/help"
    assert trackers.tracker_name("acc_norm/piqa", SECTIONS) == "downstream/acc_norm/piqa"


def test_a_tracker_added_at_a_resume_holds_the_whole_run(small_run, tmp_path):
    """logger=tensorboard chosen only when the run is resumed (small_run: 4 steps, extended to 6): it gets
    metrics.csv's rows of steps 1-4 first (old code: steps 5-6 only, with no notice)."""
    import shutil

    from helpers import train_in_process
    from presets import RESUME_SMALL

    run_dir = tmp_path / "r"
    shutil.copytree(small_run, run_dir)
    extended = ["trainer.steps=6", "optimizer.decay_steps=4"]
    train_in_process(run_dir, *RESUME_SMALL, *extended, "logger=tensorboard")
    assert "tensorboard added at this resume: " in (run_dir / "train.log").read_text()
    expected = {trackers.tracker_name(k, SECTIONS): v for k, v in _csv_series(run_dir).items()}
    tb = _tensorboard_series(run_dir)
    assert [s for s, _ in tb["train/loss"]] == list(range(1, 7))
    for tag, points in tb.items():
        assert dict(points) == pytest.approx(expected[tag], rel=1e-6, abs=1e-12), tag


_READ_STORE = """
import json, sys, tempfile
from pathlib import Path
from mlflow.tracking import MlflowClient
client = MlflowClient(tracking_uri=sys.argv[1])
experiment = client.get_experiment_by_name("trmoe")
(run,) = client.search_runs([experiment.experiment_id])
names = sorted(a.path for a in client.list_artifacts(run.info.run_id))
names += sorted(a.path for a in client.list_artifacts(run.info.run_id, "hydra"))
folder = client.download_artifacts(run.info.run_id, "", tempfile.mkdtemp())
files = {n: (Path(folder) / n).read_text() for n in ("metrics.csv", "run_config.json", "config.yaml")}
print(json.dumps({"artifact_location": experiment.artifact_location, "run_id": run.info.run_id,
                  "artifacts": names, "files": files}))
"""


def test_mlflow_artifacts_beside_the_store_and_no_local_path_recorded(tmp_path, monkeypatch):
    """Old code: no MLflow artifacts; the experiment's artifact_location <launch folder>/mlruns; TensorBoard
    listed the run as r/tensorboard; trackers.json and TensorBoard's text summary held absolute paths.
    A run directory as training leaves it, the trackers driven directly (no training), read back by
    MLflow's client in a process of its own and TensorBoard's own multiplexer over the runs folder."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    runs, elsewhere = tmp_path / "runs", tmp_path / "launched-here"
    run_dir = runs / "r"
    (run_dir / ".hydra").mkdir(parents=True)
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    (run_dir / "run_config.json").write_text(json.dumps({"schema_version": 1, "config": {"a": 1}}))
    (run_dir / ".hydra" / "config.yaml").write_text("trainer:\n  steps: 2\n")
    (run_dir / ".hydra" / "overrides.yaml").write_text("- trainer.steps=2\n")
    (run_dir / "metrics.csv").write_text("step,tokens,train_loss\n1,64,5.5\n2,128,5.25\n")
    cfg = to_config(compose_config("logger=[tensorboard,mlflow]"))
    identity = {"run_name": "r", "run_dir": str(run_dir.resolve()), "trmoe_version": "0", "config_hash": "h"}
    config = {"trainer": {"steps": 2}, "routing": {"strategy": cfg.routing.strategy}}
    for resume_step, rows in ((None, [(1, 5.5)]), (1, [(2, 5.25)])):  # a resume goes on in the same runs
        with trackers.Trackers(
            cfg.logger, run_dir, identity=identity, config=config, resume_step=resume_step, sections=SECTIONS
        ) as t:
            for step, loss in rows:
                t.log({"step": step, "tokens": 64 * step, "train_loss": loss})

    recorded = (run_dir / "trackers.json").read_text()
    assert str(tmp_path) not in recorded and json.loads(recorded)["mlflow"]["tracking_uri"] == (
        "sqlite:///../mlflow.db"
    )
    assert not (elsewhere / "mlruns").exists() and not list(elsewhere.iterdir())

    store = _read_store(_READ_STORE, runs, tmp_path)
    assert store["run_id"] == json.loads(recorded)["mlflow"]["run_id"]  # one run across the resume
    assert store["artifact_location"] == (runs / "mlartifacts").resolve().as_uri()
    assert store["artifacts"] == [
        "config.yaml",
        "hydra",
        "metrics.csv",
        "run_config.json",
        "hydra/config.yaml",
        "hydra/overrides.yaml",
    ]
    assert store["files"]["metrics.csv"] == (run_dir / "metrics.csv").read_text()
    assert store["files"]["run_config.json"] == (run_dir / "run_config.json").read_text()
    assert "strategy: modulo_cyclic" in store["files"]["config.yaml"]  # resolved, plain values

    mux = EventMultiplexer().AddRunsFromDirectory(str(runs))
    mux.Reload()
    assert list(mux.Runs()) == ["r"]  # `tensorboard --logdir runs` lists the run by its name
    assert [e.step for e in mux.GetAccumulator("r").Scalars("train/loss")] == [1, 2]
    (text,) = mux.GetAccumulator("r").Tensors("run/text_summary")
    summary = text.tensor_proto.string_val[0].decode()
    assert "**run_name**: r" in summary and str(tmp_path) not in summary
    events = RunDir(run_dir).tensorboard_events()  # the run's own files: run.overwrite=true removes them
    assert events and set(events) <= set(RunDir(run_dir).removable()[0])
    assert {e.name for e in events} <= set(RunDir(run_dir).held())
