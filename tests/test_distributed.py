"""torchrun with 2 CPU processes (gloo): DDP and FSDP2 equal the single-process run with the same global
batch, a distributed checkpoint holds the same weights, and an FSDP2 run resumed from its sharded
checkpoint ends where the uninterrupted one does."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest
import torch
from helpers import run_ranks, train_losses

from trmoe.run.checkpoint import load_checkpoint


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dist")
    cases = {
        # the same global batch of 4 samples per step, split four ways
        "single": (["trainer.micro_batch=4"], 1),
        "ddp": (["trainer.micro_batch=2"], 2),
        "ddp_accum": (["trainer.micro_batch=1", "trainer.grad_accum=2"], 2),
        "fsdp": (["trainer.micro_batch=2", "hardware.strategy=fsdp", "checkpoint.every_steps=2"], 2),
    }
    for name, (overrides, nproc) in cases.items():  # ddp through torchrun itself, the others forked ranks
        run_ranks(root / name, overrides, nproc, torchrun=name == "ddp")
    # the FSDP run interrupted after its step-2 checkpoint: the same command resumes from the shards
    resumed = root / "fsdp_resumed"
    shutil.copytree(root / "fsdp", resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000004")
    run_ranks(resumed, cases["fsdp"][0], 2)
    return {name: root / name for name in [*cases, "fsdp_resumed"]}


@pytest.mark.subprocess
def test_ddp_and_fsdp_equal_the_single_processrun_ranks(runs):
    reference = train_losses(runs["single"])
    assert len(reference) == 4
    for name in ("ddp", "ddp_accum", "fsdp"):
        assert train_losses(runs[name]) == pytest.approx(reference, rel=1e-5, abs=1e-5), name


@pytest.mark.subprocess
def test_fsdp_resumes_from_its_sharded_checkpoint(runs):
    log = (runs["fsdp_resumed"] / "train.log").read_text()
    assert "resume from step 2" in log, log[-2000:]
    assert train_losses(runs["fsdp_resumed"]) == pytest.approx(train_losses(runs["fsdp"]), rel=1e-6, abs=1e-6)
    resumed, whole = load_checkpoint(runs["fsdp_resumed"]), load_checkpoint(runs["fsdp"])
    assert resumed["meta"]["step"] == whole["meta"]["step"] == 4
    for key, value in whole["model"].items():
        torch.testing.assert_close(resumed["model"][key], value, rtol=0, atol=1e-6, msg=key)


@pytest.mark.subprocess
def test_one_run_directory_rank_0_writes_and_rank_1_logs(runs):
    d = runs["ddp"]
    assert (d / "run_config.json").is_file() and (d / "train.log").is_file()
    assert (d / "logs" / "rank_1.log").stat().st_size > 0
    import json

    record = json.loads((d / "run_config.json").read_text())
    assert record["world_size"] == 2 and record["strategy"] == "ddp"
    assert record["backend"]["process_group"] == "gloo"
    console = (d.parent / "ddp.console").read_text()  # rank 0 alone speaks on the console
    assert "process group: rank 0 of 2" in console and "rank 1 of 2" not in console
    assert "process group: rank 1 of 2" in (d / "logs" / "rank_1.log").read_text()
    assert record["tokens_per_step"] == 4 * 32  # micro x seq x world x accum


@pytest.mark.subprocess
def test_distributed_checkpoints_hold_the_same_weights(runs):
    single = load_checkpoint(runs["single"])
    for name in ("ddp", "fsdp"):
        state = load_checkpoint(runs[name])
        assert state["meta"]["format"] == "dcp" and state["meta"]["world_size"] == 2
        assert state["model"].keys() == single["model"].keys()
        # AdamW divides by sqrt(v): a near-zero gradient summed in another order moves a weight by up to
        # ~lr/100 (measured 6e-5 at lr 3e-3); a wrong shard or a missed update moves it by ~lr.
        for key, value in single["model"].items():
            torch.testing.assert_close(state["model"][key], value, rtol=0, atol=3e-4, msg=f"{name} {key}")


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


def _figures(rows: list[dict[str, str]], columns: list[str]) -> dict[str, list[float]]:
    return {c: [float(r[c]) for r in rows if r[c] != "" and r.get("step") != "0"] for c in columns}


# FSDP2 shards the expert matrices into DTensors: expert telemetry's gradient norms (local sums of squares
# added over ranks), the diversity penalty (from the full weights; its gradient matters at this weight) and
# StoSignSGD's noise (drawn whole, sliced to the shard) must give the single-process figures. The three
# options ride one pair of runs: each has its own columns, and a wrong shard in any moves the losses.
FSDP_OPTIONS = [
    "telemetry.moe=true",
    "loss.diversity_weight=10",
    "loss.diversity_target=all",
    "optimizer=stosignsgd",
    "trainer.steps=3",
]
OPTION_COLUMNS = ["grad_norm_shared", "grad_norm_routed", "routed_rms", "diversity"]


@pytest.mark.subprocess
def test_fsdp_options_equal_the_single_processrun_ranks(tmp_path):
    run_ranks(tmp_path / "single", [*FSDP_OPTIONS, "trainer.micro_batch=4"], 1)
    run_ranks(tmp_path / "fsdp", [*FSDP_OPTIONS, "trainer.micro_batch=2", "hardware.strategy=fsdp"], 2)
    columns = ["train_loss", "grad_norm", *OPTION_COLUMNS]
    single, fsdp = (_figures(_rows(tmp_path / n / "metrics.csv"), columns) for n in ("single", "fsdp"))
    assert len(single["train_loss"]) == 3
    for c in columns:
        assert len(single[c]) == 3, c  # every option's figure is logged at every step
        assert fsdp[c] == pytest.approx(single[c], rel=1e-5, abs=1e-9), c
    # every per-layer figure: expert shares, RMS, gates, per-expert grad norms
    single, fsdp = (_rows(tmp_path / n / "telemetry.csv") for n in ("single", "fsdp"))
    assert len(fsdp) == len(single) == 3 * 2  # steps x layers
    columns = [c for c in single[0] if c not in ("step", "layer")]
    single, fsdp = _figures(single, columns), _figures(fsdp, columns)
    for c in columns:
        assert fsdp[c] == pytest.approx(single[c], rel=1e-5, abs=1e-9), c
