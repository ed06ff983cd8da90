"""A real single-node SLURM (tests/slurm/setup.sh: Debian's slurmctld, slurmd, slurm-client, munge, as root):
a 2-job x 2-task sweep through hydra/launcher=submitit_slurm (hardware=slurm_local_test), and beside it a
job that `scontrol requeue` interrupts: its ranks save on SLURM's SIGTERM, and it resumes in the same
directory from that step to the same final loss."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import finish, metrics_rows, wait_until
from presets import TINY_RUN

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
SETUP = ROOT / "tests" / "slurm" / "setup.sh"
STEPS = 200
TINY = [
    *TINY_RUN,
    f"trainer.steps={STEPS}",
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


def _squeue(env, job: str, fmt: str) -> str:
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", fmt], env=env, capture_output=True, text=True)
    return out.stdout.strip()


@pytest.mark.subprocess
def test_sweep_and_requeue_on_a_real_slurm(slurm, tmp_path):
    # The sweep, and beside it (the node has room for both) a third job with job 0's config that
    # `scontrol requeue` interrupts once it trains. It has no periodic checkpoints: it can only resume from
    # the one its ranks save on SLURM's SIGTERM, in the same directory.
    sweep = _sweep(slurm, tmp_path / "sweep", "routing=modulo_cyclic,multi_hash")
    run = tmp_path / "requeued" / "0"
    proc = _sweep(slurm, tmp_path / "requeued", "routing=modulo_cyclic", "checkpoint.every_steps=0")
    metrics = run / "metrics.csv"
    wait_until(
        lambda: metrics.is_file() and metrics.read_text().count("\n") >= 3, "training (step 1)", proc, 200
    )
    job = next(d.name for d in (run.parent / ".submitit").iterdir() if re.fullmatch(r"\d+(_\d+)?", d.name))
    subprocess.run(["scontrol", "requeue", job], env=slurm, check=True)
    # Once its ranks have ended, the requeued job is pending with a BeginTime (AuthInfo cred_expire + 1 s
    # later; tests/slurm/setup.sh sets 10 s); then let it start at once. On a loaded machine the ranks' save
    # can outlast that delay, and the job is pending for another reason or already running again.
    train_log = run / "train.log"

    def requeued() -> bool:
        pending = _squeue(slurm, job, "%T").startswith("PENDING")
        return pending or "=== resume from step" in train_log.read_text()

    wait_until(requeued, "the requeued job pending", proc, 200)
    if _squeue(slurm, job, "%T %r") == "PENDING BeginTime":
        subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], env=slurm, check=False)
    finish(sweep, 300)
    finish(proc, 300)

    for name in ("0", "1"):
        d = tmp_path / "sweep" / name
        rows = metrics_rows(d)
        assert int(rows[-1]["step"]) == STEPS, name
        assert (d / "logs" / "rank_1.log").is_file()  # two ranks (tasks) in one job directory
        assert '"world_size": 2' in (d / "run_config.json").read_text()
    assert (
        metrics_rows(tmp_path / "sweep" / "0")[-1] != metrics_rows(tmp_path / "sweep" / "1")[-1]
    )  # two configs

    log = (run / "train.log").read_text()
    stopped = re.search(r"stopped at step (\d+) on SIGTERM; checkpoint saved", log)
    assert stopped, log[-3000:]  # SLURM's SIGTERM reached the ranks, and rank 0 saved that step
    assert f"=== resume from step {stopped[1]} " in log, log[-3000:]
    expected = metrics_rows(tmp_path / "sweep" / "0")[-1]
    final = metrics_rows(run)[-1]
    assert int(final["step"]) == STEPS
    assert float(final["eval_loss"]) == pytest.approx(float(expected["eval_loss"]), rel=1e-6)
    assert float(final["train_loss"]) == pytest.approx(float(expected["train_loss"]), rel=1e-6)
