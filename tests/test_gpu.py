"""Checks that need a CUDA device (they skip, saying so, on machines without one; bench/gpu_check.sh runs
them on a lent GPU): the routed FFN's forward never waits on the host, and its grouped-GEMM path equals
the per-expert loop."""

from __future__ import annotations

import pytest
import torch

import trmoe.model.moe as moe
from trmoe.bench.ffn import tr_ffn

pytestmark = pytest.mark.gpu  # skipped without a CUDA device (conftest.py)


# multi_hash tables group the routed rows by expert, modulo_cyclic ones by route tuple (trmoe/model/moe.py)
GROUPINGS = pytest.mark.parametrize("strategy", ["multi_hash", "modulo_cyclic"])


def _ffn(strategy: str):
    torch.manual_seed(0)
    ffn = tr_ffn(128, 256, 256, 4, 2, 5000, strategy=strategy, std=0.05).cuda()
    assert (ffn.routed.route_tuples is not None) == (strategy == "modulo_cyclic")
    return ffn


@GROUPINGS
@pytest.mark.parametrize("mode", ["bf16_weights", "autocast"])
def test_ffn_forward_does_not_sync_with_the_host(mode, strategy):
    ffn = _ffn(strategy)
    x = torch.randn(2, 512, 128, device="cuda")
    ids = torch.randint(0, 5000, (2, 512), device="cuda")
    if mode == "bf16_weights":  # FSDP mixed precision: the parameters themselves are bf16
        ffn, x = ffn.to(torch.bfloat16), x.to(torch.bfloat16)
    ffn(x, ids)  # warm-up: lazy initialisation may sync once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode == "autocast"):
            ffn(x, ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@GROUPINGS
def test_grouped_gemm_path_equals_the_per_expert_loop(monkeypatch, strategy):
    ffn = _ffn(strategy).to(torch.bfloat16)
    x = torch.randn(1024, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ids = torch.randint(0, 5000, (1024,), device="cuda")
    assert moe._grouped_mm_ok(x, ffn.routed.w_in), "H200-class GPUs take the grouped GEMM in bf16"
    out = ffn(x, ids)
    out.float().square().sum().backward()
    grads = [p.grad.float() for p in (ffn.routed.w_in, ffn.routed.w_out)] + [x.grad.float()]
    ffn.zero_grad()
    x.grad = None
    monkeypatch.setattr(moe, "_grouped_mm_ok", lambda rows, weights: False)  # the loop fallback
    ref = ffn(x, ids)
    ref.float().square().sum().backward()
    ref_grads = [p.grad.float() for p in (ffn.routed.w_in, ffn.routed.w_out)] + [x.grad.float()]
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-2)
