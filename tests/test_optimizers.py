"""Optimizers: the Muon, StoSignSGD and Lion update rules, parameter groups, state save/restore, identical
per-parameter math under DDP (2 gloo ranks == one process with the whole batch), and the registry that
declares them (trmoe.config.optimizers: options, validation, the planner's state bytes, the docs table)."""

from __future__ import annotations

import io
import json
import math
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from helpers import cli, compose_config, metrics_rows, spawn_ranks
from presets import FAST_CPU

from trmoe.config.resolve import to_config
from trmoe.config.spec import model_spec
from trmoe.loss.tied import chunked_tied_ce
from trmoe.model.transformer import TRMoETransformer
from trmoe.optim.build import GroupLRs, OptimizerSet, build_optimizer
from trmoe.optim.muon import Muon, muon_direction, orthogonalize
from trmoe.optim.schedule import apply_lr
from trmoe.optim.stosignsgd import StoSignSGD
from trmoe.runtime import distributed
from trmoe.train.observe.telemetry import MoETelemetry

CPU = torch.device("cpu")
OPTIMIZERS = ("adamw", "muon_tr", "stosignsgd")


@pytest.fixture(autouse=True)
def one_thread():
    """These tensors are tiny: one intra-op thread is faster, and immune to a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny(*overrides: str, seed: int = 0):
    cfg = to_config(compose_config("data=random", "model.vocab_size=128", "hardware=cpu", *overrides))
    torch.manual_seed(seed)
    return cfg, TRMoETransformer(model_spec(cfg))


def batches(n: int, rows: int = 4, seq: int = 16, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(0, 128, (rows, seq), generator=g) for _ in range(2)) for _ in range(n)]


def train_steps(model, optimizer, data, first_step: int = 1):
    for i, (x, y) in enumerate(data):
        apply_lr(optimizer, 0.5 + 0.1 * (first_step + i))  # a moving LR: the groups' base_lr must survive
        sums = chunked_tied_ce(model(x), model.head_weight, y)
        (sums.total / sums.tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


# --- Muon ------------------------------------------------------------------------------------------------


def test_newton_schulz_orthogonalises_each_slice():
    g = torch.Generator().manual_seed(0)
    u = torch.randn(3, 24, 8, generator=g)
    o = orthogonalize(u, steps=5)
    for e in range(3):
        s = torch.linalg.svdvals(o[e])
        assert s.min() > 0.5 and s.max() < 1.3, s  # all singular values pushed towards 1
        uu, _, vh = torch.linalg.svd(u[e], full_matrices=False)
        cos = (o[e] * (uu @ vh)).sum() / (o[e].norm() * (uu @ vh).norm())
        assert cos > 0.95  # close to the exact polar factor U V^T


def test_torch_muon_still_cannot_carry_the_expert_tensors():
    """Why muon_tr is trmoe's own (trmoe/optim/muon.py): torch.optim.Muon takes 2-D parameters only. When
    this fails, torch can carry [E, A, B] experts: adopt it as muon_tr's base."""
    with pytest.raises(ValueError, match="2D"):
        torch.optim.Muon([torch.nn.Parameter(torch.zeros(4, 8, 16))])


def test_muon_direction_is_per_expert_and_per_half():
    g = torch.Generator().manual_seed(1)
    u = torch.randn(4, 32, 2 * 8, generator=g)  # [E, H, 2I] like routed w_in
    o = muon_direction(u, 5, rms=0.2, split_gate_up=True)
    assert o.shape == u.shape
    # each expert slice is its own matrix: changing expert 2 leaves expert 0 alone
    u2 = u.clone()
    u2[2] *= torch.rand(32, 16, generator=g)
    o2 = muon_direction(u2, 5, rms=0.2, split_gate_up=True)
    assert torch.equal(o2[0], o[0]) and not torch.allclose(o2[2], o[2])
    # gate and up halves are orthogonalised apart: changing the up half leaves the gate half alone ...
    u3 = u.clone()
    u3[:, :, 8:] *= 3.0 * torch.rand(4, 32, 8, generator=g)
    o3 = muon_direction(u3, 5, rms=0.2, split_gate_up=True)
    assert torch.equal(o3[..., :8], o[..., :8])
    # ... which the fused orthogonalisation does not
    fused, fused3 = (muon_direction(x, 5, rms=0.2, split_gate_up=False) for x in (u, u3))
    assert not torch.allclose(fused3[..., :8], fused[..., :8])
    # each half is semi-orthogonal, scaled to RMS ~0.2
    half = o[0, :, :8] / (0.2 * math.sqrt(32))
    assert torch.linalg.svdvals(half).min() > 0.5
    assert 0.12 < float(o.pow(2).mean().sqrt()) < 0.26


def groups_of(optimizer, name_of):
    return {g["name"]: sorted(name_of[id(p)] for p in g["params"]) for g in optimizer.param_groups}


@pytest.mark.parametrize("scope", ["experts", "experts_shared", "all"])
def test_muon_scope_decides_which_matrices_get_muon(scope):
    cfg, model = tiny("optimizer=muon_tr", f"optimizer.muon_scope={scope}")
    opt = build_optimizer(model, cfg.optimizer, CPU)
    assert isinstance(opt, OptimizerSet) and set(opt.optimizers) == {"muon", "adamw"}
    name_of = {id(p): n for n, p in model.named_parameters()}
    on_muon = {name_of[id(p)] for g in opt.optimizers["muon"].param_groups for p in g["params"]}
    routed = {n for n in name_of.values() if ".routed." in n}
    shared = {n for n in name_of.values() if ".shared." in n}
    attention = {n for n in name_of.values() if ".attn." in n and n.endswith(".weight") and "norm" not in n}
    expected = routed | (shared if scope != "experts" else set()) | (attention if scope == "all" else set())
    assert on_muon == expected
    assert "embed.weight" not in on_muon
    assert all(model.get_parameter(n).ndim >= 2 for n in on_muon)
    # fused [gate | up] inputs are split, the others not
    for g in opt.optimizers["muon"].param_groups:
        assert g["split_gate_up"] == g["name"].endswith("_gate_up")
        assert all(name_of[id(p)].endswith("w_in") == g["split_gate_up"] for p in g["params"])


def test_muon_has_no_warmup_of_its_own():
    """The first Muon step already moves by lr * update_rms (the reference ramped its own warmup on top of
    the global one)."""
    cfg, model = tiny("optimizer=muon_tr", "optimizer.lr=0.01", "optimizer.weight_decay=0")
    opt = build_optimizer(model, cfg.optimizer, CPU)
    w = model.blocks[0].ffn.routed.w_out
    before = w.detach().clone()
    train_steps(model, opt, batches(1))
    lr = opt.optimizers["muon"].param_groups[0]["lr"]
    rms = float((w.detach() - before).pow(2).mean().sqrt())
    assert 0.6 < rms / (lr * 0.2) < 1.3


# A reference Muon written from docs/optimizers.md (not from trmoe/optim/muon.py), in float64:
#   B <- beta B + (1 - beta) G;   U = (1 - beta) G + beta B (nesterov) or U = B
#   every matrix slice U_s: X = U_s / ||U_s||_F (transposed first if it has more rows than columns), then
#   ns_steps times  A = X X^T;  X <- a X + (b A + c A^2) X,  (a, b, c) = (3.4445, -4.7750, 2.0315)
#   O_s = X * update_rms * sqrt(max(rows_s, cols_s));   W <- W (1 - lr wd) - lr O
DOC_NS_COEFFS = (3.4445, -4.7750, 2.0315)


def _ns_reference(m: torch.Tensor, steps: int) -> torch.Tensor:
    a, b, c = DOC_NS_COEFFS
    tall = m.shape[0] > m.shape[1]
    x = m.T if tall else m
    x = x / torch.linalg.matrix_norm(x, ord="fro")
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def _muon_direction_reference(u: torch.Tensor, steps: int, rms: float, split: bool) -> torch.Tensor:
    out = torch.empty_like(u)
    matrices = [(e,) for e in range(u.shape[0])] if u.dim() == 3 else [()]
    cols = u.shape[-1]
    halves = [slice(0, cols // 2), slice(cols // 2, cols)] if split else [slice(0, cols)]
    for e in matrices:
        for half in halves:
            s = u[e][:, half]
            out[e][:, half] = _ns_reference(s, steps) * (rms * math.sqrt(max(s.shape)))
    return out


def _muon_reference(w, grads, lr, momentum, nesterov, ns_steps, update_rms, weight_decay, split):
    w = w.double()
    buf = torch.zeros_like(w)
    for g in grads:
        g = g.double()
        buf = momentum * buf + (1 - momentum) * g
        u = (1 - momentum) * g + momentum * buf if nesterov else buf
        o = _muon_direction_reference(u, ns_steps, update_rms, split)
        w = w * (1 - lr * weight_decay) - lr * o
    return w, buf


# documented defaults (docs/configuration.md): muon_momentum 0.95, muon_nesterov true, muon_ns_steps 5,
# muon_update_rms 0.2; the optimizer's own weight decay default is 0
MUON_DOC_DEFAULTS = dict(momentum=0.95, nesterov=True, ns_steps=5, update_rms=0.2, weight_decay=0.0)


@pytest.mark.parametrize(
    "options",
    [
        dict(momentum=0.8, nesterov=True, ns_steps=3, weight_decay=0.01),
        dict(momentum=0.8, nesterov=False, ns_steps=3, weight_decay=0.0),
        dict(momentum=0.8, nesterov=False, weight_decay=0.01),  # the default ns_steps
        dict(momentum=0.8, nesterov=True, update_rms=0.4, weight_decay=0.0),  # the default ns_steps
        dict(),  # every default
    ],
    ids=["m.8-nesterov-ns3-wd", "m.8-plain-ns3", "m.8-plain-ns5-wd", "m.8-nesterov-ns5-rms.4", "defaults"],
)
def test_muon_three_steps_match_the_documented_update(options):
    """Three Muon steps with known gradients == the documented rule (momentum, nesterov look-ahead,
    ns_steps Newton-Schulz iterations, update RMS scaling, decoupled weight decay), on a tall matrix (the
    transposed iteration), a stack of wide expert matrices, and a stack split into [gate | up] halves."""
    g = torch.Generator().manual_seed(42)
    shapes = {"tall": (24, 10), "stack": (2, 6, 16), "gate_up": (2, 8, 12)}
    init = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    grads = {k: [torch.randn(s, generator=g) for _ in range(3)] for k, s in shapes.items()}
    params = {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}
    lr = 0.1
    opt = Muon(
        [
            {"params": [params["tall"], params["stack"]]},
            {"params": [params["gate_up"]], "split_gate_up": True},
        ],
        lr=lr,
        **options,
    )
    for i in range(3):
        for k, p in params.items():
            p.grad = grads[k][i].clone()
        opt.step()
    settings = {**MUON_DOC_DEFAULTS, **options}
    for k, p in params.items():
        w, buf = _muon_reference(init[k], grads[k], lr=lr, split=k == "gate_up", **settings)
        buffer = opt.state[p]["momentum_buffer"]
        torch.testing.assert_close(buffer, buf.float(), msg=lambda m, k=k: f"{k} momentum buffer: {m}")
        torch.testing.assert_close(p.data, w.float(), rtol=1e-5, atol=2e-6, msg=lambda m, k=k: f"{k}: {m}")


# --- StoSignSGD ------------------------------------------------------------------------------------------


def test_stosign_update_is_unbiased_and_one_step_per_coordinate():
    n, lr = 200_000, 1e-3
    p = torch.nn.Parameter(torch.zeros(n))
    opt = StoSignSGD([p], lr=lr, beta=0.0, max_decay=1.0, seed=7)
    p.grad = torch.ones(n)  # step 1: G = 1
    opt.step()
    before = p.detach().clone()
    p.grad = torch.full((n,), 0.3)  # step 2: m = 0.3, G = 1, so E[sign] = 0.3
    opt.step()
    delta = p.detach() - before
    assert torch.all(delta.abs() == lr)  # one bit per coordinate: every step is exactly +-lr
    assert float(-delta.mean() / lr) == pytest.approx(0.3, abs=0.01)  # unbiased: E[u] = m / G


def test_stosign_noise_is_a_function_of_seed_and_step():
    def run(seed):
        torch.manual_seed(0)  # the global RNG must not matter
        p = torch.nn.Parameter(torch.zeros(1000))
        opt = StoSignSGD([p], lr=1.0, beta=0.0, seed=seed)
        for scale in (1.0, 0.2):
            p.grad = torch.full((1000,), scale)
            opt.step()
        return p.detach()

    assert torch.equal(run(3), run(3))
    assert not torch.equal(run(3), run(4))


def test_stosign_momentum_averages_the_gradients():
    """beta = 0.5: m = beta m + (1 - beta) g, so after g1 = 1, g2 = -0.2: m = 0.25 g1 + 0.5 g2 = 0.15 and
    G = max(|m1|, |m2|) = 0.5; the second step is then +-lr with E[u] = m / G = 0.3 (a gradient-only m
    would give m = -0.2, G = 1, E[u] = -0.2)."""
    n, lr = 100_000, 1e-3
    p = torch.nn.Parameter(torch.zeros(n))
    opt = StoSignSGD([p], lr=lr, beta=0.5, max_decay=1.0, seed=5)
    p.grad = torch.ones(n)
    opt.step()  # m1 = 0.5 = G: the sign is certain, u = +1 everywhere
    torch.testing.assert_close(opt.state[p]["exp_avg"], torch.full((n,), 0.5))
    torch.testing.assert_close(p.detach(), torch.full((n,), -lr))
    before = p.detach().clone()
    p.grad = torch.full((n,), -0.2)
    opt.step()
    torch.testing.assert_close(opt.state[p]["exp_avg"], torch.full((n,), 0.15))
    torch.testing.assert_close(opt.state[p]["max_scale"], torch.full((n,), 0.5))
    delta = p.detach() - before
    assert torch.all(delta.abs() == lr)
    # the sample mean of n independent +-1 draws with mean 0.3 has std ~0.003: 0.015 is 5 sigma
    assert float(-delta.mean() / lr) == pytest.approx(0.3, abs=0.015)


def test_stosign_weight_decay_is_decoupled():
    """w <- w (1 - lr wd) - lr u. A zero gradient (m = G = 0, u = 0) only shrinks w by (1 - lr wd) per step;
    a gradient of constant sign (|m| grows, so |m| = G and the sign is certain) adds exactly -lr sign(g)
    after the decay of each step."""
    lr, wd = 0.1, 0.01
    w0 = torch.tensor([[1.5, -2.0, 0.75], [3.0, -0.5, 1.0]])
    grad = torch.tensor([[0.0, 0.0, 0.0], [1.0, -2.0, 0.5]])  # row 0: no gradient; row 1: a fixed gradient
    p = torch.nn.Parameter(w0.clone())
    opt = StoSignSGD([p], lr=lr, beta=0.5, weight_decay=wd, seed=1)
    for _ in range(3):
        p.grad = grad.clone()
        opt.step()
    shrink = 1.0 - lr * wd
    torch.testing.assert_close(p.detach()[0], w0[0] * shrink**3, rtol=1e-6, atol=0.0)
    expected = w0[1].double()
    for _ in range(3):
        expected = expected * shrink - lr * grad[1].double().sign()
    torch.testing.assert_close(p.detach()[1], expected.float(), rtol=1e-6, atol=1e-7)


# --- every optimizer -------------------------------------------------------------------------------------


def assert_resume_continues_exactly(*overrides: str):
    """Two steps, a checkpoint, two more; a fresh model (other initial weights) and optimizer loaded from the
    checkpoint take the same two steps to the same weights, bit for bit."""
    data = batches(4, rows=2, seq=8)
    cfg, model = tiny(*overrides)
    opt = build_optimizer(model, cfg.optimizer, CPU, seed=3)
    train_steps(model, opt, data[:2])
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
    train_steps(model, opt, data[2:], first_step=3)

    # other weights: all from the state; the noise seed is the run's (trainer.seed, which a resume keeps),
    # from the config as every hyper-parameter is, whatever the checkpoint format
    cfg, fresh = tiny(*overrides, seed=123)
    fresh_opt = build_optimizer(fresh, cfg.optimizer, CPU, seed=3)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=False)
    fresh.load_state_dict(state["model"])
    fresh_opt.load_state_dict(state["optimizer"])
    train_steps(fresh, fresh_opt, data[2:], first_step=3)
    for (key, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), key


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_state_dict_resume_continues_exactly(name):
    assert_resume_continues_exactly(f"optimizer={name}")


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_group_lrs_follow_their_scales(name):
    cfg, model = tiny(f"optimizer={name}", "optimizer.expert_lr_scale=2", "optimizer.shared_lr_scale=0.5")
    opt = build_optimizer(model, cfg.optimizer, CPU)
    apply_lr(opt, 0.5)
    lrs = GroupLRs(model, opt).row()
    assert lrs == pytest.approx({"lr": 0.5e-3, "lr_expert": 1e-3, "lr_shared": 0.25e-3})
    assert len({g["name"] for g in opt.param_groups}) == len(opt.param_groups)


# --- DDP -------------------------------------------------------------------------------------------------


def _reference(name: str, data, steps: int):
    cfg, model = tiny(f"optimizer={name}", "telemetry.moe=true")
    opt = build_optimizer(model, cfg.optimizer, CPU, seed=5)
    tel = MoETelemetry(model, CPU)
    grad_sq = None
    for x, y in data[:steps]:
        sums = chunked_tied_ce(model(x), model.head_weight, y)
        (sums.total / sums.tokens).backward()
        grad_sq = tel.grad_norms()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.clone() for k, v in model.state_dict().items()}, grad_sq


def _ddp_run(rank: int, world: int, name: str, data, steps: int, out: str) -> None:
    cfg, model = tiny(f"optimizer={name}", "telemetry.moe=true")
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = build_optimizer(model, cfg.optimizer, CPU, seed=5)
    tel = MoETelemetry(model, CPU)
    rows = data[0][0].shape[0] // world
    for x, y in data[:steps]:
        x, y = x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]
        with tel.recording():
            hidden = ddp(x)
        sums = chunked_tied_ce(hidden, model.head_weight, y)
        (sums.total / sums.tokens).backward()  # DDP averages: equal token counts -> the global mean
        grad_sq = tel.grad_norms()
        opt.step()
        opt.zero_grad(set_to_none=True)
    _, layer_rows = tel.collect(steps, grad_sq)  # all-reduces the counters
    result = {"state": model.state_dict(), "grad_sq": grad_sq, "rows": layer_rows}
    torch.save(result, f"{out}/{name}_rank{rank}.pt")


def _ddp_worker(rank: int, world: int, data, steps: int, out: str) -> None:
    torch.set_num_threads(1)
    # a file rendezvous: no TCP port to collide with other jobs on the machine
    store = f"file://{out}/rendezvous"
    dist.init_process_group(
        "gloo", init_method=store, rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    try:
        for name in OPTIMIZERS:
            _ddp_run(rank, world, name, data, steps, out)  # its DDP wrapper is gone when it returns
    finally:
        distributed.shutdown()  # as the train app ends a job (see its docstring: a gloo teardown race)


@pytest.mark.subprocess
def test_ddp_two_ranks_equal_one_process_with_the_whole_batch(tmp_path):
    """Every optimizer under DDP (2 gloo ranks, half the batch each) == one process with the whole batch;
    and the telemetry's grad norms and token counters are those of the whole batch."""
    data, steps = batches(2, rows=4), 2
    spawn_ranks(_ddp_worker, (2, data, steps, str(tmp_path)))
    for name in OPTIMIZERS:
        ref_state, ref_grad_sq = _reference(name, data, steps)
        ranks = [torch.load(tmp_path / f"{name}_rank{r}.pt", weights_only=False) for r in range(2)]
        for key, ref in ref_state.items():
            a, b = ranks[0]["state"][key], ranks[1]["state"][key]
            assert torch.equal(a, b), (name, key)  # no rank drifts: same averaged gradient, math, noise
            if name == "stosignsgd":  # a sign may flip where m + G n is within rounding of 0: allow a few
                assert (a - ref).abs().gt(1e-6).float().mean() < 1e-3, key
            else:  # Adam divides by sqrt(v): near-zero gradients carry rounding further
                torch.testing.assert_close(a, ref, rtol=1e-4, atol=1e-5)
        # telemetry grad norms come from the averaged gradient: one process's, not sqrt(world) larger
        torch.testing.assert_close(ranks[0]["grad_sq"], ref_grad_sq, rtol=1e-4, atol=1e-10)
        # token counters are summed over the ranks: the whole batch, K route slots per token, per layer
        assert [r["route_slots"] for r in ranks[0]["rows"]] == [steps * 4 * 16 * 2] * 2


def test_every_optimizer_option_reaches_its_update_rule():
    cfg, model = tiny(
        "optimizer=muon_tr",
        "optimizer.muon_momentum=0.8",
        "optimizer.muon_nesterov=false",
        "optimizer.muon_ns_steps=3",
        "optimizer.muon_update_rms=0.4",
        "optimizer.muon_lr_scale=2",
        "optimizer.expert_weight_decay=0.01",
    )
    muon = build_optimizer(model, cfg.optimizer, CPU).optimizers["muon"]
    for g in muon.param_groups:
        assert (g["momentum"], g["nesterov"], g["ns_steps"], g["update_rms"]) == (0.8, False, 3, 0.4)
        assert g["base_lr"] == pytest.approx(2e-3) and g["weight_decay"] == 0.01
    cfg, model = tiny("optimizer=stosignsgd", "optimizer.stosign_max_decay=0.9", "optimizer.beta1=0.5")
    opt = build_optimizer(model, cfg.optimizer, CPU, seed=11)
    assert opt.seed == 11 and all(g["max_decay"] == 0.9 and g["beta"] == 0.5 for g in opt.param_groups)


def test_muon_update_rms_scales_the_step():
    def step_rms(update_rms):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(3, 32, 16))
        opt = Muon([w], lr=0.1, update_rms=update_rms)
        w.grad = torch.randn(3, 32, 16)
        before = w.detach().clone()
        opt.step()
        return float((w.detach() - before).pow(2).mean().sqrt())

    assert step_rms(0.4) == pytest.approx(2 * step_rms(0.2), rel=1e-5)


def test_stosign_max_decay_lets_the_scale_forget():
    def scale_after(d):
        p = torch.nn.Parameter(torch.zeros(4))
        opt = StoSignSGD([p], lr=1e-3, beta=0.0, max_decay=d)
        for g in (10.0, 1.0, 1.0):
            p.grad = torch.full((4,), g)
            opt.step()
        return opt.state[p]["max_scale"]

    assert torch.equal(scale_after(1.0), torch.full((4,), 10.0))  # a running maximum
    torch.testing.assert_close(scale_after(0.5), torch.full((4,), 2.5))  # 10 * 0.5 * 0.5


# The old runner's AdamW groups for its default 100m model (fact sheet reference-formats-and-routing.md 1.2),
# by its parameter names ({l}: every layer): (group, weight decay) -> members, and how many tensors it counts.
OLD_RUNNER_GROUPS = {
    ("base", 0.1): (["embed_tokens.weight", *(f"{{l}}.self_attn.{x}_proj.weight" for x in "kqvo")], 41),
    ("base", 0.0): (
        [
            "{l}.input_layernorm.weight",
            "{l}.self_attn.q_norm.weight",
            "{l}.self_attn.k_norm.weight",
            "{l}.post_attention_layernorm.weight",
            "{l}.mlp.routed_output_gate",
            "norm.weight",
        ],
        51,
    ),
    ("shared", 0.1): ([f"{{l}}.mlp.shared_{x}.weight" for x in ("gate", "up", "down")], 30),
    ("shared", 0.0): (["{l}.mlp.shared_output_gate"], 10),
    ("expert", 0.1): ([f"{{l}}.mlp.{x}_proj_w" for x in ("gate", "up", "down")], 30),
}
# its names -> trmoe's (fact sheet 1.3; q/k/v are one fused tensor, the experts' gate/up one w_in)
TRMOE_NAME = {
    "embed_tokens.weight": "embed.weight",
    "norm.weight": "norm.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    **{f"self_attn.{x}_proj.weight": "attn.qkv.weight" for x in "qkv"},
    "self_attn.o_proj.weight": "attn.out.weight",
    **{f"self_attn.{x}_norm.weight": f"attn.{x}_norm.weight" for x in "qk"},
    "mlp.routed_output_gate": "ffn.routed_gate",
    "mlp.shared_output_gate": "ffn.shared_gate",
    "mlp.shared_gate.weight": "ffn.shared.w_in",
    "mlp.shared_up.weight": "ffn.shared.w_in",
    "mlp.shared_down.weight": "ffn.shared.w_out",
    "mlp.gate_proj_w": "ffn.routed.w_in",
    "mlp.up_proj_w": "ffn.routed.w_in",
    "mlp.down_proj_w": "ffn.routed.w_out",
}


def _old_runner_layout(layers: int) -> dict[tuple[str, float], set[str]]:
    """The fact sheet's groups in trmoe's names (the tensor counts checked against the sheet's on the way)."""
    out = {}
    for group, (members, count) in OLD_RUNNER_GROUPS.items():
        ref = [m.format(l=f"layers.{i}") for m in members for i in range(layers if "{l}" in m else 1)]
        assert len(ref) == count, group
        out[group] = {
            f"blocks.{r.split('.')[1]}.{TRMOE_NAME[r.split('.', 2)[2]]}"
            if r.startswith("layers.")
            else TRMOE_NAME[r]
            for r in ref
        }
    return out


def _groups(cfg) -> dict[tuple[str, float], tuple[set[str], float]]:
    """(role, weight decay) -> (parameter names, lr) of the optimizer build_optimizer makes for cfg."""
    with torch.device("meta"):
        model = TRMoETransformer(model_spec(cfg))
    optimizer = build_optimizer(model, cfg.optimizer, torch.device("meta"))
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        (g["name"].removesuffix("_no_decay"), g["weight_decay"]): (
            {names[id(p)] for p in g["params"]},
            g["lr"],
        )
        for g in optimizer.param_groups
    }


def test_compat_old_runner_builds_the_old_runners_optimizer_groups_exactly():
    """compat=old_runner: the same parameters in the same (group, weight decay) and at the same lr as the old
    runner's AdamW on its default 100m model; trmoe's defaults differ in exactly the two documented ways."""
    cfg = to_config(compose_config("model=100m", "compat=old_runner"))
    assert (cfg.optimizer.lr, cfg.trainer.grad_clip, cfg.model.gates) == (3e-4, 0.0, True)
    groups = _groups(cfg)
    want = _old_runner_layout(cfg.model.num_layers)
    assert {key: names for key, (names, _) in groups.items()} == want
    assert {lr for _, lr in groups.values()} == {3e-4}  # --expert-lr-scale 1, --shared-lr-scale 1
    default = _groups(to_config(compose_config("model=100m", "optimizer.lr=3e-4")))
    moved = {n for n in want[("base", 0.0)] if n.endswith("routed_gate")}
    assert default[("expert", 0.0)][0] == moved  # trmoe's default: the routed gate with the experts
    assert "embed.weight" in default[("base", 0.0)][0]  # and the tied embedding not decayed


# --- lion (trmoe/optim/variants/lion.py): an optimizer added as one module --------------------------------


def test_lion_one_step_is_the_documented_update():
    """c = b1 m + (1 - b1) g;  w <- w (1 - lr wd) - lr sign(c);  m <- b2 m + (1 - b2) g (docs/optimizers.md)
    on two steps; the state is one fp32 tensor."""
    from trmoe.optim.variants.lion import lion_class

    lr, wd, b1, b2 = 0.1, 0.5, 0.8, 0.9
    w0 = torch.tensor([1.0, -2.0, 0.5, 0.0])
    p = torch.nn.Parameter(w0.clone())
    opt = lion_class()([p], lr=lr, betas=(b1, b2), weight_decay=wd)
    grads = [torch.tensor([0.3, -0.1, 0.0, 2.0]), torch.tensor([-1.0, 0.2, 0.0, -0.5])]
    w, m = w0.double(), torch.zeros(4, dtype=torch.float64)
    for g in grads:
        p.grad = g.clone()
        opt.step()
        c = b1 * m + (1 - b1) * g.double()
        w = w * (1 - lr * wd) - lr * torch.sign(c)
        m = b2 * m + (1 - b2) * g.double()
        torch.testing.assert_close(p.detach().double(), w, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(opt.state[p]["exp_avg"].double(), m, rtol=1e-6, atol=1e-7)
    assert opt.state[p]["exp_avg"].dtype == torch.float32  # its one state: 4 B per parameter


def test_lion_options_reach_its_groups_and_resume_continues_exactly():
    # optimizer.name=lion (the adamw group with another name): conf/optimizer has no lion.yaml
    lion = ("optimizer.name=lion", "optimizer.lion_beta1=0.7", "optimizer.lion_beta2=0.95")
    cfg, model = tiny(*lion, "optimizer.expert_lr_scale=2")
    opt = build_optimizer(model, cfg.optimizer, CPU)
    assert type(opt).__name__ == "Lion" and all(g["betas"] == (0.7, 0.95) for g in opt.param_groups)
    apply_lr(opt, 0.5)
    assert GroupLRs(model, opt).row()["lr_expert"] == pytest.approx(1e-3)

    assert_resume_continues_exactly(*lion)


def test_lion_trains_in_the_train_app(tmp_path):
    args = [*FAST_CPU, "optimizer.name=lion", "optimizer.lr=3e-4", "trainer.steps=3", "run.name=lion"]
    done = cli(args, tmp_path)
    assert done.returncode == 0, done.stderr
    run = tmp_path / "runs" / "lion"
    record = json.loads((run / "run_config.json").read_text())
    assert record["config"]["optimizer"]["name"] == "lion"
    assert record["config"]["optimizer"]["lion_beta2"] == 0.99
    assert {g["optimizer"] for g in record["controls"]["optimizer_groups"]} == {"lion"}
    rows = metrics_rows(run)
    losses = [float(r["train_loss"]) for r in rows if r["train_loss"] != "nan"]
    assert rows[-1]["step"] == "3" and losses and all(math.isfinite(x) for x in losses)


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["optimizer.lion_beta1=1.5"], "trmoe: config error: optimizer.lion_beta1=1.5: must be in [0, 1)"),
        (["optimizer.lion_beta2=-0.1"], "trmoe: config error: optimizer.lion_beta2=-0.1: must be in [0, 1)"),
    ],
)
def test_a_bad_lion_option_is_one_line_and_exit_2(tmp_path, args, line):
    result = cli([*FAST_CPU, "optimizer.name=lion", "trainer.steps=1", *args], tmp_path)
    assert result.returncode == 2 and result.stderr.strip() == line, result.stderr
    assert list(tmp_path.rglob("*")) == []


def test_an_unknown_optimizer_key_names_the_allowed_keys(tmp_path):
    result = cli([*FAST_CPU, "optimizer.name=lion", "optimizer.lion_beta3=0.5"], tmp_path)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "optimizer.lion_beta3" in lines[0] and "lion_beta1, lion_beta2" in lines[0], lines[0]


def test_the_planner_counts_lions_state(tmp_path):
    done = cli(["model=tiny", "optimizer.name=lion", "--json"], tmp_path, module="trmoe.plan")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    state = next(i for i in plan["memory"]["items"] if i["what"] == "optimizer state")
    total = plan["model"]["params"]["total"]
    assert state["bytes"] == 4 * total and state["note"] == f"lion (exp_avg): 4 B x {total:,}"


def test_the_registry_declares_every_optimizer():
    """One registry: the schema's names and keys, and docs/optimizers.md's table, come from it."""
    from pathlib import Path

    from trmoe.config.optimizers import OPTIMIZERS, optimizer_table
    from trmoe.config.schema import OptimizerConfig, OptimizerName

    assert OPTIMIZERS.names()[:4] == ("adamw", "muon_tr", "stosignsgd", "lion")
    assert [n.value for n in OptimizerName][:4] == list(OPTIMIZERS.names()[:4])
    keys = list(OptimizerConfig.__dataclass_fields__)
    # the keys run_config.json always had, in their order, then Lion's
    assert keys[keys.index("wsd_decay_shape") + 1 :] == [
        "muon_scope",
        "muon_lr_scale",
        "muon_momentum",
        "muon_nesterov",
        "muon_ns_steps",
        "muon_update_rms",
        "muon_split_gate_up",
        "stosign_max_decay",
        "lion_beta1",
        "lion_beta2",
    ]
    doc = (Path(__file__).resolve().parents[1] / "docs" / "optimizers.md").read_text()
    assert optimizer_table() in doc, "docs/optimizers.md's table differs from optimizer_table()"
    for name in OPTIMIZERS:
        assert f"## {name}" in doc
