"""Resume you can trust (docs/reliability.md): kill -9 anywhere -> bit-exact resume; SIGUSR2/SIGTERM -> a
clean save and the requeue exit status; the resume config check; run directories never overwritten.

The killed runs go through the real app in subprocesses (tests/resume_driver.py = `python -m trmoe.train`
plus one deterministic fault such as SIGKILL half-way through a checkpoint write); they run concurrently,
and each is resumed in-process and compared with one uninterrupted baseline: final weights, optimizer
state and every metrics.csv column but tok_s and elapsed_s must be identical."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import TIMING_COLUMNS, compose_config, run_cli

from trmoe.errors import RunFailed, UserError
from trmoe.train.checkpoint import CheckpointStore, load_checkpoint, read_pointer
from trmoe.train.loop import train
from trmoe.train.resume import compare, critical_hash, is_volatile, training_view

DRIVER = Path(__file__).with_name("resume_driver.py")
BASE = [
    "data=random",
    "model.vocab_size=512",
    "trainer.micro_batch=4",
    "trainer.seq_len=64",
    "optimizer.lr=3e-3",
    "optimizer.warmup_steps=3",
    "trainer.eval_batches=2",
    "hardware=cpu",
    "hardware.threads=1",  # the same thread count in every process: CPU results are then bit-identical
    "run.progress=log",
    "run.name=r",
    "trainer.steps=20",
    "trainer.log_every=3",  # rows at 1, 3, 5, 6, 9, ...: windows straddle checkpoints (every 4)
    "trainer.eval_every=5",
    "checkpoint.every_steps=4",
    "checkpoint.keep_last=2",
]

# (fault injected by tests/resume_driver.py, what the rerun must do: "restart" or the checkpoint step)
KILLS = [
    ("step:1:forward", "restart"),  # before any checkpoint: the same run starts again from step 0
    ("step:3:after", "restart"),
    ("save:4:payload", "restart"),  # the first checkpoint half-written
    ("step:6:forward", 4),
    ("step:10:after", 8),  # rows 9 and 10 of the killed attempt are dropped and rewritten
    ("save:8:rank", 4),
    ("save:8:meta", 4),  # meta.json written, directory not renamed: not a checkpoint
    ("save:12:rename", 12),  # complete but `latest` not updated yet: still the newest checkpoint
    ("save:12:pointer", 12),
    ("save:16:prune", 16),  # killed while deleting step 8
    ("eval:15", 12),
    ("step:20:forward", 16),
    ("save:20:payload", 16),  # the final checkpoint half-written
]
SIGNALS = [("signal:7:USR2", signal.SIGUSR2, 7), ("signal:9:TERM", signal.SIGTERM, 9)]


@pytest.fixture(autouse=True)
def _keep_thread_count():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _rows(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.csv") as f:
        return list(csv.DictReader(f))


def _drive(fault: str, cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    cwd.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, str(DRIVER), fault, *BASE, *overrides],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _train_in_process(run_dir: Path, *overrides: str) -> float:
    threads = torch.get_num_threads()
    try:
        return train(compose_config(*BASE, *overrides), run_dir)
    finally:
        torch.set_num_threads(threads)


def assert_latest_sane(run_dir: Path) -> None:
    """`latest` is absent or names a checkpoint that verifies (size and CRC32 of every file)."""
    directory = run_dir / "checkpoints"
    name = read_pointer(directory)
    if name is not None:
        CheckpointStore(directory).verify(directory / name)


def assert_same_run(run_dir: Path, baseline: Path) -> None:
    a, b = load_checkpoint(run_dir), load_checkpoint(baseline)
    assert a["step"] == b["step"]
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    state_a, state_b = a["optimizer"]["state"], b["optimizer"]["state"]
    assert state_a.keys() == state_b.keys()
    for index in state_a:
        for name, value in state_a[index].items():
            assert torch.equal(value, state_b[index][name]), (index, name)
    rows_a, rows_b = _rows(run_dir), _rows(baseline)
    assert [r["step"] for r in rows_a] == [r["step"] for r in rows_b]
    for ra, rb in zip(rows_a, rows_b, strict=True):
        for column in ra:
            if column not in TIMING_COLUMNS:
                assert ra[column] == rb[column], (ra["step"], column)
    leftovers = [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]
    assert leftovers == []


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("baseline") / "r"
    _train_in_process(run_dir)
    return run_dir


@pytest.fixture(scope="module")
def faulted(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """Every driver run of this module, concurrently (each is mostly interpreter start-up)."""
    root = tmp_path_factory.mktemp("faults")
    jobs = [(fault, ()) for fault, _ in KILLS] + [(fault, ()) for fault, _, _ in SIGNALS]
    jobs.append(("nan:5:100", ("guard.max_skips=3",)))

    def run(job):
        fault, extra = job
        cwd = root / fault.replace(":", "_")
        return fault, (_drive(fault, cwd, *extra), cwd / "runs" / "r")

    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(pool.map(run, jobs))


@pytest.mark.parametrize("fault,expected", KILLS, ids=[k for k, _ in KILLS])
def test_kill_9_anywhere_then_resume_is_bit_exact(fault, expected, faulted, baseline):
    proc, run_dir = faulted[fault]
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert_latest_sane(run_dir)
    before = (run_dir / "train.log").read_text()
    _train_in_process(run_dir)
    log = (run_dir / "train.log").read_text()[len(before) :]
    if expected == "restart":
        assert "=== restart from step 0" in log
    else:
        assert f"=== resume from step {expected} " in log
    assert_same_run(run_dir, baseline)
    assert_latest_sane(run_dir)
    rc = json.loads((run_dir / "run_config.json").read_text())
    assert [r["mode"] for r in rc["resumes"]] == ["restart" if expected == "restart" else "resume"]
    assert rc["force_resumed"] is False


@pytest.mark.parametrize("fault,signum,step", SIGNALS, ids=[s for s, _, _ in SIGNALS])
def test_stop_signal_saves_at_the_step_boundary_and_exits_for_requeue(fault, signum, step, faulted, baseline):
    proc, run_dir = faulted[fault]
    assert proc.returncode == 128 + signum, proc.stderr[-3000:]
    assert f"stopped at step {step} on {signal.Signals(signum).name}" in proc.stderr
    assert read_pointer(run_dir / "checkpoints") == f"step_{step:08d}"
    assert_latest_sane(run_dir)
    assert json.loads((run_dir / "status.json").read_text())["status"] == "preempted"
    assert int(_rows(run_dir)[-1]["step"]) <= step
    _train_in_process(run_dir)
    assert_same_run(run_dir, baseline)


def test_nonfinite_steps_stop_the_run_with_exit_3_and_a_good_checkpoint(faulted):
    """NaN from step 5 on: steps 5, 6, 7 are skipped, then guard.max_skips=3 stops the run (exit 3) with a
    checkpoint at step 7 whose weights and optimizer state are those after step 4."""
    proc, run_dir = faulted["nan:5:100"]
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "stopped at step 7: 3 consecutive steps had a non-finite loss" in proc.stderr
    last = load_checkpoint(run_dir)
    assert last["step"] == 7
    assert _rows(run_dir)[-1]["step"] == "7" and _rows(run_dir)[-1]["skipped_steps"] == "3"
    good = load_checkpoint(run_dir / "checkpoints" / "step_00000004")
    for key in good["model"]:
        assert torch.equal(last["model"][key], good["model"][key]), key
    for index, state in good["optimizer"]["state"].items():
        for name, value in state.items():
            assert torch.equal(last["optimizer"]["state"][index][name], value)


def test_kill_9_twice_then_resume_is_bit_exact(tmp_path, baseline):
    first = _drive("step:6:forward", tmp_path)
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    second = _drive("save:12:meta", tmp_path)  # the resumed attempt dies too, inside a checkpoint write
    assert second.returncode == -signal.SIGKILL, second.stderr[-3000:]
    run_dir = tmp_path / "runs" / "r"
    assert_latest_sane(run_dir)
    _train_in_process(run_dir)
    assert_same_run(run_dir, baseline)
    rc = json.loads((run_dir / "run_config.json").read_text())
    assert [r["from_step"] for r in rc["resumes"]] == [4, 8]


@pytest.fixture(scope="module")
def baseline_every_row(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("baseline_every_row") / "r"
    _train_in_process(run_dir, "trainer.log_every=1")
    return run_dir


def _wait_for_rows(metrics_glob, cwd: Path, rows: int, proc: subprocess.Popen) -> Path | None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        for metrics in cwd.glob(metrics_glob):
            if metrics.read_text().count("\n") >= rows + 1:  # + the header
                return metrics
        time.sleep(0.005)
    return None


def test_kill_9_from_outside_at_a_random_moment(tmp_path, baseline_every_row):
    """The plain CLI killed by another process at whatever instant it has reached (not chosen)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "trmoe.train", *BASE, "trainer.log_every=1"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for_rows("runs/r/metrics.csv", tmp_path, 9, proc)  # step 0 + 8 steps
    proc.kill()
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "finished before the kill: " + proc.stderr.read()[-2000:]
    run_dir = tmp_path / "runs" / "r"
    assert_latest_sane(run_dir)
    _train_in_process(run_dir, "trainer.log_every=1")
    assert_same_run(run_dir, baseline_every_row)


def _descendants(pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids = (task / "children").read_text().split()
        children += [int(k) for k in kids]
    return [d for c in children for d in (c, *_descendants(c))]


def test_submitit_requeue_resumes_the_job(tmp_path, baseline_every_row):
    """hydra-submitit-launcher (local executor, a real submitit job): SIGUSR2 to the job's process ->
    trmoe saves at the step boundary and hands the signal to submitit's handler, which pickles the job
    again and requeues it (the local executor reruns it on exit code 144, as SLURM does after
    `scontrol requeue`); the rerun resumes from the checkpoint. One job directory, every step once, and
    the result of the uninterrupted run."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    args = [*BASE, "trainer.log_every=1", "checkpoint.every_steps=1000"]  # only the signal saves mid-run
    proc = subprocess.Popen(
        [sys.executable, "-m", "trmoe.train", "--multirun", "hydra/launcher=submitit_local", *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        metrics = _wait_for_rows("multirun/*/*/0/metrics.csv", tmp_path, 6, proc)
        assert metrics is not None, proc.communicate()[0][-3000:]
        jobs = [
            pid
            for pid in _descendants(proc.pid)
            if "submitit.core._submit" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
        ]
        assert len(jobs) == 1, jobs
        os.kill(jobs[0], signal.SIGUSR2)
        output = proc.communicate(timeout=300)[0]
    finally:
        proc.kill()
    assert proc.returncode == 0, output[-3000:]
    job_dirs = [p.parent for p in tmp_path.glob("multirun/*/*/*/run_config.json")]
    assert job_dirs == [metrics.parent]  # the requeued job found its own directory again
    run_dir = metrics.parent
    logs = "".join(p.read_text() for p in (run_dir.parent / ".submitit").rglob("*_log.*"))
    assert "Requeued job" in logs and "Caught signal SIGUSR2" in logs
    rc = json.loads((run_dir / "run_config.json").read_text())
    assert [r["mode"] for r in rc["resumes"]] == ["resume"] and rc["resumes"][0]["from_step"] >= 6
    assert json.loads((run_dir / "status.json").read_text())["status"] == "finished"
    assert_same_run(run_dir, baseline_every_row)


# ------------------------------------------------------------------------- resume config comparison

SMALL = ["trainer.steps=4", "checkpoint.every_steps=2", "trainer.log_every=1", "trainer.eval_every=2"]


def _tree_digest(path: Path) -> dict[str, str]:
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def small_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("small") / "r"
    _train_in_process(run_dir, *SMALL)
    return run_dir


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
]


@pytest.mark.parametrize("overrides,key", MISMATCHES, ids=[k for _, k in MISMATCHES])
def test_training_critical_change_is_refused_with_a_diff_before_any_write(small_run, overrides, key):
    before = _tree_digest(small_run)
    with pytest.raises(UserError, match="resume config mismatch") as err:
        _train_in_process(small_run, *SMALL, *overrides)
    message = str(err.value)
    line = next(line for line in message.splitlines() if line.strip().startswith(key + " "))
    assert " -> " in line
    assert "trainer.force_resume=true" in message
    assert _tree_digest(small_run) == before


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


def test_mismatch_exits_2_from_the_cli(small_run, tmp_path):
    run_dir = tmp_path / "runs" / "r"
    run_dir.parent.mkdir()
    os.symlink(small_run, run_dir)
    before = _tree_digest(small_run)
    result = run_cli([*BASE, *SMALL, "optimizer.lr=1e-2"], cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "optimizer.lr" in result.stderr and "0.003 -> 0.01" in result.stderr
    assert _tree_digest(small_run) == before


def test_volatile_changes_resume_and_are_recorded(small_run, tmp_path, caplog):
    """Cadences, the run name and how the global batch is split may change; trainer.steps too when the
    schedules' past stays the same. A changed horizon that would bend the past LR is refused."""
    import shutil

    run_dir = tmp_path / "r"
    shutil.copytree(small_run, run_dir)
    before = _tree_digest(run_dir)
    with pytest.raises(UserError, match="schedules: lr_mult at step 4 would change"):
        _train_in_process(run_dir, *SMALL, "trainer.steps=8")  # the cosine horizon moves: refused
    assert _tree_digest(run_dir) == before
    (run_dir / "checkpoints" / "step_00000004").rename(run_dir / "checkpoints" / "gone")
    caplog.set_level("WARNING", logger="trmoe")
    _train_in_process(
        run_dir,
        *SMALL,
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
    pinned (optimizer.decay_steps=4; warmup is pinned in BASE) the past is unchanged and the run goes on,
    at the LR floor, without force_resume."""
    import shutil

    run_dir = tmp_path / "r"
    shutil.copytree(small_run, run_dir)
    _train_in_process(run_dir, *SMALL, "trainer.steps=6", "optimizer.decay_steps=4")
    rc = json.loads((run_dir / "run_config.json").read_text())
    assert rc["force_resumed"] is False and rc["resumes"][-1]["volatile_changes"][
        "optimizer.decay_steps"
    ] == [
        None,
        4,
    ]
    rows = _rows(run_dir)
    assert [r["step"] for r in rows[:5]] == [r["step"] for r in _rows(small_run)]
    assert float(rows[-1]["lr"]) == pytest.approx(3e-3 * rc["config"]["optimizer"]["min_lr_ratio"])
    with pytest.raises(UserError, match="lr_mult at step 4 would change"):  # a pin that bends the past
        _train_in_process(run_dir, *SMALL, "trainer.steps=8", "optimizer.decay_steps=5")


def test_force_resume_continues_and_is_recorded(small_run, tmp_path):
    import shutil

    run_dir = tmp_path / "r"
    shutil.copytree(small_run, run_dir)
    before = _tree_digest(run_dir)
    with pytest.raises(UserError, match="cannot change the model's tensors"):  # not even with force
        _train_in_process(run_dir, *SMALL, "model.shared_width=128", "trainer.force_resume=true")
    # nor how the optimizer groups them: its saved state loads group by group (a scheduled gate leaves it)
    for change in ("model.shared_gate_final=0.5", "optimizer.decay_embedding=true", "optimizer=stosignsgd"):
        with pytest.raises(UserError, match="cannot change how the optimizer groups the parameters"):
            _train_in_process(run_dir, *SMALL, change, "trainer.force_resume=true")
    # nor the tokens per step: the steps already run read their samples and counted tokens by it
    with pytest.raises(UserError, match=r"cannot change the tokens per step \(256 -> 512"):
        _train_in_process(run_dir, *SMALL, "trainer.micro_batch=8", "trainer.force_resume=true")
    with pytest.raises(UserError) as refused:  # so the first refusal does not suggest force_resume
        _train_in_process(run_dir, *SMALL, "trainer.micro_batch=8")
    assert "cannot change even with trainer.force_resume=true" in str(refused.value)
    assert "to continue anyway" not in str(refused.value)
    assert _tree_digest(run_dir) == before
    _train_in_process(
        run_dir,
        *SMALL,
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
    assert [int(r["step"]) for r in _rows(run_dir)] == [0, 1, 2, 3, 4, 5, 6]
    # the forced values are what trained steps 5 and 6 (not the checkpoint's), as run_config.json says
    groups = state["optimizer"]["param_groups"]
    assert {g["base_lr"] for g in groups} == {6e-3} and {g["weight_decay"] for g in groups} == {0.0, 0.5}
    assert {g["base_lr"] for g in rc["controls"]["optimizer_groups"]} == {6e-3}
    floor = 6e-3 * rc["config"]["optimizer"]["min_lr_ratio"]  # past decay_steps=4: 6e-4, not 3e-4
    assert [float(r["lr"]) for r in _rows(run_dir)[5:]] == pytest.approx([floor, floor])


# ------------------------------------------------------------------------------ the run directory


def test_run_directory_is_never_overwritten_without_run_overwrite(small_run, tmp_path):
    import shutil

    run_dir = tmp_path / "r"
    shutil.copytree(small_run, run_dir)
    before = _tree_digest(run_dir)
    with pytest.raises(UserError, match="already holds a run"):
        _train_in_process(run_dir, *SMALL, "trainer.resume=never")
    # a different experiment in a directory without a checkpoint is refused too
    shutil.rmtree(run_dir / "checkpoints")
    with pytest.raises(UserError, match="holds a different run and no complete checkpoint"):
        _train_in_process(run_dir, *SMALL, "trainer.seed=3")
    with pytest.raises(UserError, match="already holds a run"):
        _train_in_process(run_dir, *SMALL, "trainer.seed=3", "trainer.resume=never")
    assert {k: v for k, v in _tree_digest(run_dir).items() if not k.startswith("checkpoints")} == {
        k: v for k, v in before.items() if not k.startswith("checkpoints")
    }
    # only resume=never with run.overwrite=true replaces it, the other ranks' logs of a distributed run too
    (run_dir / "logs").mkdir()
    (run_dir / "logs" / "rank_1.log").write_text("the replaced run's rank 1\n")
    _train_in_process(run_dir, *SMALL, "trainer.seed=3", "trainer.resume=never", "run.overwrite=true")
    rc = json.loads((run_dir / "run_config.json").read_text())
    assert rc["config"]["trainer"]["seed"] == 3 and rc["resumes"] == []
    assert not (run_dir / "logs").exists()
    assert [int(r["step"]) for r in _rows(run_dir)] == [0, 1, 2, 3, 4]


def test_resume_from_a_path_continues_another_runs_checkpoint(small_run, tmp_path):
    """trainer.resume=<checkpoint> into a new run directory: metrics up to the checkpoint are carried over
    and the result equals the uninterrupted run."""
    import shutil

    source = tmp_path / "source"
    shutil.copytree(small_run, source)
    ckpt = source / "checkpoints" / "step_00000002"
    new = tmp_path / "fork"
    _train_in_process(new, *SMALL, f"trainer.resume={ckpt}")
    assert_same_run(new, small_run)
    rc = json.loads((new / "run_config.json").read_text())
    assert rc["resumes"][-1]["checkpoint"] == str(ckpt.resolve())
    with pytest.raises(UserError, match="already holds a run"):  # another starting point: refused
        _train_in_process(new, *SMALL, f"trainer.resume={small_run / 'checkpoints' / 'step_00000004'}")
    with pytest.raises(UserError, match="no such|holds no checkpoint"):
        _train_in_process(tmp_path / "x", *SMALL, f"trainer.resume={tmp_path / 'nowhere'}")
    # the same command again, as a requeued job relaunches it: the fork goes on from its own checkpoint
    # (here its last: nothing to do), never back to the one it started from, even once that is gone
    shutil.rmtree(ckpt)
    before = _tree_digest(new)
    _train_in_process(new, *SMALL, f"trainer.resume={ckpt}")
    assert _tree_digest(new) == before and load_checkpoint(new)["step"] == 4
    # the other run's last step: nothing to train here (not "complete", which this directory never was)
    with pytest.raises(
        UserError, match="at step 4 = trainer.steps: nothing to train .* allowed: trainer.steps > 4"
    ):
        _train_in_process(tmp_path / "y", *SMALL, f"trainer.resume={small_run}")
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
        _train_in_process(run_dir, *SMALL)
    assert "step_00000004 is unusable" in caplog.text and "CRC32 mismatch" in caplog.text
    assert (run_dir / "checkpoints" / "discarded_step_00000004").is_dir()
    assert_same_run(run_dir, small_run)

    truncated = run_dir / "checkpoints" / "step_00000004" / "rank_00000.pt"
    truncated.write_bytes(truncated.read_bytes()[:100])
    (run_dir / "checkpoints" / "discarded_step_00000004").rename(run_dir / "checkpoints" / "old")
    caplog.clear()
    with caplog.at_level("WARNING", logger="trmoe"):
        _train_in_process(run_dir, *SMALL)
    assert "truncated" in caplog.text
    assert_same_run(run_dir, small_run)


def test_a_run_whose_every_checkpoint_is_damaged_is_left_alone(small_run, tmp_path):
    """Not restarted from step 0 over its history: exit 2, nothing changed, the way out named."""
    import shutil

    run_dir = tmp_path / "r"
    shutil.copytree(small_run, run_dir)
    for payload in (run_dir / "checkpoints").glob("step_*/model_optim.pt"):
        payload.write_bytes(payload.read_bytes()[:100])
    before = _tree_digest(run_dir)
    with pytest.raises(
        UserError, match="none of its 2 checkpoints verifies .* trainer.resume=never run.over"
    ):
        _train_in_process(run_dir, *SMALL, "trainer.steps=6")
    assert _tree_digest(run_dir) == before


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
    from trmoe.train.controls import TrainingControls

    begin, loss = TrainingControls.begin_step, TrainingControls.loss
    seen = {"step": 0, "hit": set()}

    def begin_step(self, step, optimizer):
        seen["step"] = step
        return begin(self, step, optimizer)

    def faulty_loss(self, hidden, targets):
        sums = loss(self, hidden, targets)
        step = seen["step"]
        if step in at and not (once and step in seen["hit"]):
            seen["hit"].add(step)
            if gradient_only:
                return type(sums)(_ScaleGradient.apply(sums.total, factor), sums.ce, sums.z, sums.tokens)
            return type(sums)(sums.total * factor, sums.ce * factor, sums.z, sums.tokens)
        return sums

    monkeypatch.setattr(TrainingControls, "begin_step", begin_step)
    monkeypatch.setattr(TrainingControls, "loss", faulty_loss)


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
    _train_in_process(run_dir, *GUARDED)
    ckpts = run_dir / "checkpoints"
    five, six = load_checkpoint(ckpts / "step_00000005"), load_checkpoint(ckpts / "step_00000006")
    for key in five["model"]:
        assert torch.equal(five["model"][key], six["model"][key]), key
    for index, state in five["optimizer"]["state"].items():
        for name, value in state.items():
            assert torch.equal(six["optimizer"]["state"][index][name], value)
    rows = {int(r["step"]): r for r in _rows(run_dir)}
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
        _train_in_process(reference, *spike)
    _inject(monkeypatch, at={7}, factor=10.0, once=True)
    run_dir = tmp_path / "rollback"
    _train_in_process(run_dir, *spike)
    log = (run_dir / "train.log").read_text()
    assert "step 7: loss spike" in log and "rolled back to step_00000005" in log
    a, b = load_checkpoint(run_dir), load_checkpoint(reference)
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    rows_a, rows_b = _rows(run_dir), _rows(reference)
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
    _train_in_process(killed, *spike)  # the fault does not recur (once): only the train state can skip 7
    c = load_checkpoint(killed)
    assert all(torch.equal(c["model"][key], a["model"][key]) for key in a["model"])

    # Continued from step 0 in another directory: the rollback there needs a checkpoint of its own
    _inject(monkeypatch, at={7}, factor=10.0, once=True)
    elsewhere = tmp_path / "elsewhere"
    _train_in_process(elsewhere, *spike, f"trainer.resume={run_dir / 'checkpoints' / 'step_00000000'}")
    assert "rolled back to step_00000005" in (elsewhere / "train.log").read_text()
    d = load_checkpoint(elsewhere)
    assert all(torch.equal(d["model"][key], a["model"][key]) for key in a["model"])


def test_resume_between_log_steps_keeps_the_telemetry_window(tmp_path):
    """The checkpoint at step 2 falls inside the window logged at step 3: its telemetry counters travel
    with the checkpoint, so the resumed run writes the uninterrupted run's telemetry, row for row."""
    import shutil

    overrides = ["checkpoint.every_steps=2", "checkpoint.keep_last=0", "telemetry.moe=true"]
    overrides += ["trainer.steps=6", "trainer.log_every=3", "trainer.eval_every=0"]  # rows at 1, 3, 6
    whole = tmp_path / "whole"
    _train_in_process(whole, *overrides)
    run_dir = tmp_path / "resumed"
    shutil.copytree(whole, run_dir)
    for step in (4, 6):
        shutil.rmtree(run_dir / "checkpoints" / f"step_0000000{step}")
    (run_dir / "checkpoints" / "latest").write_text("step_00000002\n")
    _train_in_process(run_dir, *overrides)
    assert "=== resume from step 2" in (run_dir / "train.log").read_text()
    assert (run_dir / "telemetry.csv").read_text() == (whole / "telemetry.csv").read_text()
    columns = ("expert_imbalance", "expert_dead", "shared_rms", "routed_rms", "train_loss")
    assert [[r[c] for c in columns] for r in _rows(run_dir)] == [
        [r[c] for c in columns] for r in _rows(whole)
    ]


def test_persistent_spikes_stop_after_max_rollbacks(monkeypatch, tmp_path):
    _inject(monkeypatch, at=set(range(7, 13)), factor=10.0)
    overrides = [*GUARDED, "checkpoint.every_steps=2", "guard.spike_factor=2", "guard.spike_window=3"]
    with pytest.raises(RunFailed, match="guard.max_rollbacks=2 reached"):
        _train_in_process(tmp_path / "r", *overrides, "guard.spike_policy=rollback", "guard.max_rollbacks=2")


def test_spike_policy_log_counts_and_applies(monkeypatch, tmp_path):
    _inject(monkeypatch, at={7}, factor=10.0)
    run_dir = tmp_path / "r"
    _train_in_process(run_dir, *GUARDED, "guard.spike_factor=2", "guard.spike_window=3")
    rows = {int(r["step"]): r for r in _rows(run_dir)}
    assert rows[4]["loss_spikes"] == "0" and rows[8]["loss_spikes"] == "1" and rows[8]["skipped_steps"] == "0"
    assert "step 7: loss spike" in (run_dir / "train.log").read_text()


# ---------------------------------------------------------------------------------- disk full


def test_out_of_disk_during_a_save_keeps_the_previous_checkpoint(monkeypatch, tmp_path, caplog):
    """ENOSPC raised by the checkpoint writer part-way through a checkpoint. A real full disk cannot be made
    safely here (no private tmpfs), so the writer is monkeypatched to fail as the kernel would:
    OSError(ENOSPC) after some bytes. The run reports it, keeps the previous checkpoint and goes on; a
    failing final checkpoint fails the run (RunFailed: exit 3) with the previous one still valid."""
    import errno

    import trmoe.train.checkpoint as ckpt

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
        _train_in_process(run_dir, *SMALL, "checkpoint.every_steps=1", "checkpoint.keep_last=1")
    assert "checkpoint at step 3 failed: [Errno 28] No space left on device" in caplog.text
    assert "the newest complete checkpoint is still step_00000002" in caplog.text
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == ["latest", "step_00000004"]  # no temporary left; step 2 was pruned after step 4
    assert_latest_sane(run_dir)

    state["fail_at"] = 4  # the final checkpoint
    final = tmp_path / "final"
    with pytest.raises(RunFailed, match="final checkpoint could not be written"):
        _train_in_process(final, *SMALL, "checkpoint.every_steps=1")
    assert read_pointer(final / "checkpoints") == "step_00000003"
    assert sorted(p.name for p in (final / "checkpoints").iterdir()) == [
        "latest",
        "step_00000002",
        "step_00000003",
    ]
    assert_latest_sane(final)


def test_telemetry_csv_continues_on_resume(tmp_path):
    """telemetry.csv (telemetry.moe) is trimmed to the checkpoint's step and appended to, like metrics.csv:
    earlier rows are kept byte for byte and no step appears twice."""
    import shutil

    full, run_dir = tmp_path / "full", tmp_path / "r"
    _train_in_process(full, *SMALL, "telemetry.moe=true")
    shutil.copytree(full, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step_00000004")  # as if killed before step 4 was saved
    (run_dir / "telemetry.csv").write_text((run_dir / "telemetry.csv").read_text() + "4,0,12")  # cut short
    _train_in_process(run_dir, *SMALL, "telemetry.moe=true")

    def lines(path):
        return (path / "telemetry.csv").read_text().splitlines()

    def keys(path):
        return [tuple(line.split(",")[:2]) for line in lines(path)]

    assert keys(run_dir) == keys(full)
    early = [line for line in lines(full) if line.split(",")[0] in ("step", "1", "2")]
    assert early == [line for line in lines(run_dir) if line.split(",")[0] in ("step", "1", "2")]


def test_a_key_the_attention_kind_ignores_is_no_difference():
    """mha uses one key/value head per query head and mqa one, whatever model.num_kv_heads says: two
    attempts that differ only there build the same model (under gqa it is a real difference)."""
    from trmoe.train.resume import config_container

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
    _train_in_process(run_dir, *SMALL, "trainer.steps=6", "optimizer.decay_steps=4", "hardware.threads=2")
    rc = json.loads((run_dir / "run_config.json").read_text())
    before = rc["resumes"][-1]["before"]
    assert before == {"git": first["git"], "backend": first["backend"]}
    assert before["backend"]["threads"] == 1 and rc["backend"]["threads"] == 2
    assert "backend.threads 1 -> 2" in (run_dir / "train.log").read_text()


def test_a_relaunch_of_a_run_killed_after_its_final_checkpoint_marks_it_finished(small_run, tmp_path):
    import shutil

    from trmoe.train import status

    run_dir = tmp_path / "r"
    shutil.copytree(small_run, run_dir)
    final = json.loads((run_dir / "status.json").read_text())["final_eval_loss"]
    status.write_status(run_dir, status.RUNNING)  # as a kill between the last save and the status leaves it
    assert _train_in_process(run_dir, *SMALL) == final
    recorded = json.loads((run_dir / "status.json").read_text())
    assert recorded["status"] == "finished" and recorded["final_eval_loss"] == final
    # a failure the run recorded itself stays (a guard that stopped the last step saved it too)
    status.write_status(run_dir, status.FAILED, error="RunFailed: stopped at step 4")
    _train_in_process(run_dir, *SMALL)
    assert json.loads((run_dir / "status.json").read_text())["status"] == "failed"


# ------------------------------------------------------- damaged or foreign records: refused before writes

EXTEND = [*SMALL, "trainer.steps=6", "optimizer.decay_steps=4"]  # small_run extended, its horizon pinned


def _copy_run(small_run: Path, tmp_path: Path) -> Path:
    import shutil

    run_dir = tmp_path / "runs" / "r"
    shutil.copytree(small_run, run_dir)
    return run_dir


def _edit_meta(checkpoint: Path, edit) -> None:
    """meta.json after `edit` (which changes it in place), sealed again as a save seals it (a forgery of
    another trmoe's checkpoint, not a corruption)."""
    from trmoe.train.checkpoint import seal_meta

    meta = json.loads((checkpoint / "meta.json").read_text())
    edit(meta)
    (checkpoint / "meta.json").write_text(seal_meta(meta))


def _rename_a_tensor(checkpoint: Path) -> None:
    """The payload of another trmoe version: one model tensor under another name (meta.json's size and CRC32
    updated, so the checkpoint verifies)."""
    from trmoe.train.checkpoint import file_crc32

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
    before = _tree_digest(run_dir)
    result = run_cli([*BASE, *EXTEND, "model.shared_width=128", "trainer.force_resume=true"], cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("trmoe: ")]
    assert len(errors) == 1 and "Traceback" not in result.stderr
    assert "cannot change the model's tensors" in errors[0] and "nothing was changed" in errors[0]
    assert _tree_digest(run_dir) == before
    _edit_meta(newest, lambda meta: meta["config"]["model"].pop("new_key"))  # the same config again
    _rename_a_tensor(newest)
    before = _tree_digest(run_dir)
    with pytest.raises(UserError, match=r"does not fit this model: 2 tensors differ .*nothing was changed"):
        _train_in_process(run_dir, *EXTEND)
    assert _tree_digest(run_dir) == before


def test_a_run_config_json_that_is_no_object_is_ignored(small_run, tmp_path, caplog):
    """Valid JSON of another shape in run_config.json (or in its `resumes`) is read as no record."""
    run_dir = _copy_run(small_run, tmp_path)
    rc = json.loads((run_dir / "run_config.json").read_text())
    (run_dir / "run_config.json").write_text(json.dumps({**rc, "resumes": [5, "x", None]}))
    _train_in_process(run_dir, *EXTEND)
    assert [r["mode"] for r in json.loads((run_dir / "run_config.json").read_text())["resumes"]] == ["resume"]
    (run_dir / "run_config.json").write_text("[1]")
    with caplog.at_level("WARNING", logger="trmoe"):
        _train_in_process(run_dir, *SMALL, "trainer.steps=8", "optimizer.decay_steps=4")
    assert load_checkpoint(run_dir)["step"] == 8
    assert "run_config.json is no readable JSON object: the history" in caplog.text
    # without a checkpoint, it is no record of the run: refused, nothing changed
    import shutil

    shutil.rmtree(run_dir / "checkpoints")
    (run_dir / "run_config.json").write_text("[1]")
    before = _tree_digest(run_dir)
    with pytest.raises(UserError, match="neither a readable run_config.json nor a complete checkpoint"):
        _train_in_process(run_dir, *SMALL)
    assert _tree_digest(run_dir) == before


def test_a_meta_json_of_another_shape_makes_the_checkpoint_unusable(small_run, tmp_path, caplog):
    """auto falls back to the previous checkpoint, as for a truncated payload; trainer.resume=<it> refuses
    it (exit 2) and leaves no run directory behind."""
    run_dir = _copy_run(small_run, tmp_path)
    newest = run_dir / "checkpoints" / "step_00000004"
    (newest / "meta.json").write_text("null")
    with pytest.raises(UserError, match=r"trainer.resume=.*step_00000004: .*meta.json is not a trmoe"):
        _train_in_process(tmp_path / "new", *SMALL, f"trainer.resume={newest}")
    assert not (tmp_path / "new").exists()
    with caplog.at_level("WARNING", logger="trmoe"):
        _train_in_process(run_dir, *SMALL)
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
    before = _tree_digest(run_dir)
    with pytest.raises(UserError, match=f"{name} is unreadable .*; move it aside") as err:
        _train_in_process(run_dir, *EXTEND)
    assert len(str(err.value).splitlines()) == 1
    assert _tree_digest(run_dir) == before and (run_dir / name).exists()
    with pytest.raises(UserError, match=f"{name} is unreadable"):  # continuing its checkpoint elsewhere
        _train_in_process(tmp_path / "new", *EXTEND, f"trainer.resume={run_dir / 'checkpoints'}")
    assert not (tmp_path / "new").exists()


def test_trainer_steps_below_the_checkpoint_is_named_first(small_run):
    """Not the schedule check's advice to pin the schedule of the steps done (here the warmup changes too),
    which, followed, would only lead to this error."""
    before = _tree_digest(small_run)
    with pytest.raises(UserError, match=r"trainer.steps=2: the checkpoint .* is at step 4; allowed: >= 4"):
        _train_in_process(small_run, *SMALL, "trainer.steps=2", "optimizer.warmup_steps=1")
    assert _tree_digest(small_run) == before
