"""A real single-node SLURM (tests/slurm/setup.sh: Debian's slurmctld, slurmd, slurm-client, munge, as root):
a 2-job x 2-task sweep through hydra/launcher=submitit_slurm (hardware=slurm_local_test), then a job that
`scontrol requeue` interrupts and that resumes in the same directory to the same final loss."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
SETUP = ROOT / "tests" / "slurm" / "setup.sh"
STEPS = 200
TINY = [
    "data=random",
    "model.vocab_size=512",
    "trainer.micro_batch=2",
    "trainer.seq_len=32",
    "optimizer.lr=3e-3",
    "optimizer.warmup_steps=2",
    "trainer.eval_batches=1",
    "run.progress=log",
    f"trainer.steps={STEPS}",
    "trainer.log_every=10",
    "checkpoint.every_steps=20",
    "hardware=slurm_local_test",
]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    state = tmp_path_factory.mktemp("slurm")
    out = subprocess.run(
        ["bash", str(SETUP), "start", str(state)], capture_output=True, text=True, timeout=400
    )
    if out.returncode == 3:  # the packages cannot be installed here: say so, never pass silently
        print(f"SKIP reason: {out.stderr.strip()}")
        pytest.skip(out.stderr.strip())
    assert out.returncode == 0, out.stdout + out.stderr
    env = {**os.environ, "SLURM_CONF": str(state / "slurm.conf"), "PYTHONUNBUFFERED": "1"}
    try:
        yield env
    finally:
        subprocess.run(["bash", str(SETUP), "stop", str(state)], timeout=60)


def _sweep(env, sweep_dir: Path, *overrides: str) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "trmoe.train",
        "--multirun",
        *TINY,
        f"hydra.sweep.dir={sweep_dir}",
        *overrides,
    ]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    return out


def _rows(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.csv") as f:
        return list(csv.DictReader(f))


def test_sweep_and_requeue_on_a_real_slurm(slurm, tmp_path):
    sweep = _sweep(slurm, tmp_path / "sweep", "routing=modulo_cyclic,multi_hash")
    _finish(sweep)
    for job in ("0", "1"):
        d = tmp_path / "sweep" / job
        rows = _rows(d)
        assert int(rows[-1]["step"]) == STEPS, job
        assert (d / "logs" / "rank_1.log").is_file()  # two ranks (tasks) in one job directory
        assert '"world_size": 2' in (d / "run_config.json").read_text()
    assert _rows(tmp_path / "sweep" / "0")[-1] != _rows(tmp_path / "sweep" / "1")[-1]  # two configs

    # The same config as job 0, requeued once it has a checkpoint: it resumes in the same directory.
    run = tmp_path / "requeued" / "0"
    proc = _sweep(slurm, tmp_path / "requeued", "routing=modulo_cyclic")
    deadline = time.time() + 200
    while not (run / "checkpoints" / "step_00000020").is_dir():
        assert time.time() < deadline and proc.poll() is None, "the job never reached its first checkpoint"
        time.sleep(0.1)
    job = subprocess.run(
        ["squeue", "-h", "-o", "%i"], env=slurm, capture_output=True, text=True
    ).stdout.split()
    assert job, "no job in the queue"
    subprocess.run(["scontrol", "requeue", job[0]], env=slurm, check=True)
    # a requeued job waits (BeginTime) before it may start again: let it start now
    for _ in range(100):
        if (
            subprocess.run(["scontrol", "update", f"jobid={job[0]}", "StartTime=now"], env=slurm).returncode
            == 0
        ):
            break
        time.sleep(0.2)
    _finish(proc)
    log = (run / "train.log").read_text()
    assert "=== resume from step" in log, log[-3000:]
    expected = _rows(tmp_path / "sweep" / "0")[-1]
    final = _rows(run)[-1]
    assert int(final["step"]) == STEPS
    assert float(final["eval_loss"]) == pytest.approx(float(expected["eval_loss"]), rel=1e-6)
    assert float(final["train_loss"]) == pytest.approx(float(expected["train_loss"]), rel=1e-6)
