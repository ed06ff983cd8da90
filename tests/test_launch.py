"""What a launch does with its run directory (trmoe.run.launch): never overwritten without run.overwrite,
another run's checkpoint continued in a new directory, damaged checkpoints and records reported or refused
before any write."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import assert_same_run, cli, metrics_rows, train_in_process, tree_digest
from presets import RANDOM_IDS_CPU, RESUME_BASE, RESUME_SMALL

from trmoe.errors import UserError
from trmoe.run.checkpoint import load_checkpoint, seal_meta

# ------------------------------------------------------------------------------ the run directory


def test_run_directory_is_never_overwritten_without_run_overwrite(small_run, tmp_path):
    import shutil

    run_dir = tmp_path / "r"
    shutil.copytree(small_run, run_dir)
    before = tree_digest(run_dir)
    with pytest.raises(UserError, match="already holds a run"):
        train_in_process(run_dir, *RESUME_SMALL, "trainer.resume=never")
    # a different experiment in a directory without a checkpoint is refused too
    shutil.rmtree(run_dir / "checkpoints")
    with pytest.raises(UserError, match="holds a different run and no complete checkpoint"):
        train_in_process(run_dir, *RESUME_SMALL, "trainer.seed=3")
    with pytest.raises(UserError, match="already holds a run"):
        train_in_process(run_dir, *RESUME_SMALL, "trainer.seed=3", "trainer.resume=never")
    assert {k: v for k, v in tree_digest(run_dir).items() if not k.startswith("checkpoints")} == {
        k: v for k, v in before.items() if not k.startswith("checkpoints")
    }
    # only resume=never with run.overwrite=true replaces it, the other ranks' logs of a distributed run too
    (run_dir / "logs").mkdir()
    (run_dir / "logs" / "rank_1.log").write_text("the replaced run's rank 1\n")
    train_in_process(run_dir, *RESUME_SMALL, "trainer.seed=3", "trainer.resume=never", "run.overwrite=true")
    rc = json.loads((run_dir / "run_config.json").read_text())
    assert rc["config"]["trainer"]["seed"] == 3 and rc["resumes"] == []
    assert not (run_dir / "logs").exists()
    assert [int(r["step"]) for r in metrics_rows(run_dir)] == [0, 1, 2, 3, 4]


def test_resume_from_a_path_continues_another_runs_checkpoint(small_run, tmp_path):
    """trainer.resume=<checkpoint> into a new run directory: metrics up to the checkpoint are carried over
    and the result equals the uninterrupted run."""
    import shutil

    source = tmp_path / "source"
    shutil.copytree(small_run, source)
    ckpt = source / "checkpoints" / "step_00000002"
    new = tmp_path / "fork"
    train_in_process(new, *RESUME_SMALL, f"trainer.resume={ckpt}")
    assert_same_run(new, small_run)
    rc = json.loads((new / "run_config.json").read_text())
    assert rc["resumes"][-1]["checkpoint"] == str(ckpt.resolve())
    with pytest.raises(UserError, match="already holds a run"):  # another starting point: refused
        train_in_process(new, *RESUME_SMALL, f"trainer.resume={small_run / 'checkpoints' / 'step_00000004'}")
    with pytest.raises(UserError, match="no such|holds no checkpoint"):
        train_in_process(tmp_path / "x", *RESUME_SMALL, f"trainer.resume={tmp_path / 'nowhere'}")
    # the same command again, as a requeued job relaunches it: the fork goes on from its own checkpoint
    # (here its last: nothing to do), never back to the one it started from, even once that is gone
    shutil.rmtree(ckpt)
    before = tree_digest(new)
    train_in_process(new, *RESUME_SMALL, f"trainer.resume={ckpt}")
    assert tree_digest(new) == before and load_checkpoint(new)["step"] == 4
    # the other run's last step: nothing to train here (not "complete", which this directory never was)
    with pytest.raises(
        UserError, match="at step 4 = trainer.steps: nothing to train .* allowed: trainer.steps > 4"
    ):
        train_in_process(tmp_path / "y", *RESUME_SMALL, f"trainer.resume={small_run}")
    assert not (tmp_path / "y").exists()


def test_corrupted_newest_checkpoint_is_reported_and_the_previous_one_used(small_run, tmp_path, caplog):
    import shutil

    run_dir = tmp_path / "r"
    shutil.copytree(small_run, run_dir)
    payload = run_dir / "checkpoints" / "step_00000004" / "model_optim.pt"
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit-pattern, same size: only the CRC can tell
    payload.write_bytes(bytes(data))
    with caplog.at_level("WARNING", logger="trmoe"):
        train_in_process(run_dir, *RESUME_SMALL)
    assert "step_00000004 is unusable" in caplog.text and "CRC32 mismatch" in caplog.text
    assert (run_dir / "checkpoints" / "discarded_step_00000004").is_dir()
    assert_same_run(run_dir, small_run)

    truncated = run_dir / "checkpoints" / "step_00000004" / "rank_00000.pt"
    truncated.write_bytes(truncated.read_bytes()[:100])
    (run_dir / "checkpoints" / "discarded_step_00000004").rename(run_dir / "checkpoints" / "old")
    caplog.clear()
    with caplog.at_level("WARNING", logger="trmoe"):
        train_in_process(run_dir, *RESUME_SMALL)
    assert "truncated" in caplog.text
    assert_same_run(run_dir, small_run)


def test_a_run_whose_every_checkpoint_is_damaged_is_left_alone(small_run, tmp_path):
    """Not restarted from step 0 over its history: exit 2, nothing changed, the way out named."""
    import shutil

    run_dir = tmp_path / "r"
    shutil.copytree(small_run, run_dir)
    for payload in (run_dir / "checkpoints").glob("step_*/model_optim.pt"):
        payload.write_bytes(payload.read_bytes()[:100])
    before = tree_digest(run_dir)
    with pytest.raises(
        UserError, match="none of its 2 checkpoints verifies .* trainer.resume=never run.over"
    ):
        train_in_process(run_dir, *RESUME_SMALL, "trainer.steps=6")
    assert tree_digest(run_dir) == before


def test_a_relaunch_of_a_run_killed_after_its_final_checkpoint_marks_it_finished(small_run, tmp_path, caplog):
    import shutil

    from trmoe.run import status

    run_dir = tmp_path / "r"
    shutil.copytree(small_run, run_dir)
    final = json.loads((run_dir / "status.json").read_text())["final_eval_loss"]
    status.write_status(run_dir, status.RUNNING)  # as a kill between the last save and the status leaves it
    assert train_in_process(run_dir, *RESUME_SMALL) == final
    recorded = json.loads((run_dir / "status.json").read_text())
    assert recorded["status"] == "finished" and recorded["final_eval_loss"] == final
    # failed after its final checkpoint was saved (a tracker, closing a file): finished, and the log says so
    # (old code: "complete: nothing to do" while status.json and so the report kept "failed")
    status.write_status(run_dir, status.FAILED, error="OSError: the tracker could not close")
    with caplog.at_level("INFO", logger="trmoe"):
        train_in_process(run_dir, *RESUME_SMALL)
    assert json.loads((run_dir / "status.json").read_text())["status"] == "finished"
    assert "said failed (OSError: the tracker could not close)" in caplog.text


def test_a_resume_without_metrics_csv_is_recorded_and_reported(small_run, tmp_path):
    """Old code: the report said "Warnings: None" of a run whose metrics.csv lost every row before the
    resume."""
    import shutil

    run_dir = tmp_path / "r"
    shutil.copytree(small_run, run_dir)
    (run_dir / "metrics.csv").unlink()
    train_in_process(run_dir, *EXTEND)
    entry = json.loads((run_dir / "run_config.json").read_text())["resumes"][-1]
    kept, expected = entry["metrics_rows"]
    assert kept == 0 and expected > 0
    result = cli([str(run_dir), "--no-plots", "--quiet"], cwd=tmp_path, module="trmoe.report")
    assert result.returncode == 0, result.stderr
    warnings = (run_dir / "report.md").read_text().split("## Warnings", 1)[1].split("\n## ", 1)[0]
    assert f"resumed at step 4 with 0 of the {expected} metrics.csv rows before it" in warnings


def test_a_relaunch_of_a_run_a_guard_halted_at_its_last_step_stays_failed(small_run, tmp_path, caplog):
    """A guard's halt saves its checkpoint too: that one is no completed run (meta.json `halted`)."""
    import shutil

    from trmoe.run import status

    run_dir = tmp_path / "r"
    shutil.copytree(small_run, run_dir)
    meta_path = run_dir / "checkpoints" / "step_00000004" / "meta.json"
    meta = json.loads(meta_path.read_text())
    assert meta["halted"] is False  # what every save records
    meta_path.write_text(seal_meta({**meta, "halted": True}))  # as a guard's halt saves it
    status.write_status(run_dir, status.FAILED, error="RunFailed: stopped at step 4")
    with caplog.at_level("INFO", logger="trmoe"):
        train_in_process(run_dir, *RESUME_SMALL)
    assert json.loads((run_dir / "status.json").read_text())["status"] == "failed"
    assert "saved by the failure it records (RunFailed: stopped at step 4)" in caplog.text
    assert "is complete" not in caplog.text


# ------------------------------------------------------- damaged or foreign records: refused before writes

EXTEND = [
    *RESUME_SMALL,
    "trainer.steps=6",
    "optimizer.decay_steps=4",
]  # small_run extended, its horizon pinned


def _copy_run(small_run: Path, tmp_path: Path) -> Path:
    import shutil

    run_dir = tmp_path / "runs" / "r"
    shutil.copytree(small_run, run_dir)
    return run_dir


def _edit_meta(checkpoint: Path, edit) -> None:
    """meta.json after `edit` (which changes it in place), sealed again as a save seals it (a forgery of
    another trmoe's checkpoint, not a corruption)."""
    from trmoe.run.checkpoint import seal_meta

    meta = json.loads((checkpoint / "meta.json").read_text())
    edit(meta)
    (checkpoint / "meta.json").write_text(seal_meta(meta))


def _rename_a_tensor(checkpoint: Path) -> None:
    """The payload of another trmoe version: one model tensor under another name (meta.json's size and CRC32
    updated, so the checkpoint verifies)."""
    from trmoe.run.checkpoint import file_crc32

    payload = checkpoint / "model_optim.pt"
    state = torch.load(payload, weights_only=True)
    state["model"]["renamed"] = state["model"].pop(next(iter(state["model"])))
    torch.save(state, payload)
    _edit_meta(checkpoint, lambda meta: meta["files"].update({payload.name: file_crc32(payload)}))


def test_a_checkpoint_that_does_not_fit_the_model_is_refused_before_any_write(small_run, tmp_path):
    """The checkpoint's tensors as stored (not as its config says) are checked against the model before the
    run's records are touched: forced with a config this trmoe cannot rebuild, and not forced at all."""
    run_dir = _copy_run(small_run, tmp_path)
    newest = run_dir / "checkpoints" / "step_00000004"
    _edit_meta(newest, lambda meta: meta["config"]["model"].update(new_key=1))  # another trmoe's config
    before = tree_digest(run_dir)
    result = cli([*RESUME_BASE, *EXTEND, "model.shared_width=128", "trainer.force_resume=true"], cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("trmoe: ")]
    assert len(errors) == 1 and "Traceback" not in result.stderr
    assert "cannot change the model's tensors" in errors[0] and "nothing was changed" in errors[0]
    assert tree_digest(run_dir) == before
    _edit_meta(newest, lambda meta: meta["config"]["model"].pop("new_key"))  # the same config again
    _rename_a_tensor(newest)
    before = tree_digest(run_dir)
    with pytest.raises(
        UserError, match=r"does not fit this model: 2 tensors differ .*the checkpoint's .*, this run's"
    ):
        train_in_process(run_dir, *EXTEND)
    assert tree_digest(run_dir) == before


def test_a_run_config_json_that_is_no_object_is_ignored(small_run, tmp_path, caplog):
    """Valid JSON of another shape in run_config.json (or in its `resumes`) is read as no record."""
    run_dir = _copy_run(small_run, tmp_path)
    rc = json.loads((run_dir / "run_config.json").read_text())
    (run_dir / "run_config.json").write_text(json.dumps({**rc, "resumes": [5, "x", None]}))
    train_in_process(run_dir, *EXTEND)
    assert [r["mode"] for r in json.loads((run_dir / "run_config.json").read_text())["resumes"]] == ["resume"]
    (run_dir / "run_config.json").write_text("[1]")
    with caplog.at_level("WARNING", logger="trmoe"):
        train_in_process(run_dir, *RESUME_SMALL, "trainer.steps=8", "optimizer.decay_steps=4")
    assert load_checkpoint(run_dir)["step"] == 8
    assert "run_config.json is no readable JSON object: the history" in caplog.text
    # without a checkpoint, it is no record of the run: refused, nothing changed
    import shutil

    shutil.rmtree(run_dir / "checkpoints")
    (run_dir / "run_config.json").write_text("[1]")
    before = tree_digest(run_dir)
    with pytest.raises(UserError, match="neither a readable run_config.json nor a complete checkpoint"):
        train_in_process(run_dir, *RESUME_SMALL)
    assert tree_digest(run_dir) == before


def test_a_meta_json_of_another_shape_makes_the_checkpoint_unusable(small_run, tmp_path, caplog):
    """auto falls back to the previous checkpoint, as for a truncated payload; trainer.resume=<it> refuses
    it (exit 2) and leaves no run directory behind."""
    run_dir = _copy_run(small_run, tmp_path)
    newest = run_dir / "checkpoints" / "step_00000004"
    (newest / "meta.json").write_text("null")
    with pytest.raises(UserError, match=r"trainer.resume=.*step_00000004: .*meta.json is not a trmoe"):
        train_in_process(tmp_path / "new", *RESUME_SMALL, f"trainer.resume={newest}")
    assert not (tmp_path / "new").exists()
    with caplog.at_level("WARNING", logger="trmoe"):
        train_in_process(run_dir, *RESUME_SMALL)
    assert "step_00000004 is unusable" in caplog.text
    assert_same_run(run_dir, small_run)


@pytest.mark.parametrize(
    "name,content",
    [("metrics.csv", b"\xff\xfe\x00x\n"), ("metrics.csv", None), ("telemetry.csv", b"\xff\xfe\x00x\n")],
    ids=["metrics-binary", "metrics-directory", "telemetry-binary"],
)
def test_unreadable_step_records_are_refused_before_any_write(small_run, tmp_path, name, content):
    run_dir = _copy_run(small_run, tmp_path)
    if content is None:
        (run_dir / name).unlink()
        (run_dir / name).mkdir()
        (run_dir / name / "kept.txt").write_text("a user's file")
    else:
        (run_dir / name).write_bytes(content)
    before = tree_digest(run_dir)
    with pytest.raises(UserError, match=f"{name} is unreadable .*; move it aside") as err:
        train_in_process(run_dir, *EXTEND)
    assert len(str(err.value).splitlines()) == 1
    assert tree_digest(run_dir) == before and (run_dir / name).exists()
    with pytest.raises(UserError, match=f"{name} is unreadable"):  # continuing its checkpoint elsewhere
        train_in_process(tmp_path / "new", *EXTEND, f"trainer.resume={run_dir / 'checkpoints'}")
    assert not (tmp_path / "new").exists()


def test_trainer_steps_below_the_checkpoint_is_named_first(small_run):
    """Not the schedule check's advice to pin the schedule of the steps done (here the warmup changes too),
    which, followed, would only lead to this error."""
    before = tree_digest(small_run)
    with pytest.raises(UserError, match=r"trainer.steps=2: the checkpoint .* is at step 4; allowed: >= 4"):
        train_in_process(small_run, *RESUME_SMALL, "trainer.steps=2", "optimizer.warmup_steps=1")
    assert tree_digest(small_run) == before


@pytest.mark.parametrize("where", ["checkpoints", "checkpoints/latest"])
def test_a_checkpoints_dir_or_latest_pointer_of_the_wrong_kind_is_refused_at_launch(tmp_path, where):
    """checkpoints/ replaced by a file (every save would fail after the whole run trained) and `latest`
    replaced by a directory (its one line misnamed the checkpoint): one line naming the path, exit 2, before
    a step is trained."""
    run_dir = tmp_path / "runs" / "r"
    if where == "checkpoints":
        run_dir.mkdir(parents=True)
        (run_dir / where).write_text("not a directory")
    else:
        (run_dir / where).mkdir(parents=True)
    out = cli([*RANDOM_IDS_CPU, "trainer.steps=2", "run.name=r"], tmp_path)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-3000:]
    assert f"{where}: not a " in lines[0] and "Traceback" not in out.stderr
    assert not (run_dir / "metrics.csv").exists()


@pytest.mark.subprocess
def test_a_sigkilled_launch_is_never_left_running(tmp_path):
    """A SIGKILL leaves status.json saying `running` (nothing can be written); once the launch has ended,
    its lock is free (the kernel released it) and every reader of the status sees `killed`, and the file
    is rewritten so; while a live process holds the lock, `running` stays."""
    import signal

    from helpers import drive, start

    from trmoe.run import status

    killed = drive("step:3:after", tmp_path, *RESUME_BASE)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    run_dir = tmp_path / "runs" / "r"
    left = json.loads((run_dir / "status.json").read_text())
    assert left["status"] == "running" and (run_dir / ".lock").is_file()  # the dead holder's file
    record = status.read_status(run_dir)
    assert record["status"] == "killed" and record["running_since"] == left["time"]
    assert "a rerun resumes from its newest complete checkpoint" in record["error"]
    assert json.loads((run_dir / "status.json").read_text())["status"] == "killed"

    # a live holder (another process) keeps `running` running; its SIGKILL ends it
    status.write_status(run_dir, status.RUNNING)
    holder = start(
        "-c",
        "import sys, time; from trmoe.run.lock import RunLock\n"
        f"with RunLock({str(run_dir)!r}):\n    print('held', flush=True); time.sleep(300)",
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert status.read_status(run_dir)["status"] == "running"
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
    assert holder.returncode == -signal.SIGKILL
    assert status.read_status(run_dir)["status"] == "killed"
