"""A run resumed with another number of ranks (docs/reliability.md: micro_batch, grad_accum and the world size
may change, the global batch may not) trains and logs as the uninterrupted run: one process -> 2 DDP ranks,
one process -> 2 FSDP2 ranks (the single-process checkpoint sharded on load), 2 DDP ranks -> one process.

The checkpoint falls inside a logging window (logged at steps 1, 3 and 4; saved at 2), so the row after the
resume also checks the window's running sums, which each rank keeps for its own share of the batch."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import run_ranks, train_losses

CADENCE = ["trainer.log_every=3", "checkpoint.every_steps=2"]
LAYOUT = {  # the same global batch of 4 samples
    "single": (["trainer.micro_batch=4"], 1),
    "ddp": (["trainer.micro_batch=2"], 2),
    "fsdp": (["trainer.micro_batch=2", "hardware.strategy=fsdp"], 2),
}


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("world")
    for name in ("single", "ddp"):
        overrides, nproc = LAYOUT[name]
        run_ranks(root / name, [*overrides, *CADENCE], nproc)
    return {"single": root / "single", "ddp": root / "ddp"}


@pytest.mark.subprocess
@pytest.mark.parametrize("start, resume", [("single", "ddp"), ("single", "fsdp"), ("ddp", "single")])
def test_a_run_resumes_with_another_number_of_ranks(whole, tmp_path, start, resume):
    run = tmp_path / f"{start}_to_{resume}"
    shutil.copytree(whole[start], run)
    shutil.rmtree(run / "checkpoints" / "step_00000004")  # as if stopped after the step-2 checkpoint
    (run / "checkpoints" / "latest").write_text("step_00000002\n")
    overrides, nproc = LAYOUT[resume]
    run_ranks(run, [*overrides, *CADENCE], nproc)
    assert "resume from step 2" in (run / "train.log").read_text()
    reference = train_losses(whole[start])
    assert len(reference) == 3  # steps 1, 3, 4
    assert train_losses(run) == pytest.approx(reference, rel=1e-5, abs=1e-5)
