"""The loss backends behind trmoe.loss.backend: each agrees with a full-logits reference, asks for
nothing it cannot do, and the run records the one it used."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import compose_config
from presets import LOSS_FAST as FAST

from trmoe.config.resolve import to_config
from trmoe.config.schema import LossBackend, LossConfig
from trmoe.errors import UserError
from trmoe.loss.backend import resolve_backend, training_loss
from trmoe.loss.tied import full_logits_ce
from trmoe.train.loop import train

CPU = torch.device("cpu")
# the torch backend needs F.linear_cross_entropy (2.13 has it, 2.11 does not); without it, a clear refusal
NEEDS_TORCH_LCE = pytest.mark.skipif(
    not hasattr(F, "linear_cross_entropy"), reason=f"torch {torch.__version__} has no F.linear_cross_entropy"
)


@pytest.fixture(autouse=True)
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def make_case(n=45, h=16, v=301, seed=0, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=dtype)
    weight = torch.randn(v, h, generator=g, dtype=dtype) * 0.5
    targets = torch.randint(0, v, (n,), generator=g)
    targets[torch.randperm(n, generator=g)[:6]] = -100
    return hidden.to(device), weight.to(device), targets.to(device)


def run(fn, hidden, weight, targets):
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    out = fn(h, w, targets)
    (out.total / out.tokens).backward()  # the loop's normalisation
    return out, h.grad, w.grad


def reference(hidden, weight, targets, eps=0.0, c=0.0):
    """Full logits in float64, gradients from autograd."""
    out, dh, dw = run(
        lambda h, w, t: full_logits_ce(h, w, t, label_smoothing=eps, z_loss=c),
        hidden.double(),
        weight.double(),
        targets,
    )
    return out, dh, dw


@pytest.mark.parametrize(
    "backend,chunk,eps,c",
    [
        (LossBackend.chunked, 7, 0.0, 0.0),
        (LossBackend.chunked, 16, 0.1, 1e-4),
        (LossBackend.chunked, 2048, 0.0, 1e-3),
        pytest.param(LossBackend.torch, 7, 0.0, 0.0, marks=NEEDS_TORCH_LCE),
        pytest.param(LossBackend.torch, 16, 0.0, 0.0, marks=NEEDS_TORCH_LCE),
        pytest.param(LossBackend.torch, 2048, 0.0, 0.0, marks=NEEDS_TORCH_LCE),
        (LossBackend.auto, 16, 0.1, 0.0),  # on CPU: chunked
    ],
)
def test_cpu_backends_match_full_logits_reference(backend, chunk, eps, c):
    cfg = LossConfig(backend=backend, chunk_tokens=chunk, label_smoothing=eps, z_loss=c)
    fn = training_loss(cfg, resolve_backend(cfg, CPU))
    hidden, weight, targets = make_case()
    out, dh, dw = run(fn, hidden, weight, targets)
    ref, ref_dh, ref_dw = reference(hidden, weight, targets, eps, c)
    close = dict(rtol=1e-5, atol=1e-5)
    assert int(out.tokens) == int(ref.tokens) == 39
    torch.testing.assert_close(out.total.double(), ref.total, **close)
    torch.testing.assert_close(out.ce.double(), ref.ce, **close)
    torch.testing.assert_close(dh.double(), ref_dh, **close)
    torch.testing.assert_close(dw.double(), ref_dw, **close)
    assert torch.all(dh[targets == -100] == 0)


@NEEDS_TORCH_LCE
def test_torch_backend_runs_pytorchs_chunked_op(monkeypatch):
    """The torch backend really goes through F.linear_cross_entropy with chunking options."""
    calls = []
    real = F.linear_cross_entropy

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "linear_cross_entropy", spy)
    cfg = LossConfig(backend=LossBackend.torch, chunk_tokens=8)
    run(training_loss(cfg, LossBackend.torch), *make_case())
    assert len(calls) == 1 and calls[0]["options"].batch_chunk_size == 8
    assert calls[0]["reduction"] == "sum" and calls[0]["ignore_index"] == -100


@pytest.mark.parametrize("override", ["loss.label_smoothing=0.1", "loss.z_loss=1e-4"])
def test_torch_backend_refuses_what_it_lacks(override):
    with pytest.raises(UserError, match=f"{override.split('=')[0]}=.*backend=torch"):
        to_config(compose_config("loss=torch", override))


def test_liger_without_cuda_stops_with_a_clear_error():
    cfg = LossConfig(backend=LossBackend.liger)
    with pytest.raises(UserError, match="liger-kernel runs on CUDA only"):
        resolve_backend(cfg, CPU)
    assert resolve_backend(LossConfig(backend=LossBackend.auto), CPU) == LossBackend.chunked


def test_liger_run_on_cpu_stops_before_writing_anything(tmp_path):
    with pytest.raises(UserError, match="loss.backend=liger: liger-kernel runs on CUDA only"):
        train(compose_config("loss=liger", *FAST, "trainer.steps=1"), tmp_path / "x")
    assert not (tmp_path / "x").exists()


@NEEDS_TORCH_LCE
def test_run_records_the_backend_and_torch_trains_like_chunked(tmp_path, monkeypatch):
    calls = []
    real = F.linear_cross_entropy

    def spy(*args, **kwargs):  # counts the calls, which the recorded config alone cannot show
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "linear_cross_entropy", spy)
    losses = {}
    for backend in ("chunked", "torch"):
        train(
            compose_config(*FAST, f"loss={backend}", "trainer.steps=3", "trainer.log_every=1"),
            tmp_path / backend,
        )
        # the torch backend runs every training step's loss (eval is always the exact chunked path)
        assert len(calls) == (3 if backend == "torch" else 0), backend
        rc = json.loads((tmp_path / backend / "run_config.json").read_text())
        assert rc["controls"]["loss_backend"] == backend
        assert rc["config"]["loss"]["backend"] == backend
        rows = (tmp_path / backend / "metrics.csv").read_text().splitlines()[2:]
        losses[backend] = [float(r.split(",")[2]) for r in rows]
    assert losses["chunked"] == pytest.approx(losses["torch"], abs=1e-4)


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="liger-kernel runs on CUDA only; no CUDA device here"
)
@pytest.mark.parametrize("eps,c", [(0.0, 0.0), (0.0, 1e-4), (0.1, 1e-4)])
def test_liger_matches_full_logits_reference_on_cuda(eps, c):
    pytest.importorskip("liger_kernel", reason="liger-kernel is not installed (pip install 'trmoe[cuda]')")
    cuda = torch.device("cuda")
    cfg = LossConfig(backend=LossBackend.liger, label_smoothing=eps, z_loss=c)
    fn = training_loss(cfg, resolve_backend(cfg, cuda))
    hidden, weight, targets = make_case(device="cuda")
    out, dh, dw = run(fn, hidden, weight, targets)
    ref, ref_dh, ref_dw = reference(hidden, weight, targets, eps, c)
    close = dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.total.double(), ref.total, **close)
    if eps == 0:
        torch.testing.assert_close(out.ce.double(), ref.ce, **close)
    else:
        assert torch.isnan(out.ce)  # liger cannot separate the pure CE from the smoothed loss
    if c > 0:
        torch.testing.assert_close(out.z.double(), ref.z, **close)
    torch.testing.assert_close(dh.double(), ref_dh, **close)
    torch.testing.assert_close(dw.double(), ref_dw, **close)


def test_compute_dtype_runs_the_head_in_bf16_and_keeps_the_master_gradient_fp32(monkeypatch):
    """An autocast run (bf16 on GPUs) gives the head's GEMMs bf16 operands; the loss and the gradients
    that reach the fp32 hidden states and master weight stay close to the exact float64 reference."""
    import trmoe.loss.tied as loss_mod

    seen = []
    real_mm = torch.mm
    monkeypatch.setattr(loss_mod.torch, "mm", lambda a, b, **k: seen.append(a.dtype) or real_mm(a, b, **k))
    cfg = LossConfig(chunk_tokens=16, z_loss=1e-3)
    case = make_case(n=64, h=32, v=301)
    out, dh, dw = run(training_loss(cfg, LossBackend.chunked, torch.bfloat16), *case)
    monkeypatch.undo()
    ref, ref_dh, ref_dw = reference(*case, c=1e-3)
    assert seen and set(seen) == {torch.bfloat16}
    assert dh.dtype == torch.float32 and dw.dtype == torch.float32
    torch.testing.assert_close(out.total.double(), ref.total, rtol=2e-2, atol=0)
    torch.testing.assert_close(dh.double(), ref_dh, rtol=0, atol=3e-2 * ref_dh.abs().max().item())
    torch.testing.assert_close(dw.double(), ref_dw, rtol=0, atol=3e-2 * ref_dw.abs().max().item())
