"""The resume config check (docs/reliability.md): training-critical changes refused with a diff before any
write, volatile ones continued and recorded, force_resume, a horizon pinned to extend a run, each attempt's
code and machine recorded."""

from __future__ import annotations

import json
import os

import pytest
from helpers import cli, compose_config, metrics_rows, train_in_process, tree_digest
from presets import RESUME_BASE, RESUME_SMALL

from trmoe.errors import UserError
from trmoe.run.checkpoint import load_checkpoint
from trmoe.run.identity import compare, critical_hash, is_volatile, training_view

# ------------------------------------------------------------------------- resume config comparison

MISMATCHES = [
    (["model.hidden_size=32"], "model.hidden_size"),
    (["routing=multi_hash"], "routing.strategy"),
    (["attention=mha"], "attention.kind"),
    (["optimizer.lr=1e-2"], "optimizer.lr"),
    (["optimizer.beta2=0.99"], "optimizer.beta2"),
    (["optimizer=adamw", "optimizer.weight_decay=0.0"], "optimizer.weight_decay"),
    (["data.order=sequential"], "data.order"),
    (["trainer.seed=7"], "trainer.seed"),
    (["trainer.micro_batch=8"], "derived.global_batch_tokens"),
    (["trainer.seq_len=32"], "trainer.seq_len"),
    (["loss.z_loss=1e-4"], "loss.z_loss"),
    (["loss.label_smoothing=0.1"], "loss.label_smoothing"),
    (["trainer.grad_clip=0.5"], "trainer.grad_clip"),
    (["model.parametrization=mup", "model.mup_base_width=32"], "model.parametrization"),
]


@pytest.mark.parametrize("overrides,key", MISMATCHES, ids=[k for _, k in MISMATCHES])
def test_training_critical_change_is_refused_with_a_diff_before_any_write(small_run, overrides, key):
    before = tree_digest(small_run)
    with pytest.raises(UserError, match="resume config mismatch") as err:
        train_in_process(small_run, *RESUME_SMALL, *overrides)
    message = str(err.value)
    line = next(line for line in message.splitlines() if line.strip().startswith(key + " "))
    assert " -> " in line
    assert "trainer.force_resume=true" in message
    assert tree_digest(small_run) == before


def test_precision_and_world_size_classes():
    """What cannot change on this CPU (the effective precision, the world size) is checked on the views."""
    old = training_view({"trainer": {"micro_batch": 4}}, {"precision": "fp32", "world_size": 1}, {"sha": "a"})
    new = training_view({"trainer": {"micro_batch": 2}}, {"precision": "bf16", "world_size": 2}, {"sha": "a"})
    diff = compare(old, new)
    assert set(diff.critical) == {"derived.precision"}
    assert set(diff.volatile) == {"derived.world_size", "trainer.micro_batch"}
    assert "fp32" in diff.render() and "bf16" in diff.render()
    changed_data = training_view({}, None, {"sha": "b"})
    assert set(compare(old, changed_data, data_only=True).critical) == {"data_info.sha"}


def test_new_keys_are_training_critical_unless_listed_volatile():
    assert not is_volatile("optimizer.some_new_knob") and not is_volatile("brand_new_section.x")
    assert is_volatile("trainer.steps") and is_volatile("run.name") and is_volatile("checkpoint.every_steps")
    # a pattern covers its subtree (data_info.metric_streams never matched its flattened keys); locations are
    # volatile, the content hashes beside them are not
    assert is_volatile("data_info.metric_streams.eval_loss") and is_volatile("data_info.shards.train.path")
    assert is_volatile("data.path") and is_volatile("data_info.stream.paths")
    assert not is_volatile("data_info.shards.train.sha256") and not is_volatile("data_info.stream.files")
    diff = compare({"model.a": 1}, {"model.a": 1, "model.new_key": 3})
    assert diff.critical == {"model.new_key": ("<absent>", 3)}
    a = {"model.a": 1, "trainer.log_every": 1}
    assert critical_hash(a) == critical_hash({**a, "trainer.log_every": 5})
    assert critical_hash(a) != critical_hash({**a, "model.a": 2})


def test_an_option_added_later_is_no_difference_at_its_default():
    """A record written before an option existed (lion's betas, data.jsonl_eval_path: issue 42) lacks its
    key: at this trmoe's default it is no difference, set to anything else it is one (`<absent> -> value`);
    a key this schema does not know stays critical (above)."""
    old = {"optimizer.name": "adamw", "optimizer.lr": 1e-3}
    new = {**old, "optimizer.lion_beta1": 0.9, "optimizer.lion_beta2": 0.99, "data.jsonl_eval_path": None}
    assert compare(old, new).critical == {}
    diff = compare(old, {**new, "optimizer.lion_beta1": 0.5})
    assert diff.critical == {"optimizer.lion_beta1": ("<absent>", 0.5)}
    # the reverse: an uninstalled plug-in's option, recorded while adamw trained, is no difference either
    assert compare({**new, "optimizer.signum_momentum": 0.9}, new).critical == {}
    assert compare({**new, "model.gone": 1}, new).critical == {"model.gone": (1, "<absent>")}


def test_a_checkpoint_written_before_an_option_existed_resumes(small_run, tmp_path):
    """A run directory whose records predate options added since (their keys removed from meta.json and
    run_config.json, as eb700b3 wrote them) resumes and extends with no critical difference."""
    import shutil

    from trmoe.run.checkpoint import seal_meta

    added = {"optimizer": ("lion_beta1", "lion_beta2"), "data": ("jsonl_eval_path",)}

    def predate(record: dict) -> dict:
        for section, keys in added.items():
            for key in keys:
                del record["config"][section][key]
        return record

    run_dir = tmp_path / "r"
    shutil.copytree(small_run, run_dir)
    for meta in (run_dir / "checkpoints").glob("step_*/meta.json"):
        meta.write_text(seal_meta(predate(json.loads(meta.read_text()))))
    rc_path = run_dir / "run_config.json"
    rc_path.write_text(json.dumps(predate(json.loads(rc_path.read_text()))))
    train_in_process(run_dir, *RESUME_SMALL, "trainer.steps=6", "optimizer.decay_steps=4")
    rc = json.loads(rc_path.read_text())
    assert rc["resumes"][-1]["forced"] == {} and rc["force_resumed"] is False
    assert set(rc["resumes"][-1]["volatile_changes"]) == {"trainer.steps", "optimizer.decay_steps"}
    assert load_checkpoint(run_dir)["step"] == 6


def test_mismatch_exits_2_from_the_cli(small_run, tmp_path):
    run_dir = tmp_path / "runs" / "r"
    run_dir.parent.mkdir()
    os.symlink(small_run, run_dir)
    before = tree_digest(small_run)
    result = cli([*RESUME_BASE, *RESUME_SMALL, "optimizer.lr=1e-2"], cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "optimizer.lr" in result.stderr and "0.003 -> 0.01" in result.stderr
    assert tree_digest(small_run) == before


def test_volatile_changes_resume_and_are_recorded(small_run, tmp_path, caplog):
    """Cadences, the run name and how the global batch is split may change; trainer.steps too when the
    schedules' past stays the same. A changed horizon that would bend the past LR is refused."""
    import shutil

    run_dir = tmp_path / "r"
    shutil.copytree(small_run, run_dir)
    before = tree_digest(run_dir)
    with pytest.raises(UserError, match="schedules: lr_mult at step 4 would change"):
        train_in_process(run_dir, *RESUME_SMALL, "trainer.steps=8")  # the cosine horizon moves: refused
    assert tree_digest(run_dir) == before
    (run_dir / "checkpoints" / "step_00000004").rename(run_dir / "checkpoints" / "gone")
    caplog.set_level("WARNING", logger="trmoe")
    train_in_process(
        run_dir,
        *RESUME_SMALL,
        "trainer.log_every=2",
        "trainer.eval_every=1",
        "checkpoint.every_steps=1",
        "trainer.micro_batch=2",
        "trainer.grad_accum=2",
        "run.name=renamed",
    )
    rc = json.loads((run_dir / "run_config.json").read_text())
    changes = rc["resumes"][-1]["volatile_changes"]
    assert changes["trainer.micro_batch"] == [4, 2] and changes["trainer.log_every"] == [1, 2]
    assert rc["resumes"][-1]["forced"] == {} and load_checkpoint(run_dir)["step"] == 4
    assert "the held-out set changes from 8 to 4 windows" in caplog.text  # eval_batches x micro_batch
    # logged while the resume was planned, before the run may be written to: train.log has it all the same
    assert "the held-out set changes from 8 to 4 windows" in (run_dir / "train.log").read_text()


def test_a_finished_run_extends_with_its_horizon_pinned(small_run, tmp_path):
    """docs/training.md: trainer.steps=8 alone moves the cosine horizon (refused above); with the old one
    pinned (optimizer.decay_steps=4; warmup is pinned in RESUME_BASE) the past is unchanged and the run goes
    on, at the LR floor, without force_resume."""
    import shutil

    run_dir = tmp_path / "r"
    shutil.copytree(small_run, run_dir)
    train_in_process(run_dir, *RESUME_SMALL, "trainer.steps=6", "optimizer.decay_steps=4")
    rc = json.loads((run_dir / "run_config.json").read_text())
    assert rc["force_resumed"] is False and rc["resumes"][-1]["volatile_changes"][
        "optimizer.decay_steps"
    ] == [
        None,
        4,
    ]
    rows = metrics_rows(run_dir)
    assert [r["step"] for r in rows[:5]] == [r["step"] for r in metrics_rows(small_run)]
    assert float(rows[-1]["lr"]) == pytest.approx(3e-3 * rc["config"]["optimizer"]["min_lr_ratio"])
    with pytest.raises(UserError, match="lr_mult at step 4 would change"):  # a pin that bends the past
        train_in_process(run_dir, *RESUME_SMALL, "trainer.steps=8", "optimizer.decay_steps=5")


def test_force_resume_continues_and_is_recorded(small_run, tmp_path):
    import shutil

    run_dir = tmp_path / "r"
    shutil.copytree(small_run, run_dir)
    before = tree_digest(run_dir)
    with pytest.raises(UserError, match="cannot change the model's tensors"):  # not even with force
        train_in_process(run_dir, *RESUME_SMALL, "model.shared_width=128", "trainer.force_resume=true")
    # nor how the optimizer groups them: its saved state loads group by group (a scheduled gate leaves it)
    for change in ("model.shared_gate_final=0.5", "optimizer.decay_embedding=true", "optimizer=stosignsgd"):
        with pytest.raises(UserError, match="cannot change how the optimizer groups the parameters") as e:
            train_in_process(run_dir, *RESUME_SMALL, change, "trainer.force_resume=true")
        if change.startswith("optimizer.decay"):  # the key that groups them otherwise, both values
            assert "(optimizer.decay_embedding: the checkpoint's False, this run's True)" in str(e.value)
    # nor the tokens per step: the steps already run read their samples and counted tokens by it
    with pytest.raises(UserError, match=r"cannot change the tokens per step \(256 -> 512"):
        train_in_process(run_dir, *RESUME_SMALL, "trainer.micro_batch=8", "trainer.force_resume=true")
    with pytest.raises(UserError) as refused:  # so the first refusal does not suggest force_resume
        train_in_process(run_dir, *RESUME_SMALL, "trainer.micro_batch=8")
    assert "cannot change even with trainer.force_resume=true" in str(refused.value)
    assert "to continue anyway" not in str(refused.value)
    assert tree_digest(run_dir) == before
    train_in_process(
        run_dir,
        *RESUME_SMALL,
        "trainer.steps=6",
        "optimizer.decay_steps=4",
        "optimizer.lr=6e-3",
        "optimizer.weight_decay=0.5",
        "trainer.force_resume=true",
    )
    rc = json.loads((run_dir / "run_config.json").read_text())
    assert rc["force_resumed"] is True
    log_text = (run_dir / "train.log").read_text()  # the differences are in the run's own log too
    assert "trainer.force_resume=true: continuing" in log_text and "optimizer.lr" in log_text
    forced = rc["resumes"][-1]["forced"]
    assert forced["optimizer.lr"] == [0.003, 0.006] and "optimizer.decay_steps" not in forced
    state = load_checkpoint(run_dir)
    assert state["step"] == 6
    assert [int(r["step"]) for r in metrics_rows(run_dir)] == [0, 1, 2, 3, 4, 5, 6]
    # the forced values are what trained steps 5 and 6 (not the checkpoint's), as run_config.json says
    groups = state["optimizer"]["param_groups"]
    assert {g["base_lr"] for g in groups} == {6e-3} and {g["weight_decay"] for g in groups} == {0.0, 0.5}
    assert {g["base_lr"] for g in rc["controls"]["optimizer_groups"]} == {6e-3}
    floor = 6e-3 * rc["config"]["optimizer"]["min_lr_ratio"]  # past decay_steps=4: 6e-4, not 3e-4
    assert [float(r["lr"]) for r in metrics_rows(run_dir)[5:]] == pytest.approx([floor, floor])


def test_a_key_the_attention_kind_ignores_is_no_difference():
    """mha uses one key/value head per query head and mqa one, whatever model.num_kv_heads says: two
    attempts that differ only there build the same model (under gqa it is a real difference)."""
    from trmoe.run.identity import config_container

    def view(*overrides: str) -> dict:
        return training_view(config_container(compose_config(*overrides)), None, None)

    for kind in ("mha", "mqa"):
        a, b = view(f"attention={kind}"), view(f"attention={kind}", "model.num_kv_heads=4")
        assert compare(a, b).critical == {} and critical_hash(a) == critical_hash(b)
    gqa = compare(view("attention=gqa"), view("attention=gqa", "model.num_kv_heads=4")).critical
    assert gqa == {"model.num_kv_heads": (2, 4)}
    assert "model.num_kv_heads" in compare(view("attention=gqa"), view("attention=mha")).critical


def test_each_attempt_records_its_code_and_machine_and_a_change_is_logged(small_run, tmp_path):
    """run_config.json's git and backend are the last attempt's; each resume entry keeps the attempt before
    it (`before`), and a resume on another thread count (or code, torch, processor) says so in the log."""
    import shutil

    run_dir = tmp_path / "r"
    shutil.copytree(small_run, run_dir)
    first = json.loads((run_dir / "run_config.json").read_text())
    train_in_process(
        run_dir, *RESUME_SMALL, "trainer.steps=6", "optimizer.decay_steps=4", "hardware.threads=2"
    )
    rc = json.loads((run_dir / "run_config.json").read_text())
    before = rc["resumes"][-1]["before"]
    assert before == {"git": first["git"], "backend": first["backend"]}
    assert before["backend"]["threads"] == 1 and rc["backend"]["threads"] == 2
    assert "backend.threads 1 -> 2" in (run_dir / "train.log").read_text()


def test_a_moved_routing_embedding_resumes_and_other_bytes_are_refused(tmp_path):
    """routing.embedding is where the file is (volatile); its content hash is critical: the same bytes at
    another path resume, other bytes at the same path are refused naming derived.route_embedding_sha256."""
    import numpy as np

    rng = np.random.default_rng(0)
    first = tmp_path / "emb.npy"
    np.save(first, rng.standard_normal((512, 8)).astype(np.float32))
    run_dir = tmp_path / "r"
    args = ["routing=clustered_hash", "trainer.steps=4", "checkpoint.every_steps=2"]
    args += ["optimizer.decay_steps=20"]  # the horizon pinned: the run may be extended
    train_in_process(run_dir, *args, f"routing.embedding={first}")
    moved = tmp_path / "moved" / "emb.npy"
    moved.parent.mkdir()
    first.rename(moved)
    train_in_process(run_dir, *args, "trainer.steps=6", f"routing.embedding={moved}")
    assert load_checkpoint(run_dir)["step"] == 6
    record = json.loads((run_dir / "run_config.json").read_text())["resumes"][-1]["volatile_changes"]
    assert record["routing.embedding"] == [str(first), str(moved)]
    np.save(moved, rng.standard_normal((512, 8)).astype(np.float32))  # other bytes, same place
    before = tree_digest(run_dir)
    with pytest.raises(UserError, match="resume config mismatch") as err:
        train_in_process(run_dir, *args, "trainer.steps=8", f"routing.embedding={moved}")
    assert "derived.route_embedding_sha256" in str(err.value)
    assert tree_digest(run_dir) == before
