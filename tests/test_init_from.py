"""trainer.init_from: a new run from another run's checkpoint (weights, optimizer, or a branch that goes on
from the parent's step), from a `trmoe.export` directory; the parent never written; a branch killed with
SIGKILL resumes bit-exactly; bad input one line, exit 2, nothing written. (From a converted reference
checkpoint: tests/test_convert.py, where the fabricated old-runner checkpoints live.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers import DRIVER, assert_same_run, cli, compose_config, metrics_rows, train_in_process, tree_digest
from presets import FAST_CPU, RESUME_BASE

from trmoe.run.checkpoint import load_checkpoint
from trmoe.train import job

STEPS = "trainer.steps=12"  # the parent: checkpoints at 4, 8, 12 (keep_last=0 keeps them all)


@pytest.fixture(scope="module")
def parent(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("parent") / "r"
    train_in_process(run_dir, STEPS, "checkpoint.keep_last=0")
    return run_dir


def _first_state(run_dir: Path, *overrides: str, base=RESUME_BASE) -> dict:
    """The run's model and optimizer state right after Trainer.start() (what its first step starts from)."""
    seen: dict = {}

    def capture(trainer, stop) -> float:
        trainer.start()
        seen["step"] = trainer.step
        seen["model"] = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        seen["optimizer"] = trainer.optimizer.state_dict()
        return trainer.finish()

    threads = torch.get_num_threads()
    try:
        job.run(compose_config(*base, *overrides), run_dir, capture)
    finally:
        torch.set_num_threads(threads)
    return seen


def _assert_equal_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("state", ["weights", "optimizer", "branch"])
def test_a_new_run_starts_from_the_parents_checkpoint_bit_for_bit(parent, tmp_path, state):
    before = tree_digest(parent)
    source = load_checkpoint(parent / "checkpoints" / "step_00000008")
    seen = _first_state(
        tmp_path / "b",
        f"trainer.init_from={parent / 'checkpoints' / 'step_00000008'}",
        f"trainer.init_state={state}",
    )
    _assert_equal_tensors(seen["model"], source["model"])
    assert seen["step"] == (8 if state == "branch" else 0)
    moments = seen["optimizer"]["state"]
    if state == "weights":
        assert moments == {}  # a fresh optimizer
    else:
        assert moments.keys() == source["optimizer"]["state"].keys()
        for index, values in moments.items():
            _assert_equal_tensors(values, source["optimizer"]["state"][index])
    record = json.loads((tmp_path / "b" / "run_config.json").read_text())["init_from"]
    assert record["step"] == 8 and record["kind"] == "checkpoint" and record["carried"] == state
    assert record["run"] == str(parent.resolve()) and len(record["content_hash"]) == 64
    assert tree_digest(parent) == before  # the parent is only read


def test_a_branch_with_the_parents_config_is_the_parent_bit_for_bit(parent, tmp_path):
    """Weights, optimizer, RNG, data cursor and step: from step 8 the branch's steps are the parent's."""
    branch = tmp_path / "b"
    train_in_process(
        branch, STEPS, f"trainer.init_from={parent}/checkpoints/step_00000008", "trainer.init_state=branch"
    )
    mine, theirs = load_checkpoint(branch), load_checkpoint(parent)
    assert mine["step"] == theirs["step"] == 12
    _assert_equal_tensors(mine["model"], theirs["model"])
    for index, values in mine["optimizer"]["state"].items():
        _assert_equal_tensors(values, theirs["optimizer"]["state"][index])
    rows = metrics_rows(branch)
    assert rows[0]["step"] == "8" and rows[0]["tokens"] == str(8 * 4 * 64)
    parent_row = next(r for r in metrics_rows(parent) if r["step"] == "12")
    assert rows[-1]["eval_loss"] == parent_row["eval_loss"]


def test_a_wsd_cooldown_branch_is_the_run_trained_to_its_budget_bit_for_bit(tmp_path):
    """docs/scaling.md: a stable WSD run (horizon 20: constant LR until step 16) branched at step 8 into a
    10-step budget (decay over steps 8..10) ends with the weights of a 10-step WSD run from scratch."""
    wsd = ["optimizer.schedule=wsd", "checkpoint.keep_last=0"]
    train_in_process(tmp_path / "stable", *wsd, "trainer.steps=8", "optimizer.decay_steps=20")
    train_in_process(tmp_path / "scratch", *wsd, "trainer.steps=10")
    parent = tmp_path / "stable" / "checkpoints" / "step_00000008"
    branch = tmp_path / "branch"
    train_in_process(
        branch, *wsd, "trainer.steps=10", f"trainer.init_from={parent}", "trainer.init_state=branch"
    )
    mine, scratch = load_checkpoint(branch), load_checkpoint(tmp_path / "scratch")
    _assert_equal_tensors(mine["model"], scratch["model"])
    for index, values in mine["optimizer"]["state"].items():
        _assert_equal_tensors(values, scratch["optimizer"]["state"][index])
    # negative control: a parent whose decay had begun before step 8 (horizon 9) gives another result
    early = tmp_path / "early"
    train_in_process(early, *wsd, "trainer.steps=8", "optimizer.decay_steps=9")
    other = tmp_path / "other"
    source = early / "checkpoints" / "step_00000008"
    train_in_process(
        other, *wsd, "trainer.steps=10", f"trainer.init_from={source}", "trainer.init_state=branch"
    )
    assert not torch.equal(load_checkpoint(other)["model"]["embed.weight"], scratch["model"]["embed.weight"])


def _drive(fault: str, cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [sys.executable, str(DRIVER), fault, *RESUME_BASE, *overrides],
        cwd=cwd,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.subprocess
def test_a_branch_killed_with_sigkill_resumes_bit_exactly(parent, tmp_path):
    """Killed after its first checkpoint (resumes from its own step 12) and before it (starts again from the
    parent): either way the result is the uninterrupted branch's, bit for bit."""
    branch = [f"trainer.init_from={parent}/checkpoints/step_00000008", "trainer.init_state=branch"]
    faults = {"step:14:forward": "=== resume from step 12 ", "step:10:forward": "=== restart from step 0"}
    with ThreadPoolExecutor(max_workers=2) as pool:
        procs = dict(
            zip(faults, pool.map(lambda f: _drive(f, tmp_path / f[5:7], *branch), faults), strict=True)
        )
    baseline = tmp_path / "baseline"
    train_in_process(baseline, *branch)
    for fault, said in faults.items():
        assert procs[fault].returncode == -signal.SIGKILL, procs[fault].stderr[-3000:]
        run_dir = tmp_path / fault[5:7] / "runs" / "r"
        train_in_process(run_dir, *branch)
        assert said in (run_dir / "train.log").read_text()
        assert_same_run(run_dir, baseline)
        record = json.loads((run_dir / "run_config.json").read_text())
        assert record["init_from"]["step"] == 8  # the resumed run still names its parent


@pytest.mark.parametrize("fmt", ["hf", "safetensors"])
def test_init_from_an_export_starts_training(tmp_path, fmt):
    if fmt == "hf":
        pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from trmoe.export import export
    from trmoe.load import load_model

    base = [*FAST_CPU, "trainer.steps=3", "trainer.eval_every=0"]
    train_in_process_fast(tmp_path / "p", *base)
    out = export(load_model(tmp_path / "p"), tmp_path / fmt, fmt)
    seen = _first_state(tmp_path / "b", *base, f"trainer.init_from={out}", base=())
    _assert_equal_tensors(seen["model"], load_checkpoint(tmp_path / "p")["model"])
    train_in_process_fast(tmp_path / "c", *base, "trainer.steps=2", f"trainer.init_from={out}")
    assert [r["step"] for r in metrics_rows(tmp_path / "c")][-1] == "2"
    record = json.loads((tmp_path / "c" / "run_config.json").read_text())["init_from"]
    assert record["kind"] == "export" and record["step"] == 3


def train_in_process_fast(run_dir: Path, *overrides: str) -> float:
    from trmoe.train.loop import train

    threads = torch.get_num_threads()
    try:
        return train(compose_config(*overrides), run_dir)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["trainer.init_from=nowhere"], "trainer.init_from=nowhere: no such file or directory"),
        (  # which shape is whose, never two bare shapes side by side
            ["trainer.init_from={parent}", "model.hidden_size=32"],
            "another model shape (22 tensors differ, e.g. blocks.0.attn.k_norm.weight: the parent's (16,), "
            "this run's (8,))",
        ),
        (["trainer.init_from={parent}", "trainer.init_state=branch", STEPS], "trainer.steps=12"),
        (
            [
                "trainer.init_from={parent}",
                "trainer.init_state=branch",
                "trainer.micro_batch=2",
                "trainer.steps=20",
            ],
            "tokens per step",
        ),
        (
            ["trainer.init_from={parent}", "trainer.init_state=optimizer", "optimizer=muon_tr"],
            "groups the parameters",
        ),
        (  # both adamw: the keys that group the parameters otherwise are named, with both values
            ["trainer.init_from={parent}", "trainer.init_state=optimizer", "optimizer.decay_embedding=true"],
            "otherwise (optimizer.decay_embedding: the parent's False, this run's True)",
        ),
        (["trainer.init_state=branch"], "trainer.init_state=branch: needs trainer.init_from"),
        (["trainer.init_from={parent}", "trainer.resume={parent}"], "use one of them"),
    ],
)
def test_bad_init_from_is_one_line_exit_2_nothing_written(parent, tmp_path, overrides, says):
    args = [*RESUME_BASE, "run.name=b", *(o.format(parent=parent) for o in overrides)]
    before = tree_digest(parent)
    out = cli(args, tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert says in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not (tmp_path / "runs" / "b").exists()
    assert tree_digest(parent) == before


def _tables(state: dict) -> dict:
    return {k: v for k, v in state.items() if k.endswith("route_table")}


def test_route_tables_follow_the_new_config_not_the_parents(parent, tmp_path):
    """A modulo_cyclic parent started with routing=random routes by random's tables (those a fresh
    routing=random run builds), says so in train.log and records which tables it replaced; the weights are
    still the parent's."""
    source = load_checkpoint(parent / "checkpoints" / "step_00000008")
    fresh = _tables(_first_state(tmp_path / "fresh", "routing=random")["model"])
    seen = _first_state(
        tmp_path / "b", f"trainer.init_from={parent}/checkpoints/step_00000008", "routing=random"
    )["model"]
    assert fresh and all(not torch.equal(fresh[k], source["model"][k]) for k in fresh)
    _assert_equal_tensors(_tables(seen), fresh)
    _assert_equal_tensors(
        {k: v for k, v in seen.items() if k not in fresh},
        {k: v for k, v in source["model"].items() if k not in fresh},
    )
    record = json.loads((tmp_path / "b" / "run_config.json").read_text())["init_from"]
    assert record["followed"] == sorted(fresh)
    assert "follow this config's routing" in (tmp_path / "b" / "train.log").read_text()
    # the parent's own routing: its tables, nothing replaced
    same = _first_state(tmp_path / "c", f"trainer.init_from={parent}/checkpoints/step_00000008")["model"]
    _assert_equal_tensors(_tables(same), _tables(source["model"]))
    assert json.loads((tmp_path / "c" / "run_config.json").read_text())["init_from"]["followed"] == []


@pytest.mark.parametrize(
    ("parent_routing", "routing", "names"),
    [
        ("learned", "frozen_router", "blocks.0.ffn.router would carry"),
        ("frozen_router", "learned", "blocks.0.ffn.router would carry"),
    ],
)
def test_router_state_from_another_strategy_is_refused(tmp_path, parent_routing, routing, names):
    """A learned router's W_r carried into frozen_router would freeze the parent's trained router (and a
    frozen one would start training): one line naming the tensor, exit 2, nothing written."""
    train_in_process(tmp_path / "p", "trainer.steps=4", f"routing={parent_routing}")
    before = tree_digest(tmp_path / "p")
    out = cli(
        [*RESUME_BASE, "run.name=b", f"routing={routing}", f"trainer.init_from={tmp_path / 'p'}"], tmp_path
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert names in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert f"layer 0 routes by {parent_routing}, this config's by {routing}" in out.stderr
    assert not (tmp_path / "runs" / "b").exists() and tree_digest(tmp_path / "p") == before
    # the parent's own strategy carries it
    assert (
        cli(
            [
                *RESUME_BASE,
                "run.name=ok",
                "trainer.steps=2",
                f"routing={parent_routing}",
                f"trainer.init_from={tmp_path / 'p'}",
            ],
            tmp_path,
        ).returncode
        == 0
    )


def test_a_branch_that_scores_another_held_out_set_says_so_and_records_it(parent, tmp_path):
    """Another micro-batch split of the same tokens per step scores eval_batches x micro_batch windows: half
    the parent's at micro_batch 2. The branch says so in train.log (with the eval_batches that keeps the
    parent's set) and records both sizes; with that eval_batches its branch-point evaluation is the one the
    parent's own split gives."""
    branch = [f"trainer.init_from={parent}/checkpoints/step_00000008", "trainer.init_state=branch"]
    split = ["trainer.micro_batch=2", "trainer.grad_accum=2", "trainer.steps=9"]
    train_in_process(tmp_path / "own", *branch, "trainer.steps=9")
    train_in_process(tmp_path / "half", *branch, *split)
    train_in_process(tmp_path / "kept", *branch, *split, "trainer.eval_batches=4")

    def first_eval(name: str) -> float:
        return float(metrics_rows(tmp_path / name)[0]["eval_loss"])

    def recorded(name: str) -> dict:
        return json.loads((tmp_path / name / "run_config.json").read_text())["init_from"]

    log = (tmp_path / "half" / "train.log").read_text()
    assert "the parent scored 8 held-out windows, this run scores 4" in log
    assert "trainer.eval_batches=4 scores its set" in log
    assert recorded("half")["held_out_windows"] == {"parent": 8, "run": 4}
    assert first_eval("half") != pytest.approx(first_eval("own"), rel=1e-6)  # another set
    for name in ("own", "kept"):
        assert "held_out_windows" not in recorded(name)
        assert "held-out windows" not in (tmp_path / name / "train.log").read_text()
    assert first_eval("kept") == pytest.approx(first_eval("own"), rel=1e-5)


def test_a_restart_whose_parent_was_replaced_is_refused(parent, tmp_path):
    """A branch killed before its first checkpoint starts from its parent again; when another valid
    checkpoint (another run's, same shapes) has replaced the parent at the same path since, the launch
    refuses in one line naming both contents (its record names the first), exit 2, the run directory as it
    was; with the parent restored it restarts."""
    import shutil

    shutil.copytree(parent, tmp_path / "p")
    source = tmp_path / "p" / "checkpoints" / "step_00000008"
    run_dir = tmp_path / "runs" / "b"
    args = [f"trainer.init_from={source}", "trainer.init_state=branch", "run.name=b"]

    def killed(trainer, stop) -> float:  # before the first checkpoint, as a SIGKILL at step 9 would
        trainer.start()
        raise KeyboardInterrupt

    threads = torch.get_num_threads()
    try:
        with pytest.raises(KeyboardInterrupt):
            job.run(compose_config(*RESUME_BASE, *args), run_dir, killed)
    finally:
        torch.set_num_threads(threads)
    recorded = json.loads((run_dir / "run_config.json").read_text())["init_from"]["content_hash"]
    train_in_process(tmp_path / "other", "trainer.steps=8", "trainer.seed=7")
    kept = tmp_path / "kept"
    source.rename(kept)
    shutil.copytree(tmp_path / "other" / "checkpoints" / "step_00000008", source)
    before = tree_digest(run_dir)
    out = cli([*RESUME_BASE, *args], tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert len(out.stderr.strip().splitlines()) == 1 and "not the parent this run started from" in out.stderr
    assert f"content {recorded[:12]} then" in out.stderr, out.stderr
    assert tree_digest(run_dir) == before
    shutil.rmtree(source)
    kept.rename(source)
    assert cli([*RESUME_BASE, *args], tmp_path).returncode == 0
    assert json.loads((run_dir / "run_config.json").read_text())["init_from"]["content_hash"] == recorded
