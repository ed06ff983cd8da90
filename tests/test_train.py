"""End-to-end training: loss falls, the run directory is complete, runs are deterministic, the CLI works
from any directory, sweeps produce one run directory per job."""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import pytest
import torch
from helpers import cli, compose_config, metrics_rows
from presets import TRAIN_FAST as FAST

from trmoe.run.checkpoint import load_checkpoint
from trmoe.train.loop import train
from trmoe.train.producers import columns_documented

# random ids over 512: the runs whose property does not depend on the o200k vocabulary (a 13M-parameter
# model, nearly all of it the embedding and the output layer) take the small one
SMALL_VOCAB = ["data=random", "model.vocab_size=512"]


def test_loss_decreases_on_the_o200k_vocabulary(text_run):
    """conftest's session run (TEXT_RUN: the tiny model, o200k ids, 60 steps on four sentences), trained once
    for this file, sample, export and eval: an untrained model is uniform over the vocabulary, and the loss
    falls by more than 2 nats."""
    rows = metrics_rows(text_run)
    evals = [(int(r["step"]), float(r["eval_loss"])) for r in rows if r["eval_loss"] != "nan"]
    assert [s for s, _ in evals] == [0, 60]  # trainer.eval_every=0: the first and the last step
    start = evals[0][1]
    assert start == pytest.approx(math.log(200_019), abs=0.1)  # untrained: uniform over the vocabulary
    assert evals[-1][1] < start - 2.0, evals
    train_losses = [float(r["train_loss"]) for r in rows if r["train_loss"] != "nan"]
    assert train_losses[-1] < train_losses[0] - 2.0


def test_run_directory_holds_every_record(text_run):
    run_dir = text_run
    for name in (".hydra/config.yaml", "train.log", "run_config.json", "metrics.csv", "checkpoints/latest"):
        assert (run_dir / name).is_file(), name
    rc = json.loads((run_dir / "run_config.json").read_text())
    assert rc["schema_version"] == 1
    assert rc["tokens_per_step"] == 4 * 32 and rc["total_tokens"] == 60 * 4 * 32
    assert rc["params"]["total"] == 12_924_484 and rc["params"]["active"] < rc["params"]["total"]
    assert rc["world_size"] == 1 and rc["backend"]["device"] == "cpu"
    assert rc["backend"]["process_group"] is None and rc["backend"]["cpu"] == rc["backend"]["device_name"]
    if Path("/proc/cpuinfo").is_file():  # the processor's model name, not only its architecture
        names = [ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("model name")]
        assert not names or rc["backend"]["cpu"] == names[0].split(":", 1)[1].strip()
    assert rc["config"]["model"]["name"] == "tiny" and rc["model_spec"]["num_kv_heads"] == 2
    assert rc["data"]["source"] == "text" and rc["data"]["tokenizer"] == "o200k_base"
    assert "commit" in rc["git"]
    with open(run_dir / "metrics.csv") as f:
        assert tuple(next(csv.reader(f))) == tuple(c.name for c in columns_documented() if "/" not in c.name)
    steps = [int(r["step"]) for r in metrics_rows(run_dir)]
    assert steps == [0, 1, 20, 40, 60]
    assert all(float(r["tok_s"]) > 0 for r in metrics_rows(run_dir)[1:])
    ckpt = load_checkpoint(run_dir / "checkpoints")
    assert ckpt["step"] == 60 and "blocks.0.ffn.routed.route_table" in ckpt["model"]
    assert "run directory" in (run_dir / "train.log").read_text()


def test_same_config_gives_identical_metrics(tmp_path):
    # (the embedded corpus's own determinism: tests/test_data.py)
    run = [*FAST, *SMALL_VOCAB, "trainer.steps=6", "trainer.log_every=1", "trainer.eval_every=4"]
    a = train(compose_config(*run), tmp_path / "a")
    b = train(compose_config(*run), tmp_path / "b")
    assert a == b
    # the app returns the final held-out loss; evaluations every 4 steps, and at steps 0 and last
    evals = [
        (int(r["step"]), float(r["eval_loss"]))
        for r in metrics_rows(tmp_path / "a")
        if r["eval_loss"] != "nan"
    ]
    assert [s for s, _ in evals] == [0, 4, 6] and a == pytest.approx(evals[-1][1], rel=1e-5)
    loss_columns = ("train_loss", "train_objective", "eval_loss", "grad_norm")
    rows_a, rows_b = metrics_rows(tmp_path / "a"), metrics_rows(tmp_path / "b")
    assert [[r[c] for c in loss_columns] for r in rows_a] == [[r[c] for c in loss_columns] for r in rows_b]
    wa = load_checkpoint(tmp_path / "a" / "checkpoints")["model"]
    wb = load_checkpoint(tmp_path / "b" / "checkpoints")["model"]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # and trainer.seed is what sets them: another seed, another initialisation (its step-0 eval differs)
    train(compose_config(*run, "trainer.seed=1"), tmp_path / "c")
    rows_c = metrics_rows(tmp_path / "c")
    assert rows_c[0]["step"] == rows_a[0]["step"] == "0" and rows_c[0]["eval_loss"] != rows_a[0]["eval_loss"]
    wc = load_checkpoint(tmp_path / "c" / "checkpoints")["model"]
    assert not torch.equal(wa["embed.weight"], wc["embed.weight"])


def test_gradient_accumulation_equals_the_larger_batch(tmp_path):
    run = [*FAST, *SMALL_VOCAB, "trainer.steps=3", "trainer.log_every=1"]
    train(compose_config(*run, "trainer.micro_batch=4"), tmp_path / "big")
    train(compose_config(*run, "trainer.micro_batch=2", "trainer.grad_accum=2"), tmp_path / "acc")
    big_rows, acc_rows = metrics_rows(tmp_path / "big"), metrics_rows(tmp_path / "acc")
    for a, b in zip(big_rows[1:], acc_rows[1:], strict=True):
        assert int(a["tokens"]) == int(b["tokens"])
        assert float(a["train_loss"]) == pytest.approx(float(b["train_loss"]), abs=1e-5)
        assert float(a["grad_norm"]) == pytest.approx(float(b["grad_norm"]), rel=1e-4)
    wa = load_checkpoint(tmp_path / "big" / "checkpoints")["model"]
    wb = load_checkpoint(tmp_path / "acc" / "checkpoints")["model"]
    for key in wa:  # Adam divides by sqrt(v): gradients that are ~0 can differ by a few ulps in sign
        torch.testing.assert_close(wa[key], wb[key], rtol=1e-4, atol=1e-4)


def test_objective_reports_ce_separately_from_smoothing_and_z_loss(tmp_path):
    def run(name: str, *loss: str) -> tuple[list[dict], dict]:
        run = [*FAST, *SMALL_VOCAB, "trainer.steps=2", "trainer.log_every=1", *loss]
        train(compose_config(*run), tmp_path / name)
        return metrics_rows(tmp_path / name), load_checkpoint(tmp_path / name / "checkpoints")["model"]

    plain, w_plain = run("plain")
    z, w_z = run("z", "loss.z_loss=1e-3")
    smooth, w_smooth = run("smooth", "loss.label_smoothing=0.3")
    # step 1: the same initial weights and batch, so the same cross-entropy in all three runs
    ce = float(plain[1]["train_loss"])
    assert float(z[1]["train_loss"]) == float(smooth[1]["train_loss"]) == ce
    assert float(plain[1]["train_objective"]) == ce
    # untrained logits are ~0, so log Z ~ ln V and the z-loss term is c (ln V)^2 = 1e-3 x 38.9
    assert float(z[1]["train_objective"]) - ce == pytest.approx(1e-3 * math.log(512) ** 2, rel=0.02)
    # smoothing's term (the mean of -log p over the vocabulary) ~ CE at initialisation, so the objective
    # cannot show it there; its gradient is another: the weights after the first update differ
    for trained in (w_z, w_smooth):
        assert not torch.equal(trained["embed.weight"], w_plain["embed.weight"])


def test_existing_run_directory_is_never_overwritten(tmp_path):
    # (tests/test_resume*.py and tests/test_launch.py cover resume, restart and run.overwrite in depth)
    cfg = compose_config(*FAST, "trainer.steps=1", "trainer.eval_batches=1")
    train(cfg, tmp_path / "r")  # the default data: the embedded corpus in o200k ids
    assert json.loads((tmp_path / "r" / "run_config.json").read_text())["data"]["source"] == "embedded"
    before = (tmp_path / "r" / "metrics.csv").read_bytes()
    from trmoe.errors import UserError

    with pytest.raises(UserError, match="already holds a run"):
        train(
            compose_config(*FAST, "trainer.steps=1", "trainer.eval_batches=1", "trainer.resume=never"),
            tmp_path / "r",
        )
    assert (tmp_path / "r" / "metrics.csv").read_bytes() == before
    # trainer.resume=auto (the default): the run is complete, nothing is trained or written
    train(cfg, tmp_path / "r")
    assert (tmp_path / "r" / "metrics.csv").read_bytes() == before


def test_cli_text_data_relative_path_from_another_directory(tmp_path):
    corpus = tmp_path / "work" / "corpus.txt"
    corpus.parent.mkdir()
    docs = [
        f"Document {i}: the quick brown fox number {i} jumps over the lazy dog again and again."
        for i in range(60)
    ]
    corpus.write_text("\n\n".join(docs))
    result = cli(
        [
            "data=text",
            "data.text_path=corpus.txt",
            "data.eval_fraction=0.2",
            "trainer.steps=3",
            "attention=mha",
            "routing=random",
            "trainer.seq_len=16",
            "trainer.micro_batch=2",
            *FAST[4:],
        ],
        cwd=corpus.parent,
    )
    assert result.returncode == 0, result.stderr
    # no run.name: the default one, runs/<model>-<attention>-<routing>-<date>-<time>-<random>
    (run_dir,) = (corpus.parent / "runs").iterdir()
    assert re.fullmatch(r"tiny-mha-random-\d{8}-\d{6}-[0-9a-f]{6}", run_dir.name), run_dir.name
    rc = json.loads((run_dir / "run_config.json").read_text())
    assert rc["data"]["path"] == str(corpus.resolve())
    assert rc["run_name"] == run_dir.name
    assert (run_dir / ".hydra" / "overrides.yaml").read_text().count("data=text") == 1
    assert "step 3/3" in result.stdout  # plain log lines when stdout is not a terminal


def test_cli_multirun_writes_one_directory_per_job(tmp_path):
    result = cli(
        [
            "--multirun",
            "routing=modulo_cyclic,multi_hash",
            "data=random",
            "model.vocab_size=512",
            "trainer.steps=2",
            *FAST[:2],
            "hardware=cpu",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    jobs = sorted(p.parent for p in (tmp_path / "multirun").rglob("run_config.json"))
    assert [p.name for p in jobs] == ["0", "1"]
    strategies = [
        json.loads((p / "run_config.json").read_text())["config"]["routing"]["strategy"] for p in jobs
    ]
    assert strategies == ["modulo_cyclic", "multi_hash"]
    assert all((p / "metrics.csv").is_file() for p in jobs)


def test_a_device_without_float64_gets_no_float64_tensor(tmp_path, monkeypatch):
    """MPS has no float64: the loop's running sums take env.sum_dtype (float32 there). Simulated on the CPU
    (no MPS here) by giving the CPU MPS's answer; every float64 tensor the run still makes must then be a
    host-side value, never one of the sums a device would hold."""
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    from trmoe.runtime import env

    monkeypatch.setattr(env, "sum_dtype", lambda device: torch.float32)
    made = set()

    class Float64Outputs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            leaves = torch.utils._pytree.tree_leaves(out)
            if any(isinstance(o, torch.Tensor) and o.dtype == torch.float64 for o in leaves):
                stack = traceback.extract_stack()
                frames = [f.name for f in stack if "/trmoe/" in f.filename and not f.name.startswith("<")]
                made.add(frames[-1] if frames else "?")
            return out

    cfg = compose_config(
        *FAST,
        *SMALL_VOCAB,
        "trainer.steps=4",
        "trainer.log_every=2",
        "trainer.eval_every=2",
        "telemetry.moe=true",
    )
    with Float64Outputs():
        train(cfg, tmp_path / "r")
    # host values: the window's token count (summed over ranks) and p's exact route weights, rounded once
    assert made <= {"totals", "all_reduce_sum", "primary_weight"}, made
    rows = metrics_rows(tmp_path / "r")
    assert all(math.isfinite(float(r["train_loss"])) for r in rows[1:])


@pytest.mark.subprocess
def test_log_lines_print_above_the_progress_bar(tmp_path):
    """run.progress=bar: the log lines (evaluations, checkpoints) print on lines of their own, not into
    the bar's line. stdout (the log) and stderr (the bar) share one pipe here, as they share a terminal."""
    import os
    import subprocess
    import sys

    args = [*FAST, "trainer.steps=4", "trainer.eval_every=2", "run.progress=bar", "run.name=bar"]
    args += ["data=random", "model.vocab_size=512"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "trmoe.train", *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:]
    segments = [s for line in out.stdout.split("\n") for s in line.split("\r")]
    logged = [s for s in segments if "][trmoe][INFO]" in s]
    assert any("| eval " in s for s in logged) and any("step/s" in s for s in segments)
    assert all(s.startswith("[") for s in logged), [s for s in logged if not s.startswith("[")]


def test_hardware_settings_are_set_both_ways_for_the_next_job_of_a_process():
    """Sweep jobs share one process: hardware.threads=null and deterministic=false must undo what the job
    before them set."""
    from trmoe.config.schema import HardwareConfig
    from trmoe.runtime import env

    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:
        env.configure(HardwareConfig(threads=1, deterministic=True), torch.device("cpu"))
        assert torch.get_num_threads() == 1 and torch.are_deterministic_algorithms_enabled()
        env.configure(HardwareConfig(threads=None, deterministic=False), torch.device("cpu"))
        assert torch.get_num_threads() == env._STARTUP_THREADS
        assert not torch.are_deterministic_algorithms_enabled()
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def test_a_failed_run_with_the_progress_bar_leaves_no_log_handler_behind(tmp_path, monkeypatch):
    """The bar redirects logging; a run that fails must undo it before its train.log is detached, or the
    next run in the process logs into the failed run's file."""
    import gc
    import logging

    from trmoe.train.scheduler import Scheduler

    real_begin = Scheduler.begin_step

    def failing(self, step):
        if step == 2:
            raise RuntimeError("a fault in step 2")
        return real_begin(self, step)

    monkeypatch.setattr(Scheduler, "begin_step", failing)
    with pytest.raises(RuntimeError, match="a fault in step 2"):
        train(compose_config(*FAST, *SMALL_VOCAB, "trainer.steps=3", "run.progress=bar"), tmp_path / "failed")
    gc.collect()  # a redirect left open restores its saved handlers when collected
    files = [h.baseFilename for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    assert not any("failed" in name for name in files), files
