"""Expert telemetry: nothing when off; when on, per-layer shares, imbalance, dead experts counted per
layer, branch RMS, gates and grad norms, aggregated into metrics.csv and shown by the progress display."""

from __future__ import annotations

import csv
import logging

import pytest
import torch
from helpers import compose_config, watch_training
from presets import FAST_CPU

from trmoe.config.resolve import to_config
from trmoe.config.schema import Progress
from trmoe.config.spec import model_spec
from trmoe.loss.tied import chunked_tied_ce
from trmoe.model.transformer import TRMoETransformer
from trmoe.train.loop import train
from trmoe.train.observe.progress import ProgressReporter
from trmoe.train.observe.telemetry import MoETelemetry

FAST = [
    *FAST_CPU,
    "trainer.micro_batch=2",
]
EXPERT_COLUMNS = ("expert_imbalance", "expert_dead", "shared_rms", "routed_rms", "grad_norm_shared")


pytestmark = pytest.mark.usefixtures("one_thread")


def read(path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def tiny_model():
    cfg = to_config(compose_config("data=random", "model.vocab_size=64"))
    torch.manual_seed(0)
    return TRMoETransformer(model_spec(cfg))


def test_off_costs_nothing_and_writes_nothing(tmp_path, monkeypatch):
    runs = watch_training(monkeypatch)
    made, recorded = [], []
    real_init, real_recording = MoETelemetry.__init__, MoETelemetry.recording

    def init(self, *args, **kwargs):
        made.append(self)
        real_init(self, *args, **kwargs)

    def recording(self):
        recorded.append(self)
        return real_recording(self)

    monkeypatch.setattr(MoETelemetry, "__init__", init)
    monkeypatch.setattr(MoETelemetry, "recording", recording)
    train(compose_config(*FAST, "trainer.steps=2"), tmp_path / "r")
    assert not (tmp_path / "r" / "telemetry.csv").exists()
    for row in read(tmp_path / "r" / "metrics.csv"):
        assert all(row[c] == "nan" for c in EXPERT_COLUMNS)
    # no telemetry object, no hooks on the model during the training forwards, nothing recorded
    (run,) = runs
    assert run["controls"].telemetry is None
    assert made == [] and recorded == []
    assert run["hooks"] == [0, 0]


@pytest.mark.parametrize("routing", ["modulo_cyclic", "random"])  # rows grouped by route tuple / by expert
def test_watching_does_not_change_training(tmp_path, routing):
    """Telemetry on or off: the same weights, bit for bit (it measures the routed branch without taking
    the routed rows' sum out of the shared output, where the FFN adds them)."""
    from trmoe.run.checkpoint import load_checkpoint

    for on in ("false", "true"):
        train(
            compose_config(*FAST, f"routing={routing}", "trainer.steps=3", f"telemetry.moe={on}"),
            tmp_path / on,
        )
    off, on = load_checkpoint(tmp_path / "false")["model"], load_checkpoint(tmp_path / "true")["model"]
    assert all(torch.equal(off[k], on[k]) for k in off), [k for k in off if not torch.equal(off[k], on[k])]


def test_on_writes_per_layer_rows_and_aggregates(tmp_path, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="trmoe")
    runs = watch_training(monkeypatch)
    train(
        compose_config(
            *FAST,
            "telemetry.moe=true",
            "trainer.steps=4",
            "trainer.log_every=2",
            "trainer.grad_accum=2",
            "trainer.activation_checkpointing=true",  # recomputation must not count twice
        ),
        tmp_path / "r",
    )
    # the hooks were there, and every block ran again in the backward (4 steps x 2 micro-batches, each
    # forward recomputed) while route_slots below count each training forward once
    (run,) = runs
    assert run["controls"].model.activation_checkpointing is True
    assert run["hooks"] == [2 * 2] * 4 * 2  # shared and routed hook in each of the 2 layers
    assert run["attention"] == 2 * 4 * 2
    layers = read(tmp_path / "r" / "telemetry.csv")
    metrics = read(tmp_path / "r" / "metrics.csv")[1:]
    assert [(int(r["step"]), int(r["layer"])) for r in layers] == [
        (s, lay) for s in (1, 2, 4) for lay in (0, 1)
    ]
    per_step = 2 * 2 * 16 * 2  # micro_batch x accum x seq_len tokens, K = 2 route slots each
    assert [int(r["route_slots"]) for r in layers] == [per_step] * 4 + [2 * per_step] * 2
    for r in layers:
        shares = [float(r[f"share_{e}"]) for e in range(4)]
        assert sum(shares) == pytest.approx(1.0, abs=1e-5)
        assert float(r["imbalance"]) == pytest.approx(max(shares) * 4, rel=1e-4)
        assert int(r["dead"]) == sum(s == 0 for s in shares)
        assert float(r["shared_rms"]) > 0 and float(r["routed_rms"]) > 0
        per_expert = [float(r[f"grad_norm_{e}"]) for e in range(4)]
        assert all(g > 0 for g in per_expert)
        assert float(r["grad_norm_routed"]) >= max(per_expert)
    for m in metrics:
        rows_of_step = [r for r in layers if r["step"] == m["step"]]
        mean_imbalance = sum(float(r["imbalance"]) for r in rows_of_step) / 2
        assert float(m["expert_imbalance"]) == pytest.approx(mean_imbalance, rel=1e-4)
        assert int(m["expert_dead"]) == sum(int(r["dead"]) for r in rows_of_step)
        shared = [float(r["grad_norm_shared"]) for r in rows_of_step]
        assert float(m["grad_norm_shared"]) == pytest.approx(sum(g * g for g in shared) ** 0.5, rel=1e-4)
        assert float(m["grad_norm_shared"]) < float(m["grad_norm"])
    assert "imb " in caplog.text and "dead " in caplog.text  # the progress display shows them


def test_dead_experts_are_counted_per_layer():
    """An expert unused in layer 0 but used in layer 1 is dead (in layer 0); the reference summed the
    counts over layers first and reported it alive."""
    model = tiny_model()
    routed = model.blocks[0].ffn.routed
    table = routed.route_table
    routed.set_route_table(torch.where(table == 3, torch.zeros_like(table), table))  # layer 0 never uses 3
    tel = MoETelemetry(model, torch.device("cpu"))
    ids = torch.arange(64).reshape(2, 32)
    model(ids)  # outside recording(): an evaluation forward, not counted
    assert float(tel.counts.sum()) == 0
    with tel.recording():
        hidden = model(ids)
    sums = chunked_tied_ce(hidden, model.head_weight, ids)
    sums.total.backward()
    aggregate, rows = tel.collect(step=1, grad_sq=tel.grad_norms())
    assert [r["dead"] for r in rows] == [1, 0]
    assert aggregate["expert_dead"] == 1
    assert rows[0]["share_3"] == 0.0 and rows[0]["route_slots"] == 64 * 2
    assert rows[0]["grad_norm_3"] == 0.0  # a dead expert gets no gradient
    assert float(tel.counts.sum()) == 0  # the window restarts


def test_grad_norms_match_the_parameters_gradients():
    model = tiny_model()
    tel = MoETelemetry(model, torch.device("cpu"))
    ids = torch.arange(64).reshape(2, 32)
    chunked_tied_ce(model(ids), model.head_weight, ids).total.backward()
    sq = tel.grad_norms()
    ffn = model.blocks[1].ffn
    expert2 = ffn.routed.w_in.grad[2].pow(2).sum() + ffn.routed.w_out.grad[2].pow(2).sum()
    shared = sum(p.grad.pow(2).sum() for p in (ffn.shared.w_in, ffn.shared.w_out, ffn.shared_gate))
    routed = sum(p.grad.pow(2).sum() for p in (ffn.routed.w_in, ffn.routed.w_out, ffn.routed_gate))
    torch.testing.assert_close(sq[1, 2 + 2].float(), expert2)
    torch.testing.assert_close(sq[1, 0].float(), shared)
    torch.testing.assert_close(sq[1, 1].float(), routed)


def test_branch_rms_is_the_scaled_gated_contribution():
    """Both branches' RMS is that of what they add to the residual stream, gate x scale included."""
    model = tiny_model()
    ffn = model.blocks[0].ffn
    with torch.no_grad():
        ffn.routed_gate.fill_(0.25)
        ffn.shared_gate.fill_(3.0)
    ffn.routed_scale, ffn.shared_scale = 2.0, 0.5
    tel = MoETelemetry(model, torch.device("cpu"))
    x, ids = torch.randn(10, 64), torch.arange(10)
    with torch.no_grad():
        raw = ffn.routed(x, ids)  # not recorded: the branches without their gate x scale
        raw_shared = ffn.shared(x)
        with tel.recording():
            ffn(x, ids)
    # what the FFN adds to the residual stream: the raw branch times gate 0.25 x scale 2 (shared: 3 x 0.5)
    _, rows = tel.collect(step=1, grad_sq=None)
    assert rows[0]["routed_rms"] == pytest.approx(float(raw.pow(2).mean().sqrt() * 0.5), rel=1e-5)
    assert rows[0]["shared_rms"] == pytest.approx(float(raw_shared.pow(2).mean().sqrt() * 1.5), rel=1e-5)
    tel.remove()


def test_progress_line_shows_imbalance_and_dead(caplog):
    caplog.set_level(logging.INFO, logger="trmoe")
    row = {
        "step": 5,
        "train_loss": 3.0,
        "lr": 1e-3,
        "tok_s": 100.0,
        "expert_imbalance": 1.234,
        "expert_dead": 2,
    }
    ProgressReporter(Progress.log, 10).report(row, 10, eta_s=1.0)
    assert "imb 1.23 | dead 2" in caplog.text
    ProgressReporter(Progress.log, 10).report({**row, "expert_imbalance": None, "expert_dead": None}, 10, 1.0)
    assert caplog.text.count("imb") == 1
