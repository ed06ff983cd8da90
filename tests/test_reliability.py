"""Reliability at the edges (docs/reliability.md): one live launch per run directory, data identity by
content, stop signals from a terminal, a disk that fills, a read-only directory. Real processes, real
signals, real files; the full disk is a real tmpfs of a few MiB (the test mounts one; skipped where it
cannot)."""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers import (
    child_env,
    cli,
    compose_config,
    descendants,
    python,
    run_cli,
    start_forked,
    text_documents,
    wait_until,
)
from presets import DATA_FAST as FAST
from presets import RELIABILITY_TINY as TINY

from trmoe.durable import number
from trmoe.errors import UserError
from trmoe.run.lock import LOCK_FILE, RunLock, read_holder
from trmoe.train.loop import train

# first attempt: 2 steps of a 4-step horizon; the resume (trainer.steps=4) keeps the schedules' past
FIRST = ["trainer.steps=2", "checkpoint.every_steps=2", "optimizer.decay_steps=4", "optimizer.warmup_steps=1"]
SECOND = [*FIRST[1:], "trainer.steps=4"]


@pytest.fixture(autouse=True)
def _keep_thread_count():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _spawn(args: list[str], cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.Popen(
        [sys.executable, "-m", "trmoe.train", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _status(run_dir: Path) -> dict:
    return json.loads((run_dir / "status.json").read_text())


def _rows_written(run_dir: Path, rows: int) -> bool:
    try:
        return len((run_dir / "metrics.csv").read_text().splitlines()) > rows
    except OSError:
        return False


# ----------------------------------------------------------------------------------- one launch per run


@pytest.mark.subprocess
def test_a_second_launch_of_a_live_run_is_refused_and_a_dead_one_keeps_no_lock(tmp_path):
    run_dir = tmp_path / "runs" / "live"
    live = _spawn([*TINY, "run.name=live", "trainer.steps=100000", "checkpoint.every_steps=2"], tmp_path)
    try:
        wait_until(lambda: (run_dir / "checkpoints" / "latest").exists(), "a first checkpoint", live)
        holder = read_holder(run_dir)
        assert holder["pid"] == live.pid and holder["host"]
        # the same name (another config, too), while the first launch trains
        second = cli([*TINY, "run.name=live", "trainer.steps=3", "trainer.seed=2"], cwd=tmp_path)
        assert second.returncode == 2, second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in second.stderr
        assert (
            lines[0].startswith("trmoe: run directory ")
            and "runs/live is in use by a live launch: " in lines[0]
        )
        assert f"pid {live.pid} on {holder['host']}" in lines[0]
        assert not list((run_dir / "checkpoints").glob("discarded_*"))  # the live run's checkpoints untouched
        assert live.poll() is None
    finally:
        live.send_signal(signal.SIGKILL)
        live.wait(60)
    # SIGKILL: the kernel released the lock; the stale record stays until the next launch takes it
    assert (run_dir / LOCK_FILE).exists() and read_holder(run_dir)["pid"] == live.pid
    with RunLock(run_dir):
        assert read_holder(run_dir)["pid"] == os.getpid()
        with pytest.raises(UserError, match=f"in use by a live launch: pid {os.getpid()}"):
            RunLock(run_dir).acquire()  # (a second open file description of this process is refused too)
    assert not (run_dir / LOCK_FILE).exists()  # released: the file goes with it


@pytest.mark.subprocess
def test_a_requeue_of_the_same_slurm_job_takes_over_a_lock_a_lost_node_still_holds(tmp_path, monkeypatch):
    """On a shared filesystem a node that is lost can keep its lock until the server's lease ends; the same
    SLURM job, requeued (SLURM starts it only after the first attempt ended), must still resume its own
    directory. Another job must not."""
    run_dir = tmp_path / "r"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from trmoe.run.lock import RunLock; "
            "RunLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(600)",
            str(run_dir),
        ],
        env={**os.environ, "SLURM_JOB_ID": "4242"},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setenv("SLURM_JOB_ID", "77")
        with pytest.raises(UserError, match="SLURM job 4242"):
            RunLock(run_dir).acquire()
        monkeypatch.setenv("SLURM_JOB_ID", "4242")
        lock = RunLock(run_dir)
        lock.acquire()
        assert read_holder(run_dir)["pid"] == os.getpid()
        lock.release()
    finally:
        holder.kill()
        holder.wait(30)


@pytest.mark.subprocess
def test_default_run_names_and_sweep_directories_are_unique_within_one_second(tmp_path):
    """Three default-named launches started together (processes forked from the fork server: they start
    within milliseconds of each other) get three directories (before: one, by the clock's second); each
    composition resolves its own name once (one launch, one value)."""
    procs = [start_forked("none", [*TINY, "trainer.steps=1"], tmp_path, stem=f"launch{i}") for i in range(3)]
    for proc in procs:
        proc.join(600)
    outs = [(tmp_path / f"launch{i}.stderr").read_text() for i in range(3)]
    assert [p.exitcode for p in procs] == [0, 0, 0], outs
    runs = sorted((tmp_path / "runs").iterdir())
    assert len(runs) == 3 and all(_status(r)["status"] == "finished" for r in runs)
    assert all(not (r / LOCK_FILE).exists() for r in runs)

    from hydra import compose, initialize_config_module

    dirs = []
    for _ in range(2):  # two sweeps composed within one second
        with initialize_config_module(version_base="1.3", config_module="trmoe.conf"):
            cfg = compose("config", return_hydra_config=True)
            first = str(cfg.hydra.sweep.dir)
            assert str(cfg.hydra.sweep.dir) == first  # cached: the jobs of one sweep share it
            dirs.append(first)
    assert dirs[0] != dirs[1]


# ----------------------------------------------------------------------------------------- data identity


def _text_file(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(text_documents(120)))
    return path


def test_the_same_data_at_another_path_resumes(tmp_path, monkeypatch):
    """The location is volatile, the content is the identity: a moved text file, and a token dataset given
    by an absolute instead of a relative path, resume (both were refused as a different run)."""
    from trmoe.data.prepare import prepare

    text = _text_file(tmp_path / "a" / "corpus.txt")
    run_dir = tmp_path / "runs" / "text"
    train(compose_config(*FAST, "data=text", f"data.text_path={text}", *FIRST), run_dir)
    moved = tmp_path / "b" / "renamed.txt"
    moved.parent.mkdir()
    text.rename(moved)
    train(compose_config(*FAST, "data=text", f"data.text_path={moved}", *SECOND), run_dir)
    rc = json.loads((run_dir / "run_config.json").read_text())
    assert [r["mode"] for r in rc["resumes"]] == ["resume"] and _status(run_dir)["status"] == "finished"

    prepare(str(moved), tmp_path / "ds", eval_fraction=0.25, workers=0)
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "runs" / "tokens"
    train(compose_config(*FAST, "data=tokens", "data.path=ds", *FIRST), run_dir)
    train(compose_config(*FAST, "data=tokens", f"data.path={tmp_path / 'ds'}", *SECOND), run_dir)
    assert _status(run_dir)["status"] == "finished"


def test_a_parquet_file_edited_to_the_same_size_is_refused_on_resume(tmp_path):
    """data=fineweb recognised a file by name, size and row groups: an edit of the same size resumed on other
    data. Its content hash is recorded now and compared, like every other source's."""
    docs = text_documents(150, seed=4)
    root = tmp_path / "pq"
    root.mkdir()
    pq.write_table(pa.table({"text": docs}), root / "part.parquet", row_group_size=50, compression="none")
    run_dir = tmp_path / "runs" / "web"
    overrides = [*FAST, "data=fineweb", f"data.path={root}", "data.eval_fraction=0.2", "data.workers=0"]
    train(compose_config(*overrides, *FIRST), run_dir)
    raw = (root / "part.parquet").read_bytes()
    word = docs[3].split()[0].encode()
    at = raw.index(word)
    edited = raw[:at] + word.upper() + raw[at + len(word) :]
    assert len(edited) == len(raw) and edited != raw
    (root / "part.parquet").write_bytes(edited)
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    with pytest.raises(UserError, match=r"data_info\.stream\.files"):
        train(compose_config(*overrides, *SECOND), run_dir)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before
    (root / "part.parquet").write_bytes(raw)  # the same bytes again (and moved): resumes
    shutil.move(root, tmp_path / "elsewhere")
    train(
        compose_config(*overrides[:-3], f"data.path={tmp_path / 'elsewhere'}", *overrides[-2:], *SECOND),
        run_dir,
    )
    assert _status(run_dir)["status"] == "finished"


# --------------------------------------------------------------------------------- signals from a terminal


@pytest.mark.subprocess
@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGHUP, 129)])
def test_ctrl_c_and_a_closed_terminal_stop_at_a_step_boundary_like_sigterm(tmp_path, signum, code):
    run_dir = tmp_path / "runs" / "r"
    proc = _spawn([*TINY, "run.name=r", "trainer.steps=100000", "trainer.log_every=1"], tmp_path)
    wait_until(lambda: _rows_written(run_dir, 3), "training rows", proc)
    proc.send_signal(signum)
    out = proc.communicate(timeout=300)[0]
    name = signal.Signals(signum).name
    assert proc.returncode == code, out[-3000:]
    assert "Traceback" not in out
    status = _status(run_dir)
    assert status["status"] == "preempted" and f"on {name}; checkpoint saved" in status["error"]
    step = status["step"]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{step:08d}"
    assert f"stopped at step {step} on {name}" in (run_dir / "train.log").read_text()
    assert not (run_dir / LOCK_FILE).exists()


@pytest.mark.subprocess
def _maps_name(pid: int, name: str) -> bool:
    """Whether the process has a shared object whose path contains `name` mapped (Linux /proc)."""
    try:
        return name in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def test_ctrl_c_during_start_up_is_one_line_and_leaves_nothing(tmp_path):
    """Ctrl-C while the app loads (imports, composition, the run's set-up) and before any checkpoint: one
    line, exit 130, no traceback, no (empty) run directory, no "resumes from its checkpoint" hint."""
    run_dir = tmp_path / "runs" / "r"
    for when in ("imports", "set-up"):  # Python loading the app; the run directory made, no step yet
        proc = _spawn([*TINY, "run.name=r", "trainer.steps=100000"], tmp_path)
        if when == "imports":  # the child has started loading its libraries (libyaml: under hydra's imports)
            wait_until(functools.partial(_maps_name, proc.pid, "_yaml"), "the imports", proc)
        else:
            wait_until(run_dir.exists, "the run directory", proc)
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=120)[0]
        lines = out.strip().splitlines()
        assert proc.returncode == 130 and "Traceback" not in out, out[-3000:]
        assert lines[-1].startswith("trmoe: interrupted") and "resumes" not in out, out[-3000:]
        assert (
            not run_dir.exists()
            or not (run_dir / "checkpoints").exists()
            or any((run_dir / "checkpoints").iterdir())
        ), sorted(map(str, run_dir.rglob("*")))
        assert not (tmp_path / "runs").exists() or any((tmp_path / "runs").iterdir())  # no empty folder


# ------------------------------------------------------------------------------ full disk, read-only disk


def _leftovers(root: Path) -> list[str]:
    return sorted(
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.name.endswith((".tmp", ".partial", ".deleting")) or p.name == LOCK_FILE
    )


@pytest.mark.subprocess
def test_a_disk_that_fills_mid_run_then_read_only(tmpfs):
    # checkpoints of ~1.9 MB every 2 steps, all kept: the 6 MiB fill after the second
    args = [*TINY, "run.name=full", "trainer.steps=12", "checkpoint.every_steps=2", "checkpoint.keep_last=0"]
    result = run_cli(args, cwd=tmpfs, timeout=600)
    out = result.stderr
    assert result.returncode == 3, out[-3000:]
    assert "Traceback" not in out and "Logging error" not in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("trmoe: ") and "No space left on device" in last, last
    run_dir = tmpfs / "runs" / "full"
    status = _status(run_dir)
    assert status["status"] == "failed" and "No space left on device" in status["error"]
    assert _leftovers(tmpfs) == []
    good = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert good in last

    # the same run, its directory now read-only: one line, exit 3, nothing changed
    before = {str(p): p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    again = cli(args, cwd=tmpfs)  # the error path in this process (main(argv)); the full disk is a child
    assert again.returncode == 3 and "Traceback" not in again.stderr, again.stderr[-3000:]
    lines = again.stderr.strip().splitlines()
    assert len(lines) == 1 and "Read-only file system" in lines[0], lines
    assert {str(p): p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before

    # a report of a read-only sweep directory: one line, exit 2 (and --out elsewhere works)
    report = cli([str(tmpfs / "runs"), "--no-plots", "--quiet"], cwd=tmpfs.parent, module="trmoe.report")
    assert report.returncode == 2 and "Traceback" not in report.stderr, report.stderr[-3000:]
    assert report.stderr.strip().splitlines() == [
        f"trmoe: report: cannot write into {tmpfs / 'runs'} (Read-only file system); use --out DIR to write "
        "it elsewhere"
    ]


@pytest.mark.subprocess
def test_a_full_disk_at_launch_is_one_line_and_leaves_nothing_half_written(tmpfs):
    filler = tmpfs / "filler"
    with open(filler, "wb") as f:  # leave ~12 KiB
        try:
            f.write(b"\0" * (6 * 1024 * 1024 - 12 * 1024))
        except OSError:
            pass
    result = cli([*TINY, "run.name=late", "trainer.steps=2"], cwd=tmpfs)  # main(argv) in this process
    assert result.returncode == 3, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "Logging error" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("trmoe: cannot write the run directory ") and "No space left on device" in last, (
        last
    )
    assert _leftovers(tmpfs) == []


@pytest.mark.subprocess
def test_a_read_only_run_directory_is_exit_3_new_or_existing(tmpfs):
    """One class, one code: the filesystem refusing the run directory is exit 3 (as any later write of the
    run) whether Hydra makes the directory, the lock finds it, or the run exists already (the last case is
    test_a_disk_that_fills_mid_run_then_read_only); 151d5ed said exit 2 for a new run directory."""
    (tmpfs / "runs").mkdir()
    (tmpfs / "empty").mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    fresh = cli([*TINY, "run.name=new", "trainer.steps=1"], cwd=tmpfs)  # in this process; `made` is a child
    assert fresh.returncode == 3, fresh.stderr[-3000:]
    assert fresh.stderr.strip().splitlines() == [
        "trmoe: cannot create the run directory runs/new: Read-only file system"
    ]
    made = python(
        "-m",
        "trmoe.train",
        *TINY,
        "trainer.steps=1",
        cwd=tmpfs,
        env=child_env(TRMOE_RUN_DIR=str(tmpfs / "empty")),
    )
    assert made.returncode == 3, made.stderr[-3000:]
    assert made.stderr.strip().splitlines() == [
        f"trmoe: cannot write the run directory {tmpfs / 'empty'}: Read-only file system "
        f"({tmpfs / 'empty' / LOCK_FILE}); the newest complete checkpoint is none"
    ]
    assert sorted(p.name for p in tmpfs.rglob("*")) == ["empty", "runs"]


def test_something_in_the_way_of_a_run_directory_is_exit_2_naming_it(tmp_path):
    """Bad input (exit 2, nothing made), never the storage failure of exit 3: a file where the run directory
    (or a folder above it) goes, a directory where its lock file goes."""
    (tmp_path / "runs").write_text("a file where the runs go")
    with pytest.raises(
        UserError, match="cannot create the run directory .*x: a file is in the way \\(.*runs\\)"
    ):
        RunLock(tmp_path / "runs" / "x").acquire()
    (tmp_path / "y" / LOCK_FILE).mkdir(parents=True)  # a .lock that is a directory is named as the cause
    with pytest.raises(
        UserError, match=f"cannot lock the run directory .*y: .*y/{LOCK_FILE}: Is a directory"
    ):
        RunLock(tmp_path / "y").acquire()
    assert sorted(p.name for p in tmp_path.rglob("*")) == [LOCK_FILE, "runs", "y"]


# -------------------------------------------------------------------------------- prepare, interrupted


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def _group(pgid: int) -> list[str]:
    """The live processes of a process group (command lines), zombies left out."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append((stat.parent / "cmdline").read_text().replace("\0", " "))
        except (OSError, ValueError, IndexError):
            continue
    return out


@pytest.mark.subprocess
@pytest.mark.parametrize(
    ("signals", "when", "code"),
    [
        ((signal.SIGINT, signal.SIGINT), "start-up", 130),  # Ctrl-C twice at once, to the whole group
        ((signal.SIGTERM,), "tokenizing", 143),
        ((signal.SIGINT,), "tokenizing", 130),
    ],
    ids=["ctrl-c-twice-at-start-up", "sigterm", "ctrl-c"],
)
def test_prepare_interrupted_ends_promptly_and_removes_what_it_says(tmp_path, signals, when, code):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(text_documents(40000)))
    out = tmp_path / "ds"
    proc = subprocess.Popen(
        [sys.executable, "-m", "trmoe.data.prepare", str(corpus), "--out", str(out), "--workers", "2"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    partial = out / "train" / ".tokens.bin.partial"
    if when == "start-up":  # the shard files are open, the workers are being spawned
        wait_until(partial.exists, "the partial shard", proc)
    else:
        wait_until(lambda: partial.exists() and partial.stat().st_size > 0, "tokens written", proc)
    workers = descendants(proc.pid)
    for signum in signals:
        os.killpg(proc.pid, signum)
    out_text = proc.communicate(timeout=60)[0]  # promptly: it once waited ten minutes
    assert proc.returncode == code, out_text[-3000:]
    assert "Traceback" not in out_text and "leaked" not in out_text, out_text[-3000:]
    name = signal.Signals(signals[0]).name
    assert (
        out_text.strip().splitlines()[-1]
        == f"trmoe: data.prepare: interrupted ({name}); partial files removed"
    )
    assert not out.exists(), sorted(map(str, out.rglob("*")))  # everything it made is gone, as it says
    deadline = time.monotonic() + 30
    while (_alive(workers) or _group(proc.pid)) and time.monotonic() < deadline:  # no worker outlives it
        time.sleep(0.1)
    assert not _alive(workers) and _group(proc.pid) == []


# --------------------------------------------------------------------------- report: diverged and disagreeing


def test_report_flags_diverged_runs_leaves_them_out_of_the_pairs_and_takes_finals_from_the_final_step(
    tmp_path,
):
    """A real sweep: the control (lr 3e-3) and an arm whose loss becomes NaN (lr 1e12, non-finite guard off),
    two seeds each. The arm was shown "finished" with its step-0 loss as the final one and paired."""
    sweep = tmp_path / "sweep"
    args = [
        "--multirun",
        *TINY,
        "trainer.steps=4",
        "trainer.log_every=1",
        "guard.skip_nonfinite=false",
        "optimizer.lr=3e-3,1e12",
        "trainer.seed=1,2",
        f"hydra.sweep.dir={sweep}",
        "hydra.callbacks.report.control='optimizer.lr=0.003'",
    ]
    result = cli(args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    report = (sweep / "report.md").read_text()
    assert "2 run(s) diverged (left out of the paired comparison)" in report
    assert "Left out of the paired comparison (2)" in report and "no common finished seed" in report
    assert "eval loss nan at the final step 4" in report
    for line in report.splitlines():  # a diverged run's final eval is its NaN, never the step-0 loss
        if line.startswith("| ") and "diverged: eval loss nan" in line:
            assert "| nan |" in line
    assert "records disagree" not in report

    # a finished control run whose metrics.csv lost its last rows: flagged; its final figure is status.json's
    # (written at the final step), never the step-0 loss metrics.csv still holds
    control = next(
        d
        for d in sorted(sweep.iterdir())
        if (d / "status.json").exists() and number(_status(d).get("final_eval_loss")) < 100  # ("NaN": not)
    )
    final = _status(control)["final_eval_loss"]
    metrics = control / "metrics.csv"
    metrics.write_text("".join(metrics.read_text().splitlines(keepends=True)[:2]))  # header + step 0
    again = cli([str(sweep), "--no-plots"], cwd=tmp_path, module="trmoe.report")
    assert again.returncode == 0, again.stderr
    text = (sweep / "report.md").read_text()
    assert "metrics.csv ends at step 0, but status.json says finished at step 4 (truncated?)" in text
    row = next(line for line in text.splitlines() if line.startswith(f"| {control.name} |"))
    assert f"{final:.4f}" in row


# ------------------------------------------------------------------------------------ bad input, by class


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        (
            "trainer.steps=99999999999999999999",
            "trainer.steps=99999999999999999999: must be an integer of at most",
        ),
        (
            "model.match_params=99999999999999999999",
            "model.match_params=99999999999999999999: must be an integer",
        ),
        ("trainer.seed=-99999999999999999999", "trainer.seed=-99999999999999999999: must be an integer"),
        ("hardware.threads=100000", "hardware.threads=100000: this machine has"),
        (  # an odd width: no head count works, so the width is blamed, not num_heads
            "model.hidden_size=1000000000000001",
            "model.hidden_size=1000000000000001: must be model.num_heads=4 x an even head_dim",
        ),
        ("model.hidden_size=63", "model.hidden_size=63: must be model.num_heads=4 x an even head_dim"),
        (
            "model.hidden_size=1000000000000002",
            "model.num_heads=4: must divide model.hidden_size=1000000000000002 into an even head_dim",
        ),
        ("model.hidden_size=36", "model.num_heads=4: must divide model.hidden_size=36 into an even head_dim"),
    ],
)
def test_out_of_range_integers_are_one_line_errors(override, needle):
    """Every integer of the config must fit int64 (train, match and plan compose through the same check);
    thread counts far above the cores are refused; a huge width does not hang the error message."""
    from trmoe.config.resolve import to_config

    with pytest.raises(UserError, match="config error: " + needle.replace("(", r"\(")):
        to_config(compose_config(override))


def test_cli_broken_yaml_under_config_dir_and_a_model_that_cannot_fit_write_nothing(tmp_path):
    conf = tmp_path / "conf" / "model"
    conf.mkdir(parents=True)
    (conf / "bad.yaml").write_text("defaults:\n  - base_model\nname: bad\nhidden_size: [1,\n")
    result = cli(["--config-dir", str(tmp_path / "conf"), "model=bad"], cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip() == (
        f"trmoe: config error: {conf / 'bad.yaml'}: line 5, column 1: not valid YAML "
        "(expected the node content, but found '<stream end>')"
    )
    # an allocation that would fail after the run directory holds its records: sized first
    # (trainer.max_hours=null: the wall-time estimate, checked first, would refuse it for its days of work)
    huge = cli(
        ["model.hidden_size=65536", "model.num_layers=64", "run.name=huge", "trainer.max_hours=null"],
        tmp_path,
    )
    assert huge.returncode == 2 and "Traceback" not in huge.stderr, huge.stderr[-3000:]
    assert huge.stderr.strip().startswith(
        "trmoe: model tiny: its weights, gradients and optimizer state need"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["conf"]


@pytest.mark.subprocess
def test_prepare_names_the_jsonl_position_quotes_its_hint_and_names_symlinks_as_matched(tmp_path):
    from trmoe.data.prepare import discover_inputs, prepare, train_override

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "broken\n')
    with pytest.raises(
        UserError, match=r"line 2 is not valid JSON \(Invalid control character at column 17\)$"
    ):
        prepare(str(bad), tmp_path / "out")
    for path in ("/data/a b/ds", "/data/x,y/ds", "/data/it's/ds", '/data/$HOME "q"/ds', "/plain/ds"):
        word = subprocess.run(
            ["bash", "-c", f"printf %s {train_override('data.path', path)}"], capture_output=True, text=True
        ).stdout
        from hydra.core.override_parser.overrides_parser import OverridesParser

        assert OverridesParser.create().parse_overrides([word])[0].value() == path
    target = tmp_path / "real" / "target.txt"
    target.parent.mkdir()
    target.write_text("one\n\ntwo\n")
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "link.txt").symlink_to(target)
    _, files = discover_inputs(str(tmp_path / "in" / "*.txt"))
    assert files == [tmp_path / "in" / "link.txt"]
