"""Fault guards (docs/reliability.md): non-finite steps skipped, loss spikes rolled back or logged, a full
disk during a save keeps the previous checkpoint."""

from __future__ import annotations

import csv
import os

import pytest
import torch
from helpers import assert_latest_sane, metrics_rows, train_in_process
from presets import RESUME_SMALL

from trmoe.errors import RunFailed
from trmoe.run.checkpoint import load_checkpoint, read_pointer
from trmoe.train import guards

# ----------------------------------------------------------------------------------------- guards


class _ScaleGradient(torch.autograd.Function):
    """Identity forward, gradient x factor backward: a fault in the gradient behind a finite loss."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def _inject(
    monkeypatch, *, at: set[int], factor: float, once: bool = False, gradient_only: bool = False
) -> None:
    """Multiply the loss of the steps in `at` by `factor` (NaN, or a spike) inside this process; with
    `gradient_only`, only its gradient (the logged losses stay finite)."""
    from trmoe.train.objective import Objective
    from trmoe.train.scheduler import Scheduler

    begin, loss = Scheduler.begin_step, Objective.loss
    seen = {"step": 0, "hit": set()}

    def begin_step(self, step):
        seen["step"] = step
        return begin(self, step)

    def faulty_loss(self, hidden, targets):
        sums = loss(self, hidden, targets)
        step = seen["step"]
        if step in at and not (once and step in seen["hit"]):
            seen["hit"].add(step)
            if gradient_only:
                return type(sums)(_ScaleGradient.apply(sums.total, factor), sums.ce, sums.z, sums.tokens)
            return type(sums)(sums.total * factor, sums.ce * factor, sums.z, sums.tokens)
        return sums

    monkeypatch.setattr(Scheduler, "begin_step", begin_step)
    monkeypatch.setattr(Objective, "loss", faulty_loss)


GUARDED = [
    "trainer.steps=12",
    "trainer.log_every=4",
    "trainer.eval_every=6",
    "checkpoint.every_steps=1",
    "checkpoint.keep_last=0",
]


@pytest.mark.parametrize("gradient_only", [False, True], ids=["nan-loss", "nan-gradient-finite-loss"])
def test_nonfinite_step_is_skipped_without_touching_weights_or_optimizer(
    monkeypatch, tmp_path, gradient_only
):
    _inject(monkeypatch, at={6}, factor=float("nan"), gradient_only=gradient_only)
    run_dir = tmp_path / "r"
    train_in_process(run_dir, *GUARDED)
    ckpts = run_dir / "checkpoints"
    five, six = load_checkpoint(ckpts / "step_00000005"), load_checkpoint(ckpts / "step_00000006")
    for key in five["model"]:
        assert torch.equal(five["model"][key], six["model"][key]), key
    for index, state in five["optimizer"]["state"].items():
        for name, value in state.items():
            assert torch.equal(six["optimizer"]["state"][index][name], value)
    rows = {int(r["step"]): r for r in metrics_rows(run_dir)}
    assert rows[4]["skipped_steps"] == "0" and rows[8]["skipped_steps"] == "1"
    assert all(r["train_loss"] != "nan" for s, r in rows.items() if s > 0)
    assert load_checkpoint(run_dir)["step"] == 12


def test_spike_rollback_recomputes_and_skips_the_offending_batch(monkeypatch, tmp_path):
    """A transient x10 loss at step 7 (a silent-data-corruption-like fault): policy rollback reloads the
    step-5 checkpoint, recomputes step 6, skips batch 7 and goes on. The result equals a run that simply
    skipped batch 7 (here: NaN at step 7), bit for bit."""
    spike = [*GUARDED, "checkpoint.every_steps=5", "guard.spike_factor=2", "guard.spike_window=3"]
    spike += ["guard.spike_policy=rollback", "telemetry.moe=true"]
    reference = tmp_path / "skip7"
    with monkeypatch.context() as m:
        _inject(m, at={7}, factor=float("nan"))
        train_in_process(reference, *spike)
    _inject(monkeypatch, at={7}, factor=10.0, once=True)
    run_dir = tmp_path / "rollback"
    train_in_process(run_dir, *spike)
    log = (run_dir / "train.log").read_text()
    assert "step 7: loss spike" in log and "rolled back to step_00000005" in log
    assert "rolled back to step_00000005: step 6 is recomputed, batch 7 is skipped" in log
    a, b = load_checkpoint(run_dir), load_checkpoint(reference)
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    rows_a, rows_b = metrics_rows(run_dir), metrics_rows(reference)
    assert [r["step"] for r in rows_a] == [r["step"] for r in rows_b]  # rows after step 5 were rewritten once
    for ra, rb in zip(rows_a, rows_b, strict=True):
        for column in ("train_loss", "train_objective", "eval_loss", "lr", "grad_norm", "skipped_steps"):
            assert ra[column] == rb[column], (ra["step"], column)
    assert rows_a[-1]["loss_spikes"] == "1" and rows_b[-1]["loss_spikes"] == "0"
    # telemetry.csv is rewound with metrics.csv: one row per layer per logged step, the replayed ones once
    with open(run_dir / "telemetry.csv") as f:
        keys = [(int(r["step"]), int(r["layer"])) for r in csv.DictReader(f)]
    assert keys == [(int(r["step"]), layer) for r in rows_a[1:] for layer in (0, 1)]

    # Killed after the rollback, before its next checkpoint (step 10): the resume from step 5 must still
    # skip batch 7 (the rollback re-saved step 5 with it in its train state), bit for bit as above.
    import shutil

    killed = tmp_path / "killed"
    shutil.copytree(run_dir, killed)
    for step in (10, 12):
        shutil.rmtree(killed / "checkpoints" / f"step_{step:08d}")
    (killed / "checkpoints" / "latest").write_text("step_00000005\n")
    train_in_process(killed, *spike)  # the fault does not recur (once): only the train state can skip 7
    c = load_checkpoint(killed)
    assert all(torch.equal(c["model"][key], a["model"][key]) for key in a["model"])

    # Continued from step 0 in another directory: the rollback there needs a checkpoint of its own
    _inject(monkeypatch, at={7}, factor=10.0, once=True)
    elsewhere = tmp_path / "elsewhere"
    train_in_process(elsewhere, *spike, f"trainer.resume={run_dir / 'checkpoints' / 'step_00000000'}")
    assert "rolled back to step_00000005" in (elsewhere / "train.log").read_text()
    d = load_checkpoint(elsewhere)
    assert all(torch.equal(d["model"][key], a["model"][key]) for key in a["model"])


def test_persistent_spikes_stop_after_max_rollbacks(monkeypatch, tmp_path):
    _inject(monkeypatch, at=set(range(7, 13)), factor=10.0)
    overrides = [*GUARDED, "checkpoint.every_steps=2", "guard.spike_factor=2", "guard.spike_window=3"]
    with pytest.raises(RunFailed, match="guard.max_rollbacks=2 reached"):
        train_in_process(tmp_path / "r", *overrides, "guard.spike_policy=rollback", "guard.max_rollbacks=2")


def test_spike_policy_log_counts_and_applies(monkeypatch, tmp_path):
    _inject(monkeypatch, at={7}, factor=10.0)
    run_dir = tmp_path / "r"
    train_in_process(run_dir, *GUARDED, "guard.spike_factor=2", "guard.spike_window=3")
    rows = {int(r["step"]): r for r in metrics_rows(run_dir)}
    assert rows[4]["loss_spikes"] == "0" and rows[8]["loss_spikes"] == "1" and rows[8]["skipped_steps"] == "0"
    assert "step 7: loss spike" in (run_dir / "train.log").read_text()


# ---------------------------------------------------------------------------------- disk full


def test_out_of_disk_during_a_save_keeps_the_previous_checkpoint(monkeypatch, tmp_path, caplog):
    """ENOSPC raised by the checkpoint writer part-way through a checkpoint. A real full disk cannot be made
    safely here (no private tmpfs), so the writer is monkeypatched to fail as the kernel would:
    OSError(ENOSPC) after some bytes. The run reports it, keeps the previous checkpoint and goes on; a
    failing final checkpoint fails the run (RunFailed: exit 3) with the previous one still valid."""
    import errno

    import trmoe.run.checkpoint as ckpt

    write, save = ckpt._ChecksumWriter.write, ckpt.CheckpointStore.save
    state = {"saving": None, "fail_at": 3}

    def tracked_save(self, step, **kwargs):
        state["saving"] = step
        return save(self, step, **kwargs)

    def full_disk(self, data):
        if state["saving"] == state["fail_at"] and self.bytes > 100_000:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write(self, data)

    monkeypatch.setattr(ckpt.CheckpointStore, "save", tracked_save)
    monkeypatch.setattr(ckpt._ChecksumWriter, "write", full_disk)
    run_dir = tmp_path / "r"
    with caplog.at_level("ERROR", logger="trmoe"):
        train_in_process(run_dir, *RESUME_SMALL, "checkpoint.every_steps=1", "checkpoint.keep_last=1")
    assert "checkpoint at step 3 failed: [Errno 28] No space left on device" in caplog.text
    assert "the newest complete checkpoint is still step_00000002" in caplog.text
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == ["latest", "step_00000004"]  # no temporary left; step 2 was pruned after step 4
    assert_latest_sane(run_dir)

    state["fail_at"] = 4  # the final checkpoint
    final = tmp_path / "final"
    with pytest.raises(RunFailed, match="final checkpoint could not be written"):
        train_in_process(final, *RESUME_SMALL, "checkpoint.every_steps=1")
    assert read_pointer(final / "checkpoints") == "step_00000003"
    assert sorted(p.name for p in (final / "checkpoints").iterdir()) == [
        "latest",
        "step_00000002",
        "step_00000003",
    ]
    assert_latest_sane(final)


def test_the_rollback_message_never_names_an_empty_or_reversed_range():
    assert guards.rollback_note(3, 4) == "no step is recomputed, batch 4 is skipped"  # was "steps 4..3"
    assert guards.rollback_note(5, 7) == "step 6 is recomputed, batch 7 is skipped"
    assert guards.rollback_note(5, 9) == "steps 6..8 are recomputed, batch 9 is skipped"
