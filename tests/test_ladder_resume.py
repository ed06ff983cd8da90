"""A ladder resumed anywhere: a real SIGKILL at each phase of a ladder sweep (in a stable run, between
branches, at each point of a branch's start-up, at a branch's first checkpoint), then the same sweep command
again (same hydra.sweep.dir) ends with the final weights, optimizer state and metrics of an uninterrupted
ladder, bit for bit on the CPU; a moved sweep reruns and reports, its branches' parents recorded relative
to it (docs/scaling.md, "How Hydra drives it")."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_same_run, cli, drive, make_shard

from trmoe.report.build import REPORT_CSV, REPORT_MD

pytestmark = pytest.mark.subprocess  # a real SIGKILL of a real child

VOCAB = 128

# 2 rungs x 1 arm: 2 jobs, each a stable run of 16 steps (checkpoints at the branch points 8 and 16) and two
# branches, 8 -> 10 and 16 -> 20 steps of 64 tokens. The runs, in the order one job process trains them:
# 0 job 0's stable run, 1 its branch -d640, 2 its branch -d1280, 3 job 1's stable run, 4, 5 its branches.
LADDER = [
    "experiment=ladder_smoke",
    "ladder.name=resume",
    "ladder.hidden=[16,24]",
    "ladder.rung=0,1",
    "arm=hash_vs_learned/modulo_cyclic",
    "ladder.head_dim=8",
    "ladder.kv_group=1",
    "ladder.aspect=16",
    "ladder.min_layers=1",
    "ladder.tokens=[640,1280]",
    f"model.vocab_size={VOCAB}",
    "data=tokens",
    "trainer.micro_batch=2",
    "trainer.seq_len=32",
    "trainer.eval_every=4",
    "trainer.eval_batches=2",
    "optimizer.warmup_steps=2",
    "hardware.threads=1",
    "hydra.sweep.dir=grid",
    "hydra.callbacks.report.scaling_samples=10",
]
RUNS = ["0", "0-d640", "0-d1280", "1", "1-d640", "1-d1280"]


def _data(cwd: Path) -> Path:
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, VOCAB, size=8_000).astype(np.int64)
    tokens[99::100] = 0  # EOS closes a document every 100 ids
    tokens[-1] = 0
    data = cwd / "data"
    make_shard(data / "train", tokens, vocab_size=VOCAB)
    make_shard(data / "eval", tokens[:2_000][::-1].copy(), partition="eval", vocab_size=VOCAB)
    return data


def _command(cwd: Path) -> list[str]:
    return [*LADDER, f"data.path={cwd / 'data'}"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("ladder")
    _data(cwd)
    result = cli(_command(cwd), cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return cwd / "grid"


def _assert_same_ladder(grid: Path, reference: Path) -> None:
    for run in RUNS:
        assert_same_run(grid / run, reference / run)
        assert json.loads((grid / run / "status.json").read_text())["status"] == "finished", run
    rows = [r for r in (grid / REPORT_CSV).read_text().splitlines()[1:] if r]
    assert len(rows) == len(RUNS)


# (the fault, as tests/resume_driver.py names it; what the killed sweep left of the run it was in)
KILLS = [
    ("ladder:0:step:5", "job 0's stable run, before its first checkpoint"),
    ("ladder:3:step:12", "job 1's stable run, after its checkpoint at step 8"),
    ("ladder:2:before", "between job 0's branches"),
    ("ladder:4:locked", "a branch's directory and lock, nothing else"),
    ("ladder:4:running", "a branch's .hydra/, train.log and status 'running', no run_config.json"),
    ("ladder:4:recorded", "a branch's run_config.json, no step"),
    ("ladder:4:step:9", "a branch in its first step"),
    ("ladder:4:saving", "a branch's first checkpoint half-written"),
    ("ladder:4:saved", "a branch's first checkpoint complete, status still 'running'"),
]


@pytest.mark.parametrize("fault,where", KILLS, ids=[k for k, _ in KILLS])
def test_a_ladder_killed_anywhere_resumes_to_the_uninterrupted_ladder(uninterrupted, tmp_path, fault, where):
    _data(tmp_path)
    killed = drive(fault, tmp_path, *_command(tmp_path))
    assert killed.returncode == -9, killed.stderr[-3000:]
    again = cli(_command(tmp_path), tmp_path)  # the same sweep command, the same hydra.sweep.dir
    assert again.returncode == 0, f"{where}: {again.stderr[-3000:]}"
    _assert_same_ladder(tmp_path / "grid", uninterrupted)


def test_a_moved_ladder_reruns_and_reports(uninterrupted, tmp_path):
    """A sweep moved (another launch directory) whose last branch was killed at its start: the same command
    from the new place finishes it; every branch records its parent relative to the sweep, and the report
    fits every planned run."""
    old = tmp_path / "old"
    _data(old)
    killed = drive("ladder:5:recorded", old, *_command(old))
    assert killed.returncode == -9, killed.stderr[-3000:]
    new = tmp_path / "new"
    shutil.copytree(old, new)
    shutil.rmtree(old)
    again = cli(_command(new), new)
    assert again.returncode == 0, again.stderr[-3000:]
    grid = new / "grid"
    _assert_same_ladder(grid, uninterrupted)
    for run in RUNS:
        record = json.loads((grid / run / "run_config.json").read_text())
        if "-d" in run:
            parent, job = record["init_from"], run.split("-")[0]
            assert (parent["run"], parent["relative_to"]) == (job, "sweep"), parent
            assert parent["path"].startswith(f"{job}/checkpoints/step_"), parent
    with open(grid / REPORT_CSV, newline="") as f:
        rows = list(csv.DictReader(f))
    # every branch fitted, though the runs complete before the move record the sweep's old place
    assert sorted(r["run"] for r in rows if r["scaling.fit_point"] == "yes") == sorted(RUNS[1:3] + RUNS[4:])
    assert "from another sweep" not in (grid / REPORT_MD).read_text()
