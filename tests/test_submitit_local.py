"""hydra/launcher=submitit_local with tasks_per_node=2 (two gloo ranks per job): a 2-job sweep whose jobs
reach their time limit mid-run, are requeued by submitit and resume in their own directories to the result
of an uninterrupted run.

The timeout is submitit's own: the local executor's controller sends SIGUSR2 to every task of a job
`timeout_min` minus 30 s after it started them (the signal delay of the local executor is fixed at 30 s, and
`timeout_min` is a whole number of minutes, so the earliest signal comes 30 s in) and reruns the job when a
task exits with code 144. A tiny run takes less than 30 s, so the test freezes the job's tasks (SIGSTOP) once
training has started, waits until the controller's SIGUSR2 is pending on them, and lets them go on (SIGCONT):
the signal then lands mid-run on every machine, however fast. The wait is idle; the uninterrupted reference
run trains meanwhile."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import TIMING_COLUMNS, descendants, finish, metrics_rows, wait_until
from presets import TINY_RUN

from trmoe.run.checkpoint import load_checkpoint
from trmoe.runtime import distributed

STEPS = 150
TINY = [
    *TINY_RUN,
    "hardware=cpu",
    "hardware.threads=1",  # the same thread count in every process: CPU results are then bit-identical
    f"trainer.steps={STEPS}",
    "checkpoint.every_steps=0",  # no periodic checkpoints: only the stop signal saves mid-run
    "hydra/launcher=submitit_local",
    "hydra.launcher.tasks_per_node=2",
    "hydra.launcher.timeout_min=1",  # SIGUSR2 at 60 - 30 s; the job is killed at 60 s
]
ROUTINGS = "routing=modulo_cyclic,multi_hash"
USR2_BIT = 1 << (signal.SIGUSR2 - 1)


def _sweep(sweep_dir: Path, *overrides: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "trmoe.train", "--multirun", *TINY, f"hydra.sweep.dir={sweep_dir}"]
    cmd += overrides
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _tasks_of(proc: subprocess.Popen, run_dir: Path) -> list[int]:
    """The submitit tasks (ranks) of the sweep job that writes run_dir: the `python -m submitit.core._submit`
    processes with a log file of that directory open (rank 0 train.log, rank r logs/rank_<r>.log)."""
    tasks = []
    for pid in descendants(proc.pid):
        try:
            if "submitit.core._submit" not in Path(f"/proc/{pid}/cmdline").read_text(errors="replace"):
                continue
            files = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if any(f.startswith(f"{run_dir}/") for f in files):
            tasks.append(pid)
    return tasks


def _pending_signals(pid: int) -> int:
    """The signals sent to the process (kill) and not delivered yet: ShdPnd in /proc/<pid>/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("ShdPnd:"):
            return int(line.split()[1], 16)
    return 0


def _freeze_when_training(proc: subprocess.Popen, jobs: list[Path]) -> list[int]:
    """SIGSTOP each job's two ranks as soon as it trains (metrics.csv has its step-1 row); their pids."""
    frozen: dict[Path, list[int]] = {}

    def freeze_the_training_ones() -> bool:
        for run_dir in jobs:
            if run_dir not in frozen and _training(run_dir):
                tasks = _tasks_of(proc, run_dir)
                assert len(tasks) == 2, (run_dir, tasks)  # two ranks
                for pid in tasks:
                    os.kill(pid, signal.SIGSTOP)
                frozen[run_dir] = tasks
        return len(frozen) == len(jobs)

    wait_until(freeze_the_training_ones, "every job training", proc)
    return [pid for tasks in frozen.values() for pid in tasks]


def _training(run_dir: Path) -> bool:
    metrics = run_dir / "metrics.csv"
    return metrics.is_file() and metrics.read_text().count("\n") >= 3  # header, step 0, step 1


@pytest.mark.parametrize("inherited", [False, True])
def test_ranks_of_a_submitit_local_task(monkeypatch, inherited):
    """A task of a 2-task submitit_local job is rank SUBMITIT_LOCAL_GLOBALID of 2, and stays a submitit rank
    after its ranks are exported as the env:// (torchrun) variables — also when the job inherited stale
    torchrun variables from the shell that submitted it (sbatch and the local executor pass them on)."""
    saved = dict(os.environ)
    monkeypatch.setattr(distributed, "_exported_by_submitit", False)
    try:
        for key in (*distributed.TORCHRUN_VARS, "MASTER_PORT", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
            os.environ.pop(key, None)
        if inherited:
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="localhost")
        os.environ.update(
            SUBMITIT_EXECUTOR="local",
            SUBMITIT_LOCAL_JOB_ID="4242",
            SUBMITIT_LOCAL_NTASKS="2",
            SUBMITIT_LOCAL_JOB_NUM_NODES="1",
            SUBMITIT_LOCAL_NODEID="0",
            SUBMITIT_LOCAL_GLOBALID="1",
            SUBMITIT_LOCAL_LOCALID="1",
        )
        first = distributed.detect()
        assert (first.rank, first.world_size, first.local_rank, first.source) == (1, 2, 1, "submitit")
        assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("1", "2")  # for init_process_group
        assert distributed.detect() == first  # the exported variables do not turn it into a torchrun rank
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.mark.subprocess
@pytest.mark.slow
def test_timeout_requeues_both_ranks_and_resumes(tmp_path):
    sweep_dir = tmp_path / "sweep"
    jobs = [sweep_dir / "0", sweep_dir / "1"]
    sweep = _sweep(sweep_dir, ROUTINGS)
    reference = None
    try:
        # each job's ranks are frozen as soon as they train, before the controller's 30 s mark, which then
        # comes while they are frozen; the reference starts after that, so that start-ups do not pile up
        tasks = _freeze_when_training(sweep, jobs)
        reference = _sweep(tmp_path / "reference", ROUTINGS, "hydra.launcher.timeout_min=10")
        # submitit's controller sends SIGUSR2 to every task of a job at its time limit
        wait_until(
            lambda: all(_pending_signals(pid) & USR2_BIT for pid in tasks), "the timeout signal", sweep
        )
        for pid in tasks:
            os.kill(pid, signal.SIGCONT)
        out = finish(sweep, 240)
        finish(reference, 240)
    finally:
        for p in (sweep, reference):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()

    for job in ("0", "1"):
        run_dir, ref_dir = sweep_dir / job, tmp_path / "reference" / job
        record = json.loads((run_dir / "run_config.json").read_text())
        assert record["world_size"] == 2
        assert (run_dir / "logs" / "rank_1.log").is_file()
        log = (run_dir / "train.log").read_text()
        # both ranks stopped after one step and saved it, and the requeued job resumed from exactly there
        resumes = record["resumes"]
        assert resumes and resumes[0]["mode"] == "resume", (job, resumes)
        stop = resumes[0]["from_step"]
        assert 1 <= stop < STEPS
        assert f"stopped at step {stop} on SIGUSR2" in log, log[-3000:]
        assert f"stopped at step {stop} on SIGUSR2" in (run_dir / "logs" / "rank_1.log").read_text()
        assert f"=== resume from step {stop} " in log
        assert json.loads((run_dir / "status.json").read_text())["status"] == "finished"
        # the result of the uninterrupted run, bit for bit (one thread per rank, the same two ranks)
        rows, ref_rows = metrics_rows(run_dir), metrics_rows(ref_dir)
        assert [r["step"] for r in rows] == [r["step"] for r in ref_rows]
        for row, ref in zip(rows, ref_rows, strict=True):
            assert {k: v for k, v in row.items() if k not in TIMING_COLUMNS} == {
                k: v for k, v in ref.items() if k not in TIMING_COLUMNS
            }, row["step"]
        state, ref_state = load_checkpoint(run_dir), load_checkpoint(ref_dir)
        assert state["step"] == STEPS
        for key, value in ref_state["model"].items():
            assert torch.equal(state["model"][key], value), (job, key)
    # submitit's side: rank 0 of each job pickled the job again and requeued it; rank 1 left that to it
    submitted = [d for d in (sweep_dir / ".submitit").iterdir() if d.name.isdigit()]
    assert len(submitted) == 2, out[-3000:]
    for d in submitted:
        rank0 = "".join(p.read_text() for p in d.glob("*_0_log.*"))
        rank1 = "".join(p.read_text() for p in d.glob("*_1_log.*"))
        assert "this job is timed-out" in rank0 and "Requeued job" in rank0, rank0[-3000:]
        assert "this job is timed-out" in rank1 and "Requeued job" not in rank1, rank1[-3000:]
    assert (
        metrics_rows(sweep_dir / "0")[-1]["eval_loss"] != metrics_rows(sweep_dir / "1")[-1]["eval_loss"]
    )  # two configs
