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
from pathlib import Path

import pytest
from helpers import TIMING_COLUMNS, cli, compose_config, drive
from presets import TINY_RUN

from trmoe.config.resolve import to_config
from trmoe.errors import UserError
from trmoe.train.observe import trackers

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
    """telemetry.csv as {telemetry/layer_<i>/<column>: {step: value}} over its finite values."""
    with open(run_dir / "telemetry.csv") as f:
        rows = list(csv.DictReader(f))
    keys = [(int(r["layer"]), int(r["step"])) for r in rows]
    assert len(keys) == len(set(keys)), keys
    series: dict[str, dict[int, float]] = {}
    for row in rows:
        for key, text in row.items():
            if key not in ("step", "layer") and text and math.isfinite(float(text)):
                series.setdefault(f"telemetry/layer_{row['layer']}/{key}", {})[int(row["step"])] = float(text)
    return series


def _tensorboard(log_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "histograms": 0})  # every event
    acc.Reload()
    return acc


def _tensorboard_series(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = _tensorboard(log_dir)
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


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
    assert sorted(layers["telemetry/layer_1/imbalance"]) == list(range(1, 9))
    assert {f"telemetry/layer_{i}/{c}" for i in (0, 1) for c in ("share_3", "dead", "grad_norm_0")} <= set(
        layers
    )

    # TensorBoard: what the killed attempt logged past the checkpoint is purged by the reader
    tb = _tensorboard_series(run_dir / "tensorboard")
    assert set(tb) == set(expected) | set(layers)
    for tag, points in tb.items():
        steps = [s for s, _ in points]
        want = expected[tag] if tag in expected else layers[tag]
        assert steps == sorted(want), (tag, steps)
        for step, value in points:
            assert value == pytest.approx(want[step], rel=1e-6, abs=1e-12), (tag, step)
    acc = _tensorboard(run_dir / "tensorboard")  # each layer's expert shares as a histogram too
    assert {t for t in acc.Tags()["histograms"]} == {"telemetry/layer_0/shares", "telemetry/layer_1/shares"}
    for layer in (0, 1):
        events = acc.Histograms(f"telemetry/layer_{layer}/shares")
        assert [e.step for e in events] == list(range(1, 9))
        for e in events:
            shares = [layers[f"telemetry/layer_{layer}/share_{x}"][e.step] for x in range(4)]
            h = e.histogram_value
            assert (h.num, h.min, h.max) == (4, pytest.approx(min(shares)), pytest.approx(max(shares)))
            assert h.sum == pytest.approx(1.0)

    # MLflow's file store beside the run directory: one run (the same id after the resume), its history
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # as trmoe sets it for its default store
    client = MlflowClient(tracking_uri=(tmp_path / "runs" / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("trmoe")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.run_id == json.loads((run_dir / "trackers.json").read_text())["mlflow"]["run_id"]
    assert run.info.run_name == "r" and run.info.status == "FINISHED"
    assert run.data.params["optimizer.lr"] == "0.003" and run.data.params["model.name"] == "tiny"
    assert run.data.tags["trmoe.run_dir"] == str(run_dir.resolve())
    telemetry = {k.replace("/", "."): v for k, v in layers.items()}  # telemetry.layer_<i>.<column>
    assert set(client.get_run(run.info.run_id).data.metrics) == set(expected) | set(telemetry)
    for key, values in (expected | telemetry).items():
        history = client.get_metric_history(run.info.run_id, key)
        steps = [m.step for m in history]
        assert steps == sorted(values), (key, steps)  # no step twice
        # the re-logged steps as the killed attempt logged them: a CPU rerun recomputes them bit for bit
        timing = key in TIMING_COLUMNS
        for m in history:
            if not timing or m.step not in relogged:
                assert m.value == pytest.approx(values[m.step], rel=1e-8, abs=1e-12), (key, m.step)  # %.9g


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
    for key in (b"train_loss", b"telemetry/layer_0/imbalance", b"telemetry/layer_1/share_3"):
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
