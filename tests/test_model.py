"""Parameter parity with the reference profiles, dispatch exactness, the dense control, init."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from helpers import compose_config

from trmoe.config.resolve import to_config
from trmoe.config.spec import model_spec
from trmoe.model.attention import RMSNorm
from trmoe.model.moe import RoutedExperts, TRMoEFFN, route_weights, swiglu
from trmoe.model.spec import ModelSpec, ffn_spec
from trmoe.model.transformer import TRMoETransformer, count_parameters, parameter_counts


def _spec(
    hidden: int, routed: int, experts: int, top_k: int, p: float, vocab: int, strategy: str, seed: int = 0
) -> ModelSpec:
    """The spec of a routed branch alone (no shared expert)."""
    return ffn_spec(
        hidden_size=hidden,
        shared_width=0,
        routed_width=routed,
        num_experts=experts,
        top_k=top_k,
        primary_weight=p,
        vocab_size=vocab,
        strategy=strategy,
        route_seed=seed,
    )


# Reference totals: vocab 200,019, learnable gates on, no vocab padding (anchor report, section 3).
PARITY = {
    "50m": (51_919_248, 51_575_184),
    "100m": (99_672_020, 98_934_740),
    "200m": (200_081_960, None),
    "300m": (300_806_420, None),
    "1b": (1_030_812_200, None),
    "8b": (8_201_527_360, None),
}


@pytest.mark.parametrize("profile", sorted(PARITY))
def test_parameter_parity_with_reference(profile):
    counts = parameter_counts(model_spec(to_config(compose_config(f"model={profile}"))))
    total, active = PARITY[profile]
    assert counts.total == total
    if active is not None:
        assert counts.active == active
    assert counts.embedding + counts.non_embedding == counts.total


def test_active_parameters_formula_and_real_model_agree():
    spec = model_spec(to_config(compose_config("model.num_experts=4", "routing.top_k=1")))
    model = TRMoETransformer(spec)
    counts = count_parameters(model)
    assert counts == parameter_counts(spec)
    idle = spec.num_layers * 3 * spec.hidden_size * spec.expert_width * (spec.num_experts - spec.top_k)
    assert counts.total - counts.active == idle


@pytest.mark.parametrize("branch", ["model.shared_width=0", "model.routed_width=0"])
def test_gates_exist_only_between_two_branches(branch):
    """docs/architecture.md: 2 gates per layer with both branches, none with one (as the reference)."""
    both = TRMoETransformer(model_spec(to_config(compose_config("model.gates=true"))))
    one = TRMoETransformer(model_spec(to_config(compose_config("model.gates=true", branch))))
    gates = lambda model: sorted(n.split(".")[-1] for n, p in model.named_parameters() if p.ndim == 0)  # noqa: E731
    assert gates(both) == sorted(["routed_gate", "shared_gate"] * both.spec.num_layers) and gates(one) == []


def test_vocab_padding_rounds_the_embedding_only():
    spec = model_spec(to_config(compose_config("model.vocab_pad_multiple=64")))
    assert spec.embedding_rows == 200_064 and spec.vocab_size == 200_019
    model = TRMoETransformer(spec)
    assert model.embed.weight.shape[0] == 200_064
    assert model.blocks[0].ffn.routed.route_table.shape[1] == 200_019


def _naive_routed(module: RoutedExperts, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per-token reference: y_n = sum_k w_k * E_{table[k, t_n]}(x_n)."""
    weights = route_weights(module.top_k, module.primary_weight)
    rows = []
    for n in range(x.shape[0]):
        y = torch.zeros_like(x[n])
        for k in range(module.top_k):
            e = int(module.route_table[k, ids[n]])
            y = y + weights[k] * swiglu(x[n : n + 1], module.w_in[e], module.w_out[e])[0]
        rows.append(y)
    return torch.stack(rows)


@pytest.mark.parametrize(
    "strategy", ["modulo_cyclic", "random", "balanced_hash", "affine_hash", "multi_hash"]
)
@pytest.mark.parametrize(
    ("experts", "top_k", "p"), [(4, 1, 1.0), (4, 2, 0.5), (4, 2, 0.8), (8, 3, 0.6), (3, 3, 0.2)]
)
def test_dispatch_equals_naive_per_token_reference(strategy, experts, top_k, p):
    torch.manual_seed(0)
    module = RoutedExperts(_spec(16, experts * 6, experts, top_k, p, 97, strategy, seed=3), layer=1).double()
    for param in module.parameters():
        torch.nn.init.normal_(param, 0, 0.3)
    x = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 97, (37,))
    fast = module(x, ids)
    ref = _naive_routed(module, x, ids)
    torch.testing.assert_close(fast, ref, rtol=1e-12, atol=1e-12)
    grads_fast = torch.autograd.grad(fast.square().sum(), [x, module.w_in, module.w_out])
    grads_ref = torch.autograd.grad(ref.square().sum(), [x, module.w_in, module.w_out])
    for a, b in zip(grads_fast, grads_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(("strategy", "by_tuple"), [("modulo_cyclic", True), ("random", False)])
def test_dispatch_does_k_rows_of_work_per_token(monkeypatch, strategy, by_tuple):
    """Count the expert rows each grouped GEMM multiplies: K x tokens in total, never E x tokens, and each
    group holds exactly the rows it owns. By route tuple (modulo_cyclic: E tuples): N rows, each times K
    experts' weights side by side; by expert (random: 12 tuples > E): K x N rows, each times one expert."""
    import trmoe.model.moe as moe

    calls = []
    real = moe.grouped_mm

    def counting(rows, weights, ends):
        sizes = torch.diff(ends, prepend=ends.new_zeros(1)).tolist()
        calls.append((rows.shape[0], sizes, weights.shape))
        return real(rows, weights, ends)

    monkeypatch.setattr(moe, "grouped_mm", counting)
    n, hidden, width, k = 500, 8, 32 // 4, 2
    module = RoutedExperts(_spec(hidden, 32, 4, k, 0.5, 1000, strategy), layer=0)
    assert (module.route_tuples is not None) == by_tuple
    ids = torch.randint(0, 1000, (n,))
    module(torch.randn(n, hidden), ids)
    (rows_in, sizes_in, w_in), (rows_out, sizes_out, w_out) = calls
    assert sizes_in == sizes_out and sum(sizes_in) == rows_in == rows_out
    experts_per_row = w_in[2] // (2 * width)  # the in-projection's columns: [gate | up] of each expert
    assert w_out[1] == experts_per_row * width
    assert rows_in * experts_per_row == k * n  # K x tokens expert rows
    if by_tuple:
        assert (rows_in, experts_per_row) == (n, k)
        assert sizes_in == torch.bincount(module.tuple_of[ids].long(), minlength=4).tolist()
    else:
        assert (rows_in, experts_per_row) == (k * n, 1)
        assert sizes_in == torch.bincount(module.route_table[:, ids].reshape(-1).long(), minlength=4).tolist()


@pytest.mark.parametrize("strategy", ["modulo_cyclic", "random"])
def test_bf16_parameters_with_fp32_buffers_stay_bf16(strategy):
    """FSDP2's mixed precision casts the parameters to bf16 but not the buffers (route weights): the routed
    branch must not promote its rows or weights back to fp32 (grouped GEMMs need one dtype)."""
    torch.manual_seed(0)
    module = RoutedExperts(_spec(16, 64, 4, 2, 0.7, 500, strategy), layer=0)
    for p in module.parameters():
        torch.nn.init.normal_(p, 0.0, 0.2)
    x, ids = torch.randn(64, 16), torch.randint(0, 500, (64,))
    ref = module(x, ids, 0.5)
    for p in module.parameters():
        p.data = p.data.bfloat16()
    assert module.route_w.dtype == torch.float32
    out = module(x.bfloat16(), ids, torch.tensor(0.5, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.02)


def test_rms_norm_computes_in_fp64_for_fp64_inputs_and_in_fp32_otherwise():
    """fp64 inputs (a converted checkpoint checked against the reference in fp64) keep fp64's precision;
    fp32, bf16 and fp16 inputs are normalised in fp32 exactly as before."""
    torch.manual_seed(0)
    norm = RMSNorm(48, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(48) + 0.5)
    x = torch.randn(4, 7, 48, dtype=torch.float64) * 3
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.double()
    got = norm(x)
    assert got.dtype == torch.float64
    assert (got - want).abs().max().item() <= 1e-15
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        xd = x.to(dtype)
        xf = xd.float()
        fp32 = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.float()).to(dtype)
        assert torch.equal(norm(xd), fp32), dtype


def test_route_tuples_follow_a_loaded_route_table():
    """The tuple grouping is derived from the route table: loading another table re-derives it (a stale one
    would route tokens through the wrong experts)."""
    torch.manual_seed(0)
    a = RoutedExperts(_spec(8, 16, 4, 2, 0.5, 97, "modulo_cyclic"), layer=0)
    b = RoutedExperts(_spec(8, 16, 4, 2, 0.5, 97, "modulo_cyclic"), layer=1)
    c = RoutedExperts(_spec(8, 16, 4, 2, 0.5, 97, "random"), layer=0)  # 12 tuples: by expert
    for p in [*b.parameters(), *c.parameters()]:
        torch.nn.init.normal_(p, 0.0, 0.3)
    assert not torch.equal(a.route_table, b.route_table) and a.route_tuples is not None
    a.load_state_dict(b.state_dict())
    x, ids = torch.randn(40, 8), torch.arange(40)
    torch.testing.assert_close(a.tuple_of, b.tuple_of)
    torch.testing.assert_close(a(x, ids), b(x, ids))
    a.load_state_dict(c.state_dict())
    assert a.route_tuples is None
    torch.testing.assert_close(a(x, ids), c(x, ids))


def test_dense_control_equals_one_swiglu_of_combined_width():
    """E=1, K=1 with gates off: shared (width S) + one expert (width R) == a dense SwiGLU of width S+R."""
    torch.manual_seed(0)
    h, s, r = 12, 10, 6
    spec = ffn_spec(hidden_size=h, shared_width=s, routed_width=r, num_experts=1, top_k=1, primary_weight=1.0)
    ffn = TRMoEFFN(replace(spec, vocab_size=50), layer=0).double()
    for param in ffn.parameters():
        torch.nn.init.normal_(param, 0, 0.3)
    sg, su = ffn.shared.w_in.chunk(2, dim=1)
    rg, ru = ffn.routed.w_in[0].chunk(2, dim=1)
    w_in = torch.cat([sg, rg, su, ru], dim=1)
    w_out = torch.cat([ffn.shared.w_out, ffn.routed.w_out[0]], dim=0)
    x = torch.randn(2, 9, h, dtype=torch.float64)
    torch.testing.assert_close(ffn(x, torch.randint(0, 50, (2, 9))), swiglu(x, w_in, w_out))


def _gated_ffn(
    strategy: str, shared: int = 4, routed: int = 8, scales: tuple[float, float] = (3.0, 0.25)
) -> TRMoEFFN:
    """A float64 FFN (H = 8, E = 4, K = 2, p = 0.7) with gates 0.5 / 2.0 and (shared, routed) scales."""
    torch.manual_seed(0)
    spec = ffn_spec(
        hidden_size=8,
        shared_width=shared,
        routed_width=routed,
        num_experts=4,
        top_k=2,
        primary_weight=0.7,
        gates=True,
        shared_gate_init=0.5,
        routed_gate_init=2.0,
        vocab_size=40,
        strategy=strategy,
        route_seed=1,
        num_layers=3,
        shared_scales=(0.0, 0.0, scales[0]),
        routed_scales=(0.0, 0.0, scales[1]),
    )
    ffn = TRMoEFFN(spec, layer=2).double()
    for p in (ffn.shared.w_in, ffn.shared.w_out, ffn.routed.w_in, ffn.routed.w_out):
        torch.nn.init.normal_(p, 0, 0.3)
    return ffn


def test_ffn_formula_gates_scales_and_weights():
    ffn = _gated_ffn("affine_hash")
    x, ids = torch.randn(11, 8, dtype=torch.float64), torch.randint(0, 40, (11,))
    expected = 3.0 * 0.5 * swiglu(x, ffn.shared.w_in, ffn.shared.w_out) + 0.25 * 2.0 * _naive_routed(
        ffn.routed, x, ids
    )
    torch.testing.assert_close(ffn(x, ids), expected)
    assert route_weights(2, 0.7) == [0.7, pytest.approx(0.3)]
    assert route_weights(3, 0.5) == [0.5, 0.25, 0.25]


@pytest.mark.parametrize("strategy", ["modulo_cyclic", "affine_hash"])  # grouped by route tuple / expert
@pytest.mark.parametrize("scales", [(3.0, 0.25), (1.0, 1.0)])  # at scale 1 the factor is the gate itself
def test_ffn_gradients_equal_the_naive_formulas(strategy, scales):
    """Every gradient (x, shared and expert matrices, both gates) equals autograd's of the plain per-token
    formula, whichever way the rows are grouped and wherever gate x scale is applied."""
    ffn = _gated_ffn(strategy, shared=12, routed=16, scales=scales)
    x, ids = torch.randn(11, 8, dtype=torch.float64, requires_grad=True), torch.randint(0, 40, (11,))
    params = [x, *ffn.parameters()]
    got = torch.autograd.grad(ffn(x, ids).pow(2).sum(), params)
    shared = scales[0] * ffn.shared_gate * swiglu(x, ffn.shared.w_in, ffn.shared.w_out)
    ref = shared + scales[1] * ffn.routed_gate * _naive_routed(ffn.routed, x, ids)
    want = torch.autograd.grad(ref.pow(2).sum(), params)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_init_statistics_and_tied_head():
    spec = model_spec(to_config(compose_config("model=50m", "model.vocab_size=5000")))
    torch.manual_seed(0)
    model = TRMoETransformer(spec)
    residual = 0.02 / math.sqrt(2 * spec.num_layers)
    block = model.blocks[0]
    assert block.attn.out.weight.std().item() == pytest.approx(residual, rel=0.05)
    assert block.ffn.shared.w_out.std().item() == pytest.approx(residual, rel=0.05)
    assert block.ffn.routed.w_out.std().item() == pytest.approx(residual, rel=0.05)
    assert block.ffn.shared.w_in.std().item() == pytest.approx(0.02, rel=0.05)
    assert block.ffn.routed.w_in.std().item() == pytest.approx(0.02, rel=0.05)
    assert block.attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.embed.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.all(block.attn_norm.weight == 1) and torch.all(block.attn.q_norm.weight == 1)
    assert block.ffn.shared_gate.item() == 1.0 and block.ffn.routed_gate.item() == 1.0
    ids = torch.randint(0, 5000, (2, 16))
    hidden = model(ids)
    assert hidden.shape == (2, 16, spec.hidden_size)
    assert model.logits(hidden).shape == (2, 16, 5000)
    assert model.head_weight is model.embed.weight


def test_legacy_kaiming_init_draws_the_routed_gate_and_up_as_the_old_runner():
    """model.init=legacy_kaiming (the fact sheet's 3.1): routed gate and up U(-b, b) with b = 1/sqrt(I_e)
    (Panel A's I_e = 192: b 0.07217, std 0.04167); everything else as the default init, the routed down
    N(0, 0.02/sqrt(2L)) included."""
    overrides = ["model=100m", "model.vocab_size=512", "model.gates=false", "model.routed_width=768"]
    spec = model_spec(to_config(compose_config(*overrides, "model.init=legacy_kaiming")))
    assert spec.init == "legacy_kaiming" and spec.expert_width == 192
    torch.manual_seed(0)
    model = TRMoETransformer(spec)
    w_in = model.blocks[3].ffn.routed.w_in.detach()
    bound = 1 / math.sqrt(192)
    assert bound == pytest.approx(0.07217, abs=1e-5)
    assert float(w_in.abs().max()) <= bound and float(w_in.abs().max()) > 0.999 * bound
    for half in w_in.chunk(2, dim=2):  # gate and up, each expert
        for expert in half:
            assert expert.std().item() == pytest.approx(0.04167, rel=0.02)
    residual = 0.02 / math.sqrt(2 * spec.num_layers)
    assert model.blocks[3].ffn.routed.w_out.std().item() == pytest.approx(residual, rel=0.03)
    assert model.blocks[3].ffn.shared.w_in.std().item() == pytest.approx(0.02, rel=0.03)
    torch.manual_seed(0)
    default = TRMoETransformer(model_spec(to_config(compose_config(*overrides))))
    assert default.blocks[3].ffn.routed.w_in.std().item() == pytest.approx(0.02, rel=0.03)


def test_route_tables_are_persistent_buffers_and_causality_holds():
    spec = model_spec(to_config(compose_config("model.vocab_size=300", "routing=multi_hash")))
    model = TRMoETransformer(spec)
    state = model.state_dict()
    assert "blocks.0.ffn.routed.route_table" in state and "rope_cos" not in state
    assert not torch.equal(state["blocks.0.ffn.routed.route_table"], state["blocks.1.ffn.routed.route_table"])
    ids = torch.randint(0, 300, (1, 20))
    changed = ids.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 300
    torch.testing.assert_close(model(ids)[:, :10], model(changed)[:, :10])


def test_grouped_gemm_path_equals_the_per_expert_loop_on_cpu(monkeypatch):
    """fp32 on CPU takes torch's grouped GEMM; the per-expert loop (its fallback) gives the same result."""
    import trmoe.model.moe as moe

    torch.manual_seed(0)
    module = RoutedExperts(_spec(16, 64, 4, 2, 0.7, 1000, "multi_hash"), layer=0)
    for p in module.parameters():
        torch.nn.init.normal_(p, 0.0, 0.1)
    x, ids = torch.randn(300, 16), torch.randint(0, 1000, (300,))
    assert moe._grouped_mm_ok(x, module.w_in)
    fast = module(x, ids, 0.5)
    monkeypatch.setattr(moe, "_grouped_mm_ok", lambda rows, weights: False)
    torch.testing.assert_close(fast, module(x, ids, 0.5))


def test_sparse_embedding_gradient_sums_into_the_tied_heads_dense_gradient():
    """model.sparse_embedding_grad (the train loop's setting on CPU): the tied weight ends the backward with a
    dense gradient equal to the dense path's, and that gradient holds the embedding's rows, not the head's
    alone."""
    from trmoe.loss.tied import chunked_tied_ce

    spec = model_spec(to_config(compose_config("model=tiny", "model.vocab_size=512")))
    g = torch.Generator().manual_seed(3)
    x, y = (torch.randint(0, 512, (2, 16), generator=g) for _ in range(2))
    grads = {}
    for mode in ("dense", "sparse", "head_only"):
        torch.manual_seed(0)
        model = TRMoETransformer(spec)
        model.sparse_embedding_grad = mode == "sparse"
        hidden = model(x)
        sums = chunked_tied_ce(hidden.detach() if mode == "head_only" else hidden, model.head_weight, y)
        sums.total.backward()
        grads[mode] = model.embed.weight.grad
    assert grads["sparse"].layout == torch.strided and not grads["sparse"].is_sparse
    torch.testing.assert_close(grads["sparse"], grads["dense"])
    rows = x.unique()
    assert (grads["sparse"][rows] - grads["head_only"][rows]).abs().amax() > 1e-4
    others = torch.ones(512, dtype=torch.bool)
    others[rows] = False
    assert torch.equal(grads["sparse"][others], grads["head_only"][others])


def test_silu_mul_matches_autograd_of_the_plain_formula():
    """The SwiGLU activation's own backward (one [rows, 2W] gradient, no concatenation) is autograd's."""
    from trmoe.model.moe import silu_mul

    g = torch.Generator().manual_seed(0)
    gu = torch.randn(6, 10, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(silu_mul, (gu,))
    gu32 = gu.detach().float().requires_grad_()
    plain = torch.nn.functional.silu(gu32[:, :5]) * gu32[:, 5:]
    upstream = torch.randn(6, 5, generator=g)
    ours = silu_mul(gu32)
    assert torch.equal(ours, plain)
    assert torch.equal(*(torch.autograd.grad(out, gu32, upstream)[0] for out in (ours, plain)))


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


@pytest.mark.parametrize("strategy", ["modulo_cyclic", "random"])
@pytest.mark.parametrize("mode", ["cpu_bf16_weights", pytest.param("cuda_autocast", marks=CUDA)])
def test_model_compiles_to_one_graph_in_bf16(strategy, mode):
    """trainer.compile on a GPU: bf16 rows (autocast) take the grouped GEMM, so the whole model, forward and
    backward, must trace as one graph; a graph break per SwiGLU or per routed layer would leave every FFN
    uncompiled. fullgraph=True raises at the first break. On a CPU, bf16 weights stand in for GPU autocast
    (in fp32 the CPU falls back to a loop over the groups, which reads their sizes on the host);
    bench/gpu_check.sh runs the autocast case on a GPU."""
    spec = model_spec(to_config(compose_config("routing.top_k=2", f"routing.strategy={strategy}")))
    device = "cuda" if mode == "cuda_autocast" else "cpu"
    model = TRMoETransformer(spec).to(device)
    if mode == "cpu_bf16_weights":
        model = model.to(torch.bfloat16)
    assert (model.blocks[0].ffn.routed.route_tuples is not None) == (strategy == "modulo_cyclic")
    eager = TRMoETransformer(spec).to(device, next(model.parameters()).dtype)
    eager.load_state_dict(model.state_dict())
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    ids = torch.randint(0, spec.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=mode == "cuda_autocast"):
        out, ref = compiled(ids), eager(ids)
    out.float().square().mean().backward()  # outside autocast, as the train loop does
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    torch.testing.assert_close(out.float(), ref.float(), rtol=0.02, atol=0.02)


def test_routing_and_scale_options_reach_every_layer():
    """What the config says is what each layer holds: its route table is the one of (strategy, vocab, E,
    K, layer, routing.seed, routing.hash_count), its scales the depth interpolation of the model keys."""
    from trmoe.model.routing import build_route_table

    overrides = ("model.vocab_size=512", "routing=multi_hash", "routing.top_k=2")
    base = dict(seed=0, hash_count=2)
    for seed, hash_count in ((0, 2), (7, 2), (0, 3)):
        cfg = to_config(
            compose_config(
                *overrides,
                f"routing.seed={seed}",
                f"routing.hash_count={hash_count}",
                "model.shared_scale=0.5",
                "model.routed_scale=1.0",
                "model.routed_scale_last=2.0",
            )
        )
        model = TRMoETransformer(model_spec(cfg))
        layers = len(model.blocks)
        for layer, block in enumerate(model.blocks):
            expected = build_route_table("multi_hash", 512, 4, 2, layer, seed, hash_count)
            assert torch.equal(block.ffn.routed.route_table, expected), (seed, hash_count, layer)
            assert block.ffn.shared_scale == 0.5
            assert block.ffn.routed_scale == pytest.approx(1.0 + layer / (layers - 1))
        if (seed, hash_count) != tuple(base.values()):  # each key changes the tables it names
            default = build_route_table("multi_hash", 512, 4, 2, 1, **base)
            assert not torch.equal(model.blocks[1].ffn.routed.route_table, default)
