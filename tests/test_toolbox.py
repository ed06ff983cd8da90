"""What a run shows while it runs (train.log in progress-bar mode, MFU and peak memory in metrics.csv and the
progress line) and the debug presets (conf/debug/: fast, overfit, profile, anomaly), on real tiny runs."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import compose_config, metrics_rows
from presets import FAST_CPU

from trmoe.config.resolve import to_config
from trmoe.config.spec import model_spec
from trmoe.errors import RunFailed, UserError
from trmoe.model.flops import flops_per_token
from trmoe.model.transformer import TRMoETransformer, count_parameters
from trmoe.run import status
from trmoe.train.loop import train
from trmoe.train.objective import Objective

FAST = [*FAST_CPU, "trainer.micro_batch=2", "trainer.log_every=2"]


def test_progress_bar_mode_keeps_every_log_line_in_train_log(tmp_path, one_thread, capsys):
    cfg = compose_config(*FAST, "run.progress=bar", "trainer.steps=6", "trainer.eval_every=4")
    train(cfg, tmp_path / "r")
    log = (tmp_path / "r" / "train.log").read_text()
    for step in (1, 2, 4, 6):
        assert f"step {step}/6 | loss " in log
    assert "| mfu " in log and "| mem " in log
    console = capsys.readouterr()
    assert "step 4/6 | loss" not in console.out  # on the console the bar shows it
    for step in (4, 6):  # each evaluation printed as a line of its own, not only in the bar
        assert f"step {step} | eval " in console.out + console.err


def test_an_mfu_above_the_peak_is_never_shown(tmp_path, one_thread):
    """A window faster than the peak (a measured CPU peak that read low gave 105.8%) is no MFU: the cell is
    empty, the log line says n/a, train.log says why once, and the report shows n/a (also when it derives
    MFU from tok/s against a peak of its own)."""
    from trmoe.report.runs import load_runs
    from trmoe.report.summary import summarize

    # (a peak this low makes a day of 4 tiny steps: the wall-time limit is lifted)
    peak = ("hardware.peak_tflops=1e-9", "trainer.max_hours=null")
    cfg = compose_config(*FAST, "trainer.steps=4", *peak, "run.progress=log")
    train(cfg, tmp_path / "r")
    rows = [r for r in metrics_rows(tmp_path / "r") if r["step"] != "0"]
    assert rows and all(float(r["tok_s"]) > 0 and r["mfu"] in ("", "nan") for r in rows), rows
    log = (tmp_path / "r" / "train.log").read_text()
    assert log.count("MFU not shown: a window ran at ") == 1 and "| mfu n/a |" in log
    (run,) = load_runs([tmp_path / "r"])
    assert summarize(run).mfu is None and summarize(run, peak_override=1.0).mfu is None


def test_mfu_and_peak_memory_are_metrics_columns(tmp_path, one_thread):
    cfg = compose_config(*FAST, "trainer.steps=4", "hardware.peak_tflops=0.5")
    train(cfg, tmp_path / "r")
    rows = [r for r in metrics_rows(tmp_path / "r") if r["step"] != "0"]
    config = to_config(cfg)
    spec = model_spec(config)
    flops = flops_per_token(spec, count_parameters(TRMoETransformer(spec)), config.trainer.seq_len)
    for row in rows:  # against the given peak: tokens/s x FLOPs per token / peak
        assert float(row["mfu"]) == pytest.approx(float(row["tok_s"]) * flops / 0.5e12, rel=1e-6)
        assert 0 < float(row["peak_mem_gib"]) < 64
    log = (tmp_path / "r" / "train.log").read_text()
    assert "peak 0.5 TFLOP/s (hardware.peak_tflops)" in log

    probe = tmp_path / "probe"
    horizon = ["checkpoint.every_steps=2", "optimizer.decay_steps=4", "optimizer.warmup_steps=1"]
    train(compose_config(*FAST, "trainer.steps=2", *horizon), probe)  # CPU: a measured peak
    assert "TFLOP/s (measured 1024^3 float32 GEMM)" in (probe / "train.log").read_text()
    mfu = [float(r["mfu"]) for r in metrics_rows(probe) if r["step"] != "0"]
    assert all(0 < m < 1 for m in mfu), mfu
    recorded = json.loads((probe / "run_config.json").read_text())["mfu_peak"]
    assert recorded["source"] == "measured 1024^3 float32 GEMM" and recorded["flops"] > 0
    # a resumed attempt's MFU is against the same peak (re-measuring on a loaded machine moved it 3x)
    train(compose_config(*FAST, "trainer.steps=4", *horizon), probe)
    again = json.loads((probe / "run_config.json").read_text())["mfu_peak"]
    assert again["flops"] == recorded["flops"]
    assert again["source"] == "measured 1024^3 float32 GEMM, recorded by the first attempt"
    # never above the peak measured the same way: the best of several GEMMs of that size, one thread
    from trmoe.runtime.peak import probe_peak_flops

    best = max(recorded["flops"], probe_peak_flops(torch.device("cpu"), torch.float32))
    flops = flops_per_token(spec, count_parameters(TRMoETransformer(spec)), config.trainer.seq_len)
    for row in metrics_rows(probe)[1:]:
        assert float(row["tok_s"]) * flops <= best, row


def test_debug_fast_runs_two_steps_and_writes_no_checkpoint(tmp_path, one_thread):
    run_dir = tmp_path / "r"
    train(compose_config(*FAST_CPU, "debug=fast"), run_dir)
    assert [r["step"] for r in metrics_rows(run_dir)] == ["0", "1", "2"]
    assert list((run_dir / "checkpoints").rglob("*")) == []  # (nor a directory of its own, as it happens)
    assert status.read_status(run_dir)["status"] == status.FINISHED
    assert (
        "checkpoint.enabled=false: no checkpoint is written; this run cannot be resumed"
        in (run_dir / "train.log").read_text()
    )
    # launched again it cannot resume: it starts over at step 0, as a run killed before a checkpoint does
    train(compose_config(*FAST_CPU, "debug=fast"), run_dir)
    assert "=== restart from step 0" in (run_dir / "train.log").read_text()
    assert [r["step"] for r in metrics_rows(run_dir)] == ["0", "1", "2"]
    assert list((run_dir / "checkpoints").rglob("*")) == []


def test_a_guard_stop_without_checkpoints_saves_nothing_and_says_so(tmp_path, one_thread, monkeypatch):
    real = Objective.forward
    monkeypatch.setattr(
        Objective, "forward", lambda self, inputs, targets=None: real(self, inputs, targets) * float("nan")
    )
    with pytest.raises(RunFailed, match=r"the last good state is not saved \(checkpoint.enabled=false\)"):
        train(compose_config(*FAST_CPU, "debug=fast", "guard.max_skips=1"), tmp_path / "r")
    assert list((tmp_path / "r" / "checkpoints").rglob("*")) == []


def test_a_spike_rollback_without_checkpoints_is_one_line_naming_both_keys():
    with pytest.raises(UserError) as e:
        to_config(compose_config(*FAST_CPU, "debug=fast", "guard.spike_policy=rollback"))
    assert str(e.value).startswith("config error: guard.spike_policy=rollback: ")
    assert "checkpoint.enabled=false" in str(e.value) and "\n" not in str(e.value)


def test_debug_overfit_drives_the_loss_of_one_batch_near_zero(tmp_path, one_thread):
    train(compose_config(*FAST, "debug=overfit", "trainer.steps=80", "trainer.log_every=20"), tmp_path / "r")
    losses = [float(r["train_loss"]) for r in metrics_rows(tmp_path / "r") if r["step"] != "0"]
    assert losses[0] > 5 and losses[-1] < 0.1, losses
    # without it, the same run on fresh batches of random ids stays near ln(256)
    train(
        compose_config(*FAST, "trainer.steps=80", "trainer.log_every=20", "optimizer.lr=3e-3"), tmp_path / "b"
    )
    assert float(metrics_rows(tmp_path / "b")[-1]["train_loss"]) > 4.5


def test_debug_profile_writes_a_trace_and_the_top_ops(tmp_path, one_thread):
    train(compose_config(*FAST, "debug=profile", "trainer.steps=10"), tmp_path / "r")  # as documented
    traces = list((tmp_path / "r" / "profile").glob("*.pt.trace.json"))
    assert len(traces) == 1  # one trace of the documented steps, not one per 4 steps
    events = json.loads(traces[0].read_text())["traceEvents"]
    steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#2", "ProfilerStep#3"}  # wait 1 (step 1), warm-up 1 (step 2): steps 3, 4
    log = (tmp_path / "r" / "train.log").read_text()
    assert "profile of 2 steps" in log and "Self CPU %" in log and "aten::" in log


@pytest.mark.filterwarnings("ignore:Error detected in")  # anomaly mode's warning with the forward's stack
def test_debug_anomaly_names_the_op_of_a_nan_gradient(tmp_path, one_thread, monkeypatch):
    """A NaN made in the backward (injected from outside: sqrt at 0 has an infinite derivative, times 0)."""
    real = Objective.forward

    def forward(self, inputs, targets=None):
        hidden = real(self, inputs, targets)
        zero = (hidden - hidden.detach()).sum() * 0
        return hidden + torch.sqrt(zero)

    monkeypatch.setattr(Objective, "forward", forward)
    train(compose_config(*FAST, "trainer.steps=2", "guard.max_skips=5"), tmp_path / "skips")
    rows = metrics_rows(tmp_path / "skips")
    assert rows[-1]["skipped_steps"] == "2"  # without anomaly mode: skipped as non-finite, silently
    assert not torch.is_anomaly_enabled()
    with pytest.raises(RuntimeError, match=r"Function '\w+Backward\d*' returned nan values"):
        train(compose_config(*FAST, "trainer.steps=2", "debug=anomaly"), tmp_path / "anomaly")
    assert not torch.is_anomaly_enabled()  # left as it was
