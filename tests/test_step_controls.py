"""Step controls: gradient accumulation equals the larger batch, clipping is logged before it acts,
activation checkpointing and shared-expert chunking change memory and not results, torch.compile agrees
with eager."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from helpers import compose_config, watch_training
from presets import FAST_CPU
from torch.optim.optimizer import register_optimizer_step_pre_hook

from trmoe.config.resolve import to_config
from trmoe.config.spec import model_spec
from trmoe.errors import UserError
from trmoe.loss.tied import chunked_tied_ce
from trmoe.model.moe import SharedExpert
from trmoe.model.transformer import TRMoETransformer
from trmoe.run.checkpoint import load_checkpoint
from trmoe.train.loop import train

FAST = [
    *FAST_CPU,
    "optimizer.warmup_steps=1",
]


pytestmark = pytest.mark.usefixtures("one_thread")


def rows(run_dir) -> list[dict]:
    with open(run_dir / "metrics.csv") as f:
        return list(csv.DictReader(f))[1:]


def weights(run_dir) -> dict:
    return load_checkpoint(run_dir / "checkpoints")["model"]


def saved_bytes(fn, existing):
    """Run fn() and return (its result, bytes of the new tensors autograd saved for the backward: those
    not sharing storage with `existing` tensors such as the parameters and the inputs)."""
    total = 0
    known = {t.untyped_storage().data_ptr() for t in existing}

    def pack(t):
        nonlocal total
        if t.untyped_storage().data_ptr() not in known:
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total


def test_four_micro_batches_equal_one_four_times_larger_batch(tmp_path):
    common = [*FAST, "trainer.steps=2", "trainer.log_every=1", "trainer.grad_clip=0"]
    train(compose_config(*common, "trainer.micro_batch=8"), tmp_path / "big")
    train(compose_config(*common, "trainer.micro_batch=2", "trainer.grad_accum=4"), tmp_path / "acc")
    for a, b in zip(rows(tmp_path / "big"), rows(tmp_path / "acc"), strict=True):
        assert a["tokens"] == b["tokens"] == str(int(a["step"]) * 8 * 16)
        assert float(a["train_loss"]) == pytest.approx(float(b["train_loss"]), abs=1e-6)
        # the gradient itself (norm before clipping): normalised by the tokens of all 4 micro-batches
        assert float(a["grad_norm"]) == pytest.approx(float(b["grad_norm"]), rel=1e-5)
    wa, wb = weights(tmp_path / "big"), weights(tmp_path / "acc")
    for key in wa:  # Adam divides by sqrt(v): gradients that are ~0 can differ by a few ulps in sign
        torch.testing.assert_close(wa[key], wb[key], rtol=1e-4, atol=1e-4)


def test_clipping_acts_but_the_logged_norm_is_before_clipping(tmp_path):
    common = [*FAST, "trainer.steps=2", "trainer.log_every=1", "trainer.micro_batch=2"]
    seen: list[float] = []  # the global norm of the gradients each optimizer step is taken with

    def gradient_norm(optimizer, args, kwargs):
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        seen.append(float(torch.linalg.vector_norm(torch.stack([g.double().norm() for g in grads]))))

    handle = register_optimizer_step_pre_hook(gradient_norm)
    try:
        train(compose_config(*common, "trainer.grad_clip=0"), tmp_path / "off")
        seen_off, seen[:] = list(seen), []
        train(compose_config(*common, "trainer.grad_clip=1e-4"), tmp_path / "on")
    finally:
        handle.remove()
    assert rows(tmp_path / "off")[0]["grad_norm"] == rows(tmp_path / "on")[0]["grad_norm"]
    logged_off = [float(r["grad_norm"]) for r in rows(tmp_path / "off")]
    logged_on = [float(r["grad_norm"]) for r in rows(tmp_path / "on")]
    assert min(logged_on) > 1e-3
    # off: the optimizer sees the logged norm; on: the logged norm is before clipping, the optimizer sees
    # it clipped to grad_clip (clip_grad_norm_ scales by max_norm / (norm + 1e-6))
    assert seen_off == pytest.approx(logged_off, rel=1e-5)
    assert seen == pytest.approx([n * min(1.0, 1e-4 / (n + 1e-6)) for n in logged_on], rel=1e-5)
    wa, wb = weights(tmp_path / "off"), weights(tmp_path / "on")
    assert any(not torch.equal(wa[k], wb[k]) for k in wa)


def model_and_batch(*overrides: str):
    cfg = to_config(compose_config("data=random", "model.vocab_size=128", *overrides))
    torch.manual_seed(0)
    model = TRMoETransformer(model_spec(cfg))
    g = torch.Generator().manual_seed(1)
    return model, torch.randint(0, 128, (2, 32), generator=g), torch.randint(0, 128, (2, 32), generator=g)


def loss_and_grads(model, x, y):
    model.zero_grad(set_to_none=True)
    existing = [*model.parameters(), *model.buffers(), x, y]
    sums, nbytes = saved_bytes(lambda: chunked_tied_ce(model(x), model.head_weight, y), existing)
    (sums.total / sums.tokens).backward()
    return float(sums.total.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}, nbytes


def test_activation_checkpointing_recomputes_blocks_and_changes_nothing_else():
    model, x, y = model_and_batch()
    calls = []
    attention = model.blocks[0].attn.forward  # counts runs of block 0 (module hooks skip recomputation)
    model.blocks[0].attn.forward = lambda *a, **k: calls.append(1) or attention(*a, **k)
    loss_a, grads_a, bytes_a = loss_and_grads(model, x, y)
    assert len(calls) == 1
    model.activation_checkpointing = True
    calls.clear()
    loss_b, grads_b, bytes_b = loss_and_grads(model, x, y)
    assert len(calls) == 2  # the forward, and its recomputation in the backward
    assert bytes_b < 0.6 * bytes_a  # only block inputs are kept
    assert loss_a == loss_b
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-6, atol=1e-7)
    with torch.no_grad():  # evaluation: nothing to recompute
        calls.clear()
        model(x)
        assert len(calls) == 1


def test_shared_expert_token_chunking_is_memory_only():
    torch.manual_seed(0)
    shared = SharedExpert(32, 96)
    for p in shared.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(50, 32, requires_grad=True)

    def run(chunk):
        shared.chunk_tokens = chunk
        shared.zero_grad(set_to_none=True)
        x.grad = None
        out, nbytes = saved_bytes(lambda: shared(x), [x, *shared.parameters()])
        out.pow(2).sum().backward()
        return out.detach(), x.grad.clone(), shared.w_in.grad.clone(), shared.w_out.grad.clone(), nbytes

    whole, chunked = run(0), run(16)  # 50 tokens: chunks of 16, 16, 16, 2
    for a, b in zip(whole[:4], chunked[:4], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert chunked[4] < 0.5 * whole[4]  # the [n, 3W] intermediates are recomputed, not kept
    with torch.no_grad():
        torch.testing.assert_close(shared(x), whole[0], rtol=1e-6, atol=1e-6)


def test_memory_controls_leave_the_run_unchanged(tmp_path, monkeypatch):
    runs = watch_training(monkeypatch)
    common = [*FAST, "trainer.steps=3", "trainer.log_every=1", "trainer.micro_batch=2"]
    train(compose_config(*common), tmp_path / "plain")
    train(
        compose_config(*common, "trainer.activation_checkpointing=true", "trainer.shared_chunk_tokens=8"),
        tmp_path / "lean",
    )
    rc = json.loads((tmp_path / "lean" / "run_config.json").read_text())
    assert rc["config"]["trainer"]["activation_checkpointing"] is True
    assert rc["config"]["trainer"]["shared_chunk_tokens"] == 8
    # the settings reached the model, and it recomputed: block 0 ran once more in the backward of each of
    # the 3 steps, and the shared expert took 8 of the 2 x 16 tokens at a time (plain: one SwiGLU over all
    # 32 per layer and step). test_shared_expert_token_chunking_is_memory_only checks the chunks' checkpoint.
    plain, lean = runs
    model = lean["controls"].model
    assert model.activation_checkpointing is True
    assert [b.ffn.shared.chunk_tokens for b in model.blocks] == [8] * len(model.blocks)
    assert plain["attention"] == 3 and lean["attention"] == 2 * 3
    assert plain["shared_rows"] == [32] * 3 * len(model.blocks)
    assert lean["shared_rows"] and set(lean["shared_rows"]) == {8}
    for a, b in zip(rows(tmp_path / "plain"), rows(tmp_path / "lean"), strict=True):
        assert float(a["train_loss"]) == pytest.approx(float(b["train_loss"]), abs=1e-6)
        assert float(a["grad_norm"]) == pytest.approx(float(b["grad_norm"]), rel=1e-5)


def compile_check(tmp_path, backend: str):
    common = [*FAST, "trainer.steps=3", "trainer.log_every=1", "trainer.micro_batch=2"]
    train(compose_config(*common), tmp_path / "eager")
    train(
        compose_config(*common, "trainer.compile=true", f"trainer.compile_backend={backend}"),
        tmp_path / "compiled",
    )
    rc = json.loads((tmp_path / "compiled" / "run_config.json").read_text())
    assert rc["controls"]["compile"] == {"enabled": True, "backend": backend}
    for a, b in zip(rows(tmp_path / "eager"), rows(tmp_path / "compiled"), strict=True):
        assert float(a["train_loss"]) == pytest.approx(float(b["train_loss"]), abs=1e-5)
        assert float(a["grad_norm"]) == pytest.approx(float(b["grad_norm"]), rel=1e-4)


def test_compile_agrees_with_eager(tmp_path, monkeypatch):
    """aot_eager traces the model with dynamo and AOT autograd (the graph capture torch.compile does)
    without inductor's C++ code generation, which takes about a minute on a CPU; the inductor variant
    runs with TRMOE_SLOW_TESTS=1."""
    from torch._dynamo.utils import counters

    compiled = []
    real = torch.compile

    def spy(model, **kwargs):
        counters.clear()  # what dynamo compiles from here on: the training forward of the compiled run
        module = real(model, **kwargs)
        calls: list[int] = []
        module.register_forward_pre_hook(lambda *args: calls.append(1))
        compiled.append((kwargs, calls))
        return module

    monkeypatch.setattr(torch, "compile", spy)
    compile_check(tmp_path, "aot_eager")
    assert [kwargs for kwargs, _ in compiled] == [{"backend": "aot_eager"}]
    # the compiled module is the one that trains (3 steps, one micro-batch each), through dynamo's graphs
    assert len(compiled[0][1]) == 3
    assert counters["stats"]["unique_graphs"] >= 1 and counters["aot_autograd"]["ok"] >= 1


@pytest.mark.slow(opt_in="inductor on CPU compiles for ~1 min")
def test_compile_with_inductor_agrees_with_eager(tmp_path):
    compile_check(tmp_path, "inductor")


def test_unknown_compile_backend_is_a_config_error(tmp_path):
    with pytest.raises(UserError, match="trainer.compile_backend=nope: not a torch.compile backend"):
        train(compose_config(*FAST, "trainer.compile=true", "trainer.compile_backend=nope"), tmp_path / "x")
    assert not (tmp_path / "x").exists()
