"""Resume you can trust (docs/reliability.md): kill -9 anywhere -> bit-exact resume; SIGUSR2/SIGTERM -> a
clean save and the requeue exit status; the resume config check; run directories never overwritten.

The killed runs go through the real app in subprocesses (tests/resume_driver.py = `python -m trmoe.train`
plus one deterministic fault such as SIGKILL half-way through a checkpoint write); they run concurrently,
and each is resumed in-process and compared with one uninterrupted baseline: final weights, optimizer
state and every metrics.csv column but the measured ones (helpers.TIMING_COLUMNS) must be identical."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers import assert_latest_sane, assert_same_run, descendants, drive, metrics_rows, train_in_process
from presets import RESUME_BASE, RESUME_SMALL

from trmoe.run.checkpoint import load_checkpoint, read_pointer

# (fault injected by tests/resume_driver.py, what the rerun must do: "restart" or the checkpoint step)
KILLS = [
    ("step:1:forward", "restart"),  # before any checkpoint: the same run starts again from step 0
    ("step:3:after", "restart"),
    ("save:4:payload", "restart"),  # the first checkpoint half-written
    ("step:6:forward", 4),
    ("step:10:after", 8),  # rows 9 and 10 of the killed attempt are dropped and rewritten
    ("save:8:rank", 4),
    ("save:8:meta", 4),  # meta.json written, directory not renamed: not a checkpoint
    ("save:12:rename", 12),  # complete but `latest` not updated yet: still the newest checkpoint
    ("save:12:pointer", 12),
    ("save:16:prune", 16),  # killed while deleting step 8
    ("eval:15", 12),
    ("step:20:forward", 16),
    ("save:20:payload", 16),  # the final checkpoint half-written
]
SIGNALS = [("signal:7:USR2", signal.SIGUSR2, 7), ("signal:9:TERM", signal.SIGTERM, 9)]


def _drive(fault: str, cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    return drive(fault, cwd, *RESUME_BASE, *overrides)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("baseline") / "r"
    train_in_process(run_dir)
    return run_dir


@pytest.fixture(scope="module")
def faulted(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """Every driver run of this module, concurrently (each a child forked by helpers.drive)."""
    root = tmp_path_factory.mktemp("faults")
    jobs = [(fault, ()) for fault, _ in KILLS] + [(fault, ()) for fault, _, _ in SIGNALS]
    jobs.append(("nan:5:100", ("guard.max_skips=3",)))

    def run(job):
        fault, extra = job
        cwd = root / fault.replace(":", "_")
        return fault, (_drive(fault, cwd, *extra), cwd / "runs" / "r")

    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(pool.map(run, jobs))


@pytest.mark.parametrize("fault,expected", KILLS, ids=[k for k, _ in KILLS])
def test_kill_9_anywhere_then_resume_is_bit_exact(fault, expected, faulted, baseline):
    proc, run_dir = faulted[fault]
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert_latest_sane(run_dir)
    before = (run_dir / "train.log").read_text()
    train_in_process(run_dir)
    log = (run_dir / "train.log").read_text()[len(before) :]
    if expected == "restart":
        assert "=== restart from step 0" in log
    else:
        assert f"=== resume from step {expected} " in log
    assert_same_run(run_dir, baseline)
    assert_latest_sane(run_dir)
    rc = json.loads((run_dir / "run_config.json").read_text())
    assert [r["mode"] for r in rc["resumes"]] == ["restart" if expected == "restart" else "resume"]
    assert rc["force_resumed"] is False


@pytest.mark.parametrize("fault,signum,step", SIGNALS, ids=[s for s, _, _ in SIGNALS])
def test_stop_signal_saves_at_the_step_boundary_and_exits_for_requeue(fault, signum, step, faulted, baseline):
    proc, run_dir = faulted[fault]
    assert proc.returncode == 128 + signum, proc.stderr[-3000:]
    assert f"stopped at step {step} on {signal.Signals(signum).name}" in proc.stderr
    assert read_pointer(run_dir / "checkpoints") == f"step_{step:08d}"
    assert_latest_sane(run_dir)
    assert json.loads((run_dir / "status.json").read_text())["status"] == "preempted"
    assert int(metrics_rows(run_dir)[-1]["step"]) <= step
    train_in_process(run_dir)
    assert_same_run(run_dir, baseline)


def test_nonfinite_steps_stop_the_run_with_exit_3_and_a_good_checkpoint(faulted):
    """NaN from step 5 on: steps 5, 6, 7 are skipped, then guard.max_skips=3 stops the run (exit 3) with a
    checkpoint at step 7 whose weights and optimizer state are those after step 4."""
    proc, run_dir = faulted["nan:5:100"]
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "stopped at step 7: 3 consecutive steps had a non-finite loss" in proc.stderr
    last = load_checkpoint(run_dir)
    assert last["step"] == 7
    assert metrics_rows(run_dir)[-1]["step"] == "7" and metrics_rows(run_dir)[-1]["skipped_steps"] == "3"
    good = load_checkpoint(run_dir / "checkpoints" / "step_00000004")
    for key in good["model"]:
        assert torch.equal(last["model"][key], good["model"][key]), key
    for index, state in good["optimizer"]["state"].items():
        for name, value in state.items():
            assert torch.equal(last["optimizer"]["state"][index][name], value)


@pytest.mark.subprocess
def test_kill_9_twice_then_resume_is_bit_exact(tmp_path, baseline):
    first = _drive("step:6:forward", tmp_path)
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    second = _drive("save:12:meta", tmp_path)  # the resumed attempt dies too, inside a checkpoint write
    assert second.returncode == -signal.SIGKILL, second.stderr[-3000:]
    run_dir = tmp_path / "runs" / "r"
    assert_latest_sane(run_dir)
    train_in_process(run_dir)
    assert_same_run(run_dir, baseline)
    rc = json.loads((run_dir / "run_config.json").read_text())
    assert [r["from_step"] for r in rc["resumes"]] == [4, 8]


@pytest.fixture(scope="module")
def baseline_every_row(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("baseline_every_row") / "r"
    train_in_process(run_dir, "trainer.log_every=1")
    return run_dir


def _wait_formetrics_rows(metrics_glob, cwd: Path, rows: int, proc: subprocess.Popen) -> Path | None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        for metrics in cwd.glob(metrics_glob):
            if metrics.read_text().count("\n") >= rows + 1:  # + the header
                return metrics
        time.sleep(0.005)
    return None


@pytest.mark.subprocess
def test_kill_9_from_outside_at_a_random_moment(tmp_path, baseline_every_row):
    """The plain CLI killed by another process at whatever instant it has reached (not chosen)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "trmoe.train", *RESUME_BASE, "trainer.log_every=1"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_formetrics_rows("runs/r/metrics.csv", tmp_path, 9, proc)  # step 0 + 8 steps
    proc.kill()
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "finished before the kill: " + proc.stderr.read()[-2000:]
    run_dir = tmp_path / "runs" / "r"
    assert_latest_sane(run_dir)
    train_in_process(run_dir, "trainer.log_every=1")
    assert_same_run(run_dir, baseline_every_row)


@pytest.mark.subprocess
def test_submitit_requeue_resumes_the_job(tmp_path, baseline_every_row):
    """hydra-submitit-launcher (local executor, a real submitit job): SIGUSR2 to the job's process ->
    trmoe saves at the step boundary and hands the signal to submitit's handler, which pickles the job
    again and requeues it (the local executor reruns it on exit code 144, as SLURM does after
    `scontrol requeue`); the rerun resumes from the checkpoint. One job directory, every step once, and
    the result of the uninterrupted run."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    args = [
        *RESUME_BASE,
        "trainer.log_every=1",
        "checkpoint.every_steps=1000",
    ]  # only the signal saves mid-run
    proc = subprocess.Popen(
        [sys.executable, "-m", "trmoe.train", "--multirun", "hydra/launcher=submitit_local", *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        metrics = _wait_formetrics_rows("multirun/*/*/0/metrics.csv", tmp_path, 6, proc)
        assert metrics is not None, proc.communicate()[0][-3000:]
        jobs = [
            pid
            for pid in descendants(proc.pid)
            if "submitit.core._submit" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
        ]
        assert len(jobs) == 1, jobs
        # the last step logged before the signal: the job saves at a step boundary at or after it (not "a
        # step later": under load the job can still be between that step's row and its stop check)
        written = metrics.read_text()
        seen = int(written[: written.rindex("\n")].splitlines()[-1].split(",", 1)[0])  # its last whole row
        os.kill(jobs[0], signal.SIGUSR2)
        output = proc.communicate(timeout=300)[0]
    finally:
        proc.kill()
    assert proc.returncode == 0, output[-3000:]
    job_dirs = [p.parent for p in tmp_path.glob("multirun/*/*/*/run_config.json")]
    assert job_dirs == [metrics.parent]  # the requeued job found its own directory again
    run_dir = metrics.parent
    logs = "".join(p.read_text() for p in (run_dir.parent / ".submitit").rglob("*_log.*"))
    assert "Requeued job" in logs and "Caught signal SIGUSR2" in logs
    rc = json.loads((run_dir / "run_config.json").read_text())
    assert [r["mode"] for r in rc["resumes"]] == ["resume"]
    saved = rc["resumes"][0]["from_step"]
    assert 5 <= seen <= saved < 20, (seen, saved)  # mid-run, no earlier than the signal
    assert f"stopped at step {saved} on SIGUSR2" in logs  # the signal's save is the one resumed from
    assert json.loads((run_dir / "status.json").read_text())["status"] == "finished"
    assert_same_run(run_dir, baseline_every_row)


# ------------------------------------------------------------------- windows across a resume


def test_resume_between_log_steps_keeps_the_telemetry_window(tmp_path):
    """The checkpoint at step 2 falls inside the window logged at step 3: its telemetry counters travel
    with the checkpoint, so the resumed run writes the uninterrupted run's telemetry, row for row."""
    import shutil

    overrides = ["checkpoint.every_steps=2", "checkpoint.keep_last=0", "telemetry.moe=true"]
    overrides += ["trainer.steps=6", "trainer.log_every=3", "trainer.eval_every=0"]  # rows at 1, 3, 6
    whole = tmp_path / "whole"
    train_in_process(whole, *overrides)
    run_dir = tmp_path / "resumed"
    shutil.copytree(whole, run_dir)
    for step in (4, 6):
        shutil.rmtree(run_dir / "checkpoints" / f"step_0000000{step}")
    (run_dir / "checkpoints" / "latest").write_text("step_00000002\n")
    train_in_process(run_dir, *overrides)
    assert "=== resume from step 2" in (run_dir / "train.log").read_text()
    assert (run_dir / "telemetry.csv").read_text() == (whole / "telemetry.csv").read_text()
    columns = ("expert_imbalance", "expert_dead", "shared_rms", "routed_rms", "train_loss")
    assert [[r[c] for c in columns] for r in metrics_rows(run_dir)] == [
        [r[c] for c in columns] for r in metrics_rows(whole)
    ]


def test_telemetry_csv_continues_on_resume(tmp_path):
    """telemetry.csv (telemetry.moe) is trimmed to the checkpoint's step and appended to, like metrics.csv:
    earlier rows are kept byte for byte and no step appears twice."""
    import shutil

    full, run_dir = tmp_path / "full", tmp_path / "r"
    train_in_process(full, *RESUME_SMALL, "telemetry.moe=true")
    shutil.copytree(full, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step_00000004")  # as if killed before step 4 was saved
    (run_dir / "telemetry.csv").write_text((run_dir / "telemetry.csv").read_text() + "4,0,12")  # cut short
    train_in_process(run_dir, *RESUME_SMALL, "telemetry.moe=true")

    def lines(path):
        return (path / "telemetry.csv").read_text().splitlines()

    def keys(path):
        return [tuple(line.split(",")[:2]) for line in lines(path)]

    assert keys(run_dir) == keys(full)
    early = [line for line in lines(full) if line.split(",")[0] in ("step", "1", "2")]
    assert early == [line for line in lines(run_dir) if line.split(",")[0] in ("step", "1", "2")]


@pytest.mark.subprocess
def test_a_stop_in_a_step_too_long_for_the_bound_drops_it_and_keeps_the_last_checkpoint(tmp_path):
    """A real SIGTERM in step 6 of 8 micro-batches, with trainer.stop_within so short that finishing the step
    would overrun it: the run ends at the next micro-batch boundary without a checkpoint, exit 143, saying
    the checkpoint it keeps (step 4); status.json says preempted at step 5; a rerun resumes from step 4 and
    ends as the uninterrupted run."""
    accum = ("trainer.grad_accum=8", "trainer.micro_batch=1")
    baseline = tmp_path / "baseline" / "r"
    train_in_process(baseline, *accum)
    stopped = _drive("signal:6:TERM", tmp_path / "stopped", *accum, "trainer.stop_within=0.001")
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-2000:]
    assert "SIGTERM received: stopping within 0.001 s" in stopped.stderr
    said = "step 6 would have ended past half of trainer.stop_within=0.001 s, so it was dropped without a "
    kept = "checkpoint; kept: the checkpoint of step 4, which a rerun resumes (step 5 is trained again)"
    assert said + kept in stopped.stderr
    run_dir = tmp_path / "stopped" / "runs" / "r"
    checkpoints = [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_")]
    assert checkpoints == ["step_00000004"]
    recorded = json.loads((run_dir / "status.json").read_text())
    assert recorded["status"] == "preempted" and recorded["step"] == 5
    assert_latest_sane(run_dir)
    train_in_process(run_dir, *accum)
    assert_same_run(run_dir, baseline)
