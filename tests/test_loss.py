"""Tests for trmoe.loss.tied against torch.nn.functional.cross_entropy on full logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from trmoe.loss.tied import LossSums, chunked_tied_ce, full_logits_ce

IGNORE = -100


def make_case(n=37, h=16, v=101, dtype=torch.float64, n_ignored=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=dtype)
    weight = torch.randn(v, h, generator=g, dtype=dtype) * 0.5
    targets = torch.randint(0, v, (n,), generator=g)
    if n_ignored:
        targets[torch.randperm(n, generator=g)[:n_ignored]] = IGNORE
    return hidden, weight, targets


def reference(hidden, weight, targets, eps=0.0, c=0.0):
    """Independent reference: full logits + F.cross_entropy, summed; z-loss via logsumexp."""
    logits = hidden @ weight.t()
    smoothed = F.cross_entropy(logits, targets, ignore_index=IGNORE, label_smoothing=eps, reduction="sum")
    valid = targets != IGNORE
    lse = torch.logsumexp(logits, dim=1)
    z = (lse[valid] ** 2).sum()
    total = smoothed + c * z
    ce = F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum")
    return total, ce.detach(), z.detach()


def grads_of(fn, hidden, weight, targets, **kw):
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    out = fn(h, w, targets, **kw)
    total = out.total if isinstance(out, LossSums) else out[0]
    total.backward()
    return out, h.grad, w.grad


def tol(dtype):
    return dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk", [1, 7, 37, 50, 0])
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("c", [0.0, 1e-4])
def test_matches_full_logits_reference(dtype, chunk, eps, c):
    hidden, weight, targets = make_case(dtype=dtype)  # N=37, V=101: no chunk divides evenly
    out, dh, dw = grads_of(
        chunked_tied_ce, hidden, weight, targets, chunk_tokens=chunk, label_smoothing=eps, z_loss=c
    )
    (ref_total, ref_ce, ref_z), ref_dh, ref_dw = grads_of(
        lambda h, w, t: reference(h, w, t, eps, c), hidden, weight, targets
    )
    t = tol(dtype)
    torch.testing.assert_close(out.total, ref_total, **t)
    torch.testing.assert_close(out.ce, ref_ce, **t)
    torch.testing.assert_close(out.z, ref_z, **t)
    assert out.tokens.dtype == torch.int64 and int(out.tokens) == 32
    assert dh.dtype == hidden.dtype and dh.shape == hidden.shape
    assert dw.dtype == weight.dtype and dw.shape == weight.shape
    torch.testing.assert_close(dh, ref_dh, **t)
    torch.testing.assert_close(dw, ref_dw, **t)
    # ignored rows get exactly zero gradient
    assert torch.all(dh[targets == IGNORE] == 0)


@pytest.mark.parametrize("eps,c", [(0.0, 0.0), (0.1, 1e-4)])
def test_full_logits_ce_matches_reference(eps, c):
    hidden, weight, targets = make_case()
    out, dh, dw = grads_of(full_logits_ce, hidden, weight, targets, label_smoothing=eps, z_loss=c)
    (ref_total, ref_ce, ref_z), ref_dh, ref_dw = grads_of(
        lambda h, w, t: reference(h, w, t, eps, c), hidden, weight, targets
    )
    t = tol(torch.float64)
    torch.testing.assert_close(out.total, ref_total, **t)
    torch.testing.assert_close(out.ce, ref_ce, **t)
    torch.testing.assert_close(out.z, ref_z, **t)
    torch.testing.assert_close(dh, ref_dh, **t)
    torch.testing.assert_close(dw, ref_dw, **t)


def test_ce_and_z_are_pure_terms():
    hidden, weight, targets = make_case()
    out = chunked_tied_ce(hidden, weight, targets, chunk_tokens=5, label_smoothing=0.1, z_loss=1e-3)
    logits = hidden @ weight.t()
    valid = targets != IGNORE
    lse = torch.logsumexp(logits, dim=1)
    pure_ce = (lse - logits.gather(1, targets.clamp(min=0)[:, None]).squeeze(1))[valid].sum()
    torch.testing.assert_close(out.ce, pure_ce)
    torch.testing.assert_close(out.z, (lse[valid] ** 2).sum())
    # and the total really includes smoothing and z-loss
    assert not torch.allclose(out.total, out.ce)
    assert out.ce.grad_fn is None and out.z.grad_fn is None


def gemm_count(fn, n_tok, h, v):
    """Run fn() and return how many [n_tok, H] x [H, V]-sized GEMMs it did (via FLOP counting)."""
    with FlopCounterMode(display=False) as counter:
        out = fn()
    flops = counter.get_total_flops()
    assert flops % (2 * n_tok * h * v) == 0
    return out, flops // (2 * n_tok * h * v)


def test_no_grad_does_no_gradient_work():
    hidden, weight, targets = make_case()
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    with torch.no_grad():
        out, n_gemm = gemm_count(
            lambda: chunked_tied_ce(h, w, targets, chunk_tokens=10, label_smoothing=0.1, z_loss=1e-4),
            *hidden.shape,
            weight.shape[0],
        )
    assert n_gemm == 1  # the logits only
    assert out.total.grad_fn is None and not out.total.requires_grad
    ref_total, _, _ = reference(hidden, weight, targets, 0.1, 1e-4)
    torch.testing.assert_close(out.total, ref_total, **tol(torch.float64))

    out, n_gemm = gemm_count(
        lambda: chunked_tied_ce(h, w, targets, chunk_tokens=10), *hidden.shape, weight.shape[0]
    )
    assert n_gemm == 3  # logits, dh, dW: all in the forward ...
    assert out.total.grad_fn is not None
    _, n_gemm = gemm_count(lambda: out.total.backward(), *hidden.shape, weight.shape[0])
    assert n_gemm == 0  # ... and the backward only scales


def test_only_one_input_requires_grad():
    hidden, weight, targets = make_case()
    _, ref_dh, ref_dw = grads_of(lambda h, w, t: reference(h, w, t), hidden, weight, targets)
    shape = (*hidden.shape, weight.shape[0])

    h = hidden.clone().requires_grad_(True)
    out, n_gemm = gemm_count(lambda: chunked_tied_ce(h, weight, targets, chunk_tokens=10), *shape)
    out.total.backward()
    torch.testing.assert_close(h.grad, ref_dh, **tol(torch.float64))
    assert n_gemm == 2  # logits + dh

    w = weight.clone().requires_grad_(True)
    out, n_gemm = gemm_count(lambda: chunked_tied_ce(hidden, w, targets, chunk_tokens=10), *shape)
    out.total.backward()
    torch.testing.assert_close(w.grad, ref_dw, **tol(torch.float64))
    assert n_gemm == 2  # logits + dW

    # nothing requires grad: loss only, no graph
    out, n_gemm = gemm_count(lambda: chunked_tied_ce(hidden, weight, targets, chunk_tokens=10), *shape)
    assert out.total.grad_fn is None and n_gemm == 1


def test_grad_output_scaling():
    hidden, weight, targets = make_case()
    _, dh1, dw1 = grads_of(
        lambda h, w, t: (lambda o: (o.total / o.tokens,))(chunked_tied_ce(h, w, t, chunk_tokens=8)),
        hidden,
        weight,
        targets,
    )
    _, dh3, dw3 = grads_of(
        lambda h, w, t: (lambda o: (o.total / o.tokens * 3.0,))(chunked_tied_ce(h, w, t, chunk_tokens=8)),
        hidden,
        weight,
        targets,
    )
    torch.testing.assert_close(dh3, 3.0 * dh1)
    torch.testing.assert_close(dw3, 3.0 * dw1)


def test_backward_runs_once_and_a_second_one_says_why():
    hidden, weight, targets = make_case()
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    out = chunked_tied_ce(h, w, targets, chunk_tokens=8)
    (out.total * 0.5).backward(retain_graph=True)
    _, dh, dw = grads_of(chunked_tied_ce, hidden, weight, targets, chunk_tokens=8)
    torch.testing.assert_close(h.grad, 0.5 * dh)  # scaled in place by the incoming gradient
    torch.testing.assert_close(w.grad, 0.5 * dw)
    with pytest.raises(RuntimeError, match="backward ran twice.*retain_graph is not supported"):
        out.total.backward()


def test_moderate_size():
    hidden, weight, targets = make_case(n=512, h=64, v=50_000, dtype=torch.float32, n_ignored=40, seed=1)
    out, dh, dw = grads_of(
        chunked_tied_ce, hidden, weight, targets, chunk_tokens=200, label_smoothing=0.1, z_loss=1e-4
    )
    # reference in float64: fp32 F.cross_entropy itself is off by ~1e-4 in the gradients at V=50k
    (ref_total, ref_ce, ref_z), ref_dh, ref_dw = grads_of(
        lambda h, w, t: reference(h, w, t, 0.1, 1e-4), hidden.double(), weight.double(), targets
    )
    close = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.total.double(), ref_total, **close)
    torch.testing.assert_close(out.ce.double(), ref_ce, **close)
    torch.testing.assert_close(out.z.double(), ref_z, **close)
    torch.testing.assert_close(dh.double(), ref_dh, **close)
    torch.testing.assert_close(dw.double(), ref_dw, **close)


def test_gradient_accumulation_matches_full_batch():
    hidden, weight, targets = make_case(n=40, n_ignored=9)
    kw = dict(chunk_tokens=6, label_smoothing=0.1, z_loss=1e-4)

    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    full = chunked_tied_ce(h, w, targets, **kw)
    (full.total / full.tokens).backward()

    h2 = hidden.clone().requires_grad_(True)
    w2 = weight.clone().requires_grad_(True)
    a = chunked_tied_ce(h2[:17], w2, targets[:17], **kw)
    b = chunked_tied_ce(h2[17:], w2, targets[17:], **kw)
    n_tok = a.tokens + b.tokens
    assert int(n_tok) == int(full.tokens) == 31
    (a.total / n_tok).backward()
    (b.total / n_tok).backward()

    torch.testing.assert_close(h2.grad, h.grad)
    torch.testing.assert_close(w2.grad, w.grad)
    torch.testing.assert_close(a.total + b.total, full.total)


def test_batched_hidden_shape():
    hidden, weight, targets = make_case(n=24)
    h3 = hidden.reshape(2, 12, -1).clone().requires_grad_(True)
    out = chunked_tied_ce(h3, weight, targets.reshape(2, 12), chunk_tokens=5)
    out.total.backward()
    (ref_total, _, _), ref_dh, _ = grads_of(lambda h, w, t: reference(h, w, t), hidden, weight, targets)
    torch.testing.assert_close(out.total, ref_total)
    assert h3.grad.shape == (2, 12, hidden.shape[1])
    torch.testing.assert_close(h3.grad.reshape(24, -1), ref_dh)


@pytest.mark.parametrize("fn", [chunked_tied_ce, full_logits_ce])
def test_all_ignored_and_empty(fn):
    hidden, weight, targets = make_case(n=9)
    targets[:] = IGNORE
    for n in (9, 0):
        h = hidden[:n].clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        out = fn(h, w, targets[:n])
        assert int(out.tokens) == 0
        assert float(out.total.detach()) == 0.0 and float(out.ce) == 0.0 and float(out.z) == 0.0
        out.total.backward()
        assert h.grad.shape == h.shape and torch.all(h.grad == 0)
        assert torch.all(w.grad == 0)


def test_bf16_inputs():
    hidden, weight, targets = make_case(n=64, h=32, v=300, dtype=torch.float32)
    hb = hidden.to(torch.bfloat16).requires_grad_(True)
    wb = weight.to(torch.bfloat16).requires_grad_(True)
    out = chunked_tied_ce(hb, wb, targets, chunk_tokens=20, label_smoothing=0.1, z_loss=1e-4)
    assert out.total.dtype == torch.float32
    out.total.backward()
    assert hb.grad.dtype == torch.bfloat16 and wb.grad.dtype == torch.bfloat16
    (ref_total, _, _), ref_dh, ref_dw = grads_of(
        lambda h, w, t: reference(h, w, t, 0.1, 1e-4),
        hb.detach().float(),
        wb.detach().float(),
        targets,
    )
    torch.testing.assert_close(out.total, ref_total, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(hb.grad.float(), ref_dh, rtol=5e-2, atol=2e-2)
    torch.testing.assert_close(wb.grad.float(), ref_dw, rtol=5e-2, atol=2e-2)
