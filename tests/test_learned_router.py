"""routing=learned, the learned-router control: its forward and loss terms against their formulas, its
gradients by finite differences, its parameters in the counts and in trmoe.match, and training with it:
bit-exact resume, DDP and FSDP equal to the single process over the same micro-batches."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import TIMING_COLUMNS, cli, compose_config, drive, launch_ranks, metrics_rows
from presets import LEARNED_RUN as RUN

from trmoe.config.resolve import to_config
from trmoe.config.spec import model_spec
from trmoe.model.moe import TRMoEFFN, swiglu
from trmoe.model.spec import ffn_spec
from trmoe.model.transformer import TRMoETransformer, count_parameters, parameter_counts
from trmoe.run.checkpoint import load_checkpoint
from trmoe.train.loop import train

H, E, K = 8, 4, 2


def _ffn(shared: int = 6, top_k: int = K) -> TRMoEFFN:
    torch.manual_seed(0)
    spec = ffn_spec(hidden_size=H, shared_width=shared, routed_width=E * 4, num_experts=E, top_k=top_k)
    ffn = TRMoEFFN(spec.__class__(**{**spec.__dict__, "strategy": "learned"}), layer=0).double()
    for p in ffn.parameters():
        torch.nn.init.normal_(p, 0.0, 0.5)
    return ffn


def test_forward_and_loss_terms_follow_their_formulas():
    ffn = _ffn()
    x = torch.randn(2, 13, H, dtype=torch.float64)
    y = ffn(x, torch.zeros(2, 13, dtype=torch.long))
    aux, z = ffn.router_terms["aux"], ffn.router_terms["z"]
    flat = x.reshape(-1, H)
    logits = flat @ ffn.router.T
    probs = logits.softmax(-1)
    top = probs.topk(K, dim=-1)
    weights = top.values / top.values.sum(-1, keepdim=True)
    expected = swiglu(flat, ffn.shared.w_in, ffn.shared.w_out)
    for n in range(flat.shape[0]):
        for k in range(K):
            e = int(top.indices[n, k])
            expected[n] += weights[n, k] * swiglu(flat[n : n + 1], ffn.routed.w_in[e], ffn.routed.w_out[e])[0]
    torch.testing.assert_close(y.reshape(-1, H), expected, rtol=1e-12, atol=1e-12)
    share = torch.bincount(top.indices.reshape(-1), minlength=E).double() / (flat.shape[0] * K)
    torch.testing.assert_close(aux, E * (share * probs.mean(0)).sum())
    torch.testing.assert_close(z, torch.logsumexp(logits, -1).square().mean())
    # the routed telemetry reads what the router chose
    assert torch.equal(ffn.routed.routes(torch.zeros(26, dtype=torch.long)), top.indices.T.reshape(-1))


def test_a_uniform_router_has_aux_1():
    ffn = _ffn()
    with torch.no_grad():
        ffn.router.zero_()
    with torch.no_grad():
        ffn(torch.randn(20, H, dtype=torch.float64), torch.zeros(20, dtype=torch.long))
    assert ffn.router_terms["aux"].item() == pytest.approx(1.0, abs=1e-12)


def test_gradients_match_finite_differences():
    ffn = _ffn()
    x = torch.randn(11, H, dtype=torch.float64, requires_grad=True)
    ids = torch.zeros(11, dtype=torch.long)
    names = ["router", "routed.w_in", "routed.w_out", "shared.w_in"]
    params = [dict(ffn.named_parameters())[n].detach().clone().requires_grad_() for n in names]

    def fn(x, *tensors):
        y = torch.func.functional_call(ffn, dict(zip(names, tensors, strict=True)), (x, ids))
        return y, ffn.router_terms["aux"], ffn.router_terms["z"]

    assert torch.autograd.gradcheck(fn, (x, *params), eps=1e-6, atol=1e-6, rtol=1e-5)


def test_activation_checkpointing_keeps_the_router_losses_and_their_gradients():
    """trainer.activation_checkpointing recomputes each block in the backward: the loss terms, taken from
    the first forward, still reach the router (the same gradients as without recomputation)."""
    spec = model_spec(to_config(compose_config("model=tiny", "model.vocab_size=300", "routing=learned")))
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    grads = []
    for recompute in (False, True):
        torch.manual_seed(0)
        model = TRMoETransformer(spec)
        model.activation_checkpointing = recompute
        hidden = model(ids)
        terms = model.router_losses()
        assert model.router_losses() is None  # taking them clears them
        (hidden.square().mean() + 0.5 * terms["aux"] + 0.1 * terms["z"]).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert float(grads[0][0].abs().max()) > 0 and float(model.blocks[0].ffn.router.grad.abs().max()) > 0
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_router_parameters_are_counted_total_and_active():
    base = ["model=tiny", "model.vocab_size=512"]
    fixed = parameter_counts(model_spec(to_config(compose_config(*base))))
    spec = model_spec(to_config(compose_config(*base, "routing=learned")))
    learned = parameter_counts(spec)
    router = spec.num_layers * spec.num_experts * spec.hidden_size
    assert learned.total - fixed.total == router and learned.active - fixed.active == router
    torch.manual_seed(0)
    model = TRMoETransformer(spec)
    assert count_parameters(model) == learned
    assert model.blocks[0].ffn.router.shape == (spec.num_experts, spec.hidden_size)
    assert "blocks.0.ffn.routed.route_table" not in model.state_dict()


def test_match_prints_the_learned_arm(tmp_path):
    out = cli(
        ["model=tiny", "model.gates=false", "--arm", "routing=modulo_cyclic", "--arm", "routing=learned"],
        tmp_path,
        module="trmoe.match",
    )
    assert out.returncode == 0, out.stderr
    spec = model_spec(to_config(compose_config("model=tiny", "model.gates=false", "routing=learned")))
    counts = parameter_counts(spec)
    assert "learned top-2" in out.stdout
    assert f"{counts.total:,}" in out.stdout and f"{counts.active:,}" in out.stdout


# ------------------------------------------------------------------------------------------ training


@pytest.mark.subprocess
def test_kill_then_resume_is_bit_exact(tmp_path):
    args = [*RUN, "run.name=r", "trainer.micro_batch=2", "trainer.steps=8", "trainer.log_every=1"]
    args += ["checkpoint.every_steps=4"]
    threads = torch.get_num_threads()
    try:
        train(compose_config(*args), tmp_path / "base")
    finally:
        torch.set_num_threads(threads)
    killed = drive("step:6:forward", tmp_path, *args)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    run_dir = tmp_path / "runs" / "r"
    try:
        train(compose_config(*args), run_dir)
    finally:
        torch.set_num_threads(threads)
    assert "=== resume from step 4 " in (run_dir / "train.log").read_text()
    a, b = load_checkpoint(run_dir), load_checkpoint(tmp_path / "base")
    assert any(key.endswith("ffn.router") for key in a["model"])
    for key in b["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    for index, state in b["optimizer"]["state"].items():
        for name, value in state.items():
            assert torch.equal(a["optimizer"]["state"][index][name], value), (index, name)
    rows_a, rows_b = metrics_rows(run_dir), metrics_rows(tmp_path / "base")
    assert len(rows_a) == len(rows_b) == 9
    for ra, rb in zip(rows_a, rows_b, strict=True):
        for column in ra:
            if column not in TIMING_COLUMNS:
                assert ra[column] == rb[column], (ra["step"], column)
    trained = [r for r in rows_b if int(r["step"]) > 0]
    assert all(0.99 < float(r["router_aux"]) < 2.0 and float(r["router_z"]) > 0 for r in trained)
    assert all(r["expert_imbalance"] not in ("", "nan") for r in trained)


def _launch(run_dir: Path, overrides: list[str], nproc: int) -> subprocess.CompletedProcess:
    """nproc ranks (helpers.launch_ranks) for nproc > 1; the single process in this one (it needs no process
    of its own)."""
    steps = ["trainer.steps=4", "trainer.log_every=1"]
    if nproc == 1:
        threads = torch.get_num_threads()
        try:
            train(compose_config(*RUN, *steps, *overrides), run_dir)
        finally:
            torch.set_num_threads(threads)
        return subprocess.CompletedProcess(["train"], 0, "", "")
    return launch_ranks([*RUN, *steps, *overrides], nproc, run_dir)


@pytest.mark.subprocess
def test_ddp_and_fsdp_equal_the_single_process_over_the_same_micro_batches(tmp_path):
    """The loss terms are per micro-batch (the reference's form, no collective in the forward): one process
    accumulating micro-batches [0, 1] and [2, 3] equals two ranks holding one each."""
    cases = {
        "single": (["trainer.micro_batch=2", "trainer.grad_accum=2"], 1),
        "ddp": (["trainer.micro_batch=2"], 2),
        "fsdp": (["trainer.micro_batch=2", "hardware.strategy=fsdp"], 2),
    }
    figures = {}
    for name, (overrides, nproc) in cases.items():
        out = _launch(tmp_path / name, overrides, nproc)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        rows = [r for r in metrics_rows(tmp_path / name) if int(r["step"]) > 0]
        figures[name] = [[float(r[c]) for c in ("train_loss", "router_aux", "router_z")] for r in rows]
    assert len(figures["single"]) == 4
    for name in ("ddp", "fsdp"):
        for got, want in zip(figures[name], figures["single"], strict=True):
            assert got == pytest.approx(want, rel=1e-5, abs=1e-6), name
