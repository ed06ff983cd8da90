"""The 2026 controls of docs/routing.md: `learned_v3` (DeepSeek-V3's router: sigmoid scores, top-K on scores
plus a balancing bias updated after every step, an optional sequence-wise balance loss) and
`routing.combine=learned` (DeepSeek-V4's learned combine gate over a table's routes). Their formulas, the
bias moving toward balance, what is counted and matched, bad input, the guard that keeps router losses off
table layers, and bit-exact SIGKILL resume of a run with each."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    assert_same_run,
    cli,
    compose_config,
    hf_export_differences,
    killed_and_resumed,
    metrics_rows,
)
from presets import RANDOM_IDS_CPU

from trmoe.config.param_match import solve_match
from trmoe.config.resolve import to_config
from trmoe.config.spec import model_spec
from trmoe.model.moe import TRMoEFFN, swiglu
from trmoe.model.spec import ffn_spec
from trmoe.model.transformer import TRMoETransformer, parameter_counts
from trmoe.run.checkpoint import load_checkpoint

H, E, K = 8, 4, 2
RUN = [*RANDOM_IDS_CPU, "trainer.micro_batch=2", "trainer.steps=8", "trainer.log_every=1"]
RUN += ["checkpoint.every_steps=4", "telemetry.moe=true", "run.name=r"]
ARMS = {
    "learned_v3": ["routing=learned_v3", "routing.seq_aux_weight=0.01", "routing.bias_update=0.01"],
    "combine": ["routing=balanced_hash", "routing.combine=learned"],
}


def _ffn(strategy: str, **spec) -> TRMoEFFN:
    torch.manual_seed(0)
    base = ffn_spec(hidden_size=H, shared_width=6, routed_width=E * 4, num_experts=E, top_k=K, vocab_size=64)
    ffn = TRMoEFFN(replace(base, strategy=strategy, **spec), layer=0).double()
    with torch.no_grad():
        for p in ffn.parameters():
            p.normal_(0.0, 0.5)
    return ffn


def _expected(ffn: TRMoEFFN, flat: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor):
    """The formula: shared expert plus sum_k w_k E_{r_k}(x), row by row."""
    out = swiglu(flat, ffn.shared.w_in, ffn.shared.w_out)
    for n in range(flat.shape[0]):
        for k in range(K):
            e = int(experts[n, k])
            out[n] += weights[n, k] * swiglu(flat[n : n + 1], ffn.routed.w_in[e], ffn.routed.w_out[e])[0]
    return out


def _spec(*overrides: str):
    return model_spec(to_config(compose_config("model=tiny", "model.vocab_size=512", *overrides)))


# ------------------------------------------------------------------------------------------ learned_v3


def test_v3_forward_and_balance_term_follow_their_formulas():
    """s = sigmoid(x W_r^T); top-K of s + b; w = the selected s over their sum (b picks, never weighs);
    seq_aux = mean over sequences of sum_e f_e P_e."""
    ffn = _ffn("learned_v3")
    with torch.no_grad():
        ffn.route_bias.copy_(torch.tensor([0.0, 0.7, -0.7, 0.1]))
    x = torch.randn(3, 10, H, dtype=torch.float64)
    y = ffn(x, torch.zeros(3, 10, dtype=torch.long))
    flat = x.reshape(-1, H)
    s = (flat @ ffn.router.T).sigmoid()
    top = (s + ffn.route_bias).topk(K, dim=-1).indices
    assert not torch.equal(top, s.topk(K, dim=-1).indices)  # the bias changed some choices
    chosen = s.gather(1, top)
    weights = chosen / chosen.sum(-1, keepdim=True)
    torch.testing.assert_close(y.reshape(-1, H), _expected(ffn, flat, top, weights), rtol=1e-12, atol=1e-12)
    one_hot = torch.zeros_like(s).scatter_(1, top, 1.0).view(3, 10, E)
    f = one_hot.sum(1) * E / (K * 10)
    p = (s / s.sum(-1, keepdim=True)).view(3, 10, E).mean(1)
    torch.testing.assert_close(ffn.router_terms["seq_aux"], (f * p).sum(-1).mean())
    assert set(ffn.router_terms) == {"seq_aux"}  # no Switch aux, no z-loss
    # the training forward counted its loads: K slots per token
    assert torch.equal(ffn.route_load, one_hot.sum((0, 1)).float())
    ffn.reset_load()
    with torch.no_grad():  # evaluation and sampling do not count
        ffn(x, torch.zeros(3, 10, dtype=torch.long))
    assert float(ffn.route_load.sum()) == 0.0


def test_v3_bias_update_is_gamma_times_the_sign_of_mean_minus_load():
    ffn = _ffn("learned_v3")
    before = ffn.route_bias.clone()
    ffn.update_bias(torch.tensor([10.0, 2.0, 4.0, 0.0]), 0.25)  # mean 4
    torch.testing.assert_close(ffn.route_bias - before, torch.tensor([-0.25, 0.25, 0.0, 0.25]).double())


def test_a_skewed_v3_router_becomes_balanced_within_150_steps():
    """Without the bias one expert takes every token's first slot (max load / mean load 2 at K = 2 of 4);
    with gamma = 0.01 the bias balances the loads to within 15% in at most 150 updates (the router itself
    held fixed: the bias alone does it)."""
    ffn = _ffn("learned_v3")
    x = torch.randn(256, H, dtype=torch.float64)
    with torch.no_grad():
        ffn.router[0] = 0.0
        ffn.router[0, 0] = 50.0  # expert 0's score is ~1 for every token with x_0 > 0 ...
        x[:, 0] = x[:, 0].abs() + 0.1  # ... which is every token
    ids = torch.zeros(256, dtype=torch.long)

    def imbalance() -> float:
        ffn.reset_load()
        ffn(x, ids)
        return float(ffn.route_load.max() / ffn.route_load.mean())

    assert imbalance() == pytest.approx(2.0)
    history = []
    for _ in range(150):
        history.append(imbalance())
        ffn.update_bias(ffn.route_load, 0.01)
    assert min(history[-10:]) < 1.15 and max(history[-10:]) < 1.3, history[-10:]
    assert float(ffn.route_bias[0]) < 0  # the over-loaded expert was pushed down


def test_v3_bias_is_state_not_a_parameter():
    """The bias is a persistent buffer: in the state dict (the checkpoint), in no parameter list, so in no
    optimizer and no count: learned_v3 counts exactly as learned (the same router W_r)."""
    spec = _spec("routing=learned_v3")
    model = TRMoETransformer(spec)
    assert "blocks.0.ffn.route_bias" in model.state_dict()
    assert "blocks.0.ffn.route_load" not in model.state_dict()  # a step's running sum, zeroed every step
    assert not any("route_bias" in name for name, _ in model.named_parameters())
    assert parameter_counts(spec) == parameter_counts(_spec("routing=learned"))


# ------------------------------------------------------------------------------------ learned combine


def test_learned_combine_follows_its_formula_over_the_tables_routes():
    """The routes stay the table's; w_k = g_{r_k} / sum_j g_{r_j}, g = sqrt(softplus(x W_g^T))."""
    ffn = _ffn("multi_hash", combine="learned")
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    x = torch.randn(2, 9, H, dtype=torch.float64)
    y = ffn(x, ids)
    flat, routes = x.reshape(-1, H), ffn.routed.route_table[:, ids.reshape(-1)].long().T
    g = F.softplus(flat @ ffn.combine_gate.weight.T).sqrt().gather(1, routes)
    torch.testing.assert_close(y.reshape(-1, H), _expected(ffn, flat, routes, g / g.sum(-1, keepdim=True)))
    assert ffn.router_terms is None  # no loss term reads the gate


def test_learned_combine_gate_is_counted_and_matched_exactly():
    fixed, learned = _spec("routing=balanced_hash"), _spec("routing=balanced_hash", "routing.combine=learned")
    a, b = parameter_counts(fixed), parameter_counts(learned)
    gate = learned.num_layers * learned.num_experts * learned.hidden_size
    assert b.total - a.total == gate and b.active - a.active == gate  # every token uses the whole gate
    base = ["model=tiny", "model.vocab_size=512", "routing=balanced_hash", "routing.combine=learned"]
    target = parameter_counts(_spec(*base[2:])).total + 64 * 3 * learned.hidden_size * learned.num_layers
    solution = solve_match(to_config(compose_config(*base, f"model.match_params={target}")))
    assert solution.exact and solution.total == target
    matched = model_spec(to_config(compose_config(*base, f"model.match_params={target}")))
    assert parameter_counts(matched).total == target


def test_hf_export_of_a_learned_combine_gives_trmoe_logits(tmp_path):
    """The gate is a plain linear layer: the exported model code computes the same w_k (config.json's
    "combine": "learned"), so its logits equal trmoe's, with and without its KV cache."""
    pytest.importorskip("transformers")
    for strategy in ("balanced_hash", "bigram_hash"):  # a table, and a hashed key
        torch.manual_seed(0)
        model = TRMoETransformer(_spec(f"routing={strategy}", "routing.combine=learned")).eval()
        with torch.no_grad():  # gate rows far from their init: weights far from 1/K
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.3 if p.ndim == 2 else 0.0)
        ids = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(1))
        full, decoded = hf_export_differences(model, tmp_path / strategy, ids)
        config = json.loads((tmp_path / strategy / "config.json").read_text())
        assert config["combine"] == "learned" and config["dense_layers"] == []
        print(f"hf export vs trmoe, combine=learned over {strategy}: {full:.1e} / cached {decoded:.1e}")
        assert full < 1e-4 and decoded < 1e-4, strategy


# ------------------------------------------------------------------------------------------- the guard


def test_no_router_loss_reaches_a_table_layer():
    """Layer 0 a learned_v3 router, layer 1 a table with a learned combine: the router losses' gradient
    reaches layer 0's router and nothing of layer 1 (it comes after the router: only a loss computed on its
    own routes could reach it). A model of table layers has no router losses at all, and a table layer that
    left loss terms is refused."""
    overrides = ["routing=balanced_hash", "routing.combine=learned"]
    overrides += ["routing.layers=[{first: 0, last: 0, strategy: learned_v3}]"]
    spec = _spec(*overrides)
    torch.manual_seed(0)
    model = TRMoETransformer(spec)
    assert model.blocks[1].ffn.combine_gate is not None and model.blocks[0].ffn.combine_gate is None
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    model(ids)
    terms = model.router_losses()
    sum(terms.values()).backward()
    assert float(model.blocks[0].ffn.router.grad.abs().max()) > 0
    for name, p in model.blocks[1].named_parameters():
        assert p.grad is None or not p.grad.any(), name
    tables = TRMoETransformer(_spec("routing=balanced_hash", "routing.combine=learned"))
    tables(ids)
    assert tables.router_losses() is None
    tables.blocks[1].ffn.router_terms = {"aux": torch.ones(())}  # what a buggy table layer would leave
    with pytest.raises(RuntimeError, match="layer 1 routes by a table"):
        tables.router_losses()


# ----------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["routing=learned", "routing.combine=learned"], "routing.combine=learned"),
        (["routing=learned_v3", "routing.combine=learned"], "routing.combine=learned"),
        (["routing=learned_v3", "routing.bias_update=-0.001"], "routing.bias_update=-0.001"),
        (["routing=learned_v3", "routing.seq_aux_weight=-1"], "routing.seq_aux_weight=-1"),
        (["routing.combine=learned", "routing.top_k=1"], "routing.combine=learned"),
    ],
)
def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path, args, needle):
    out = cli([*args, "trainer.steps=1", "data=random", "hardware=cpu"], tmp_path)
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], out.stderr
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------------- training, resume


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Per arm: an uninterrupted 8-step run, and a run SIGKILLed in step 6's forward then resumed from its
    step-4 checkpoint (the killed attempt in a forked child, the rest in this process)."""
    root = tmp_path_factory.mktemp("router_v3")
    return killed_and_resumed(root, {arm: [*RUN, *extra] for arm, extra in ARMS.items()})


@pytest.mark.subprocess
@pytest.mark.parametrize("arm", list(ARMS))
def test_sigkill_resume_is_bit_exact(runs, arm):
    assert_same_run(runs[arm + "/resumed"], runs[arm])


@pytest.mark.subprocess
def test_v3_trains_its_bias_is_saved_logged_and_in_no_optimizer(runs):
    run = runs["learned_v3"]
    final = load_checkpoint(run)["model"]
    for layer in (0, 1):
        bias = final[f"blocks.{layer}.ffn.route_bias"]
        assert bias.dtype == torch.float32 and bias.abs().max() > 0
    rows = metrics_rows(run)
    losses = [float(r["train_loss"]) for r in rows if int(r["step"]) > 0]
    assert losses[-1] < losses[0]
    last = rows[-1]
    bias = final["blocks.0.ffn.route_bias"]
    assert float(last["route_bias_spread/0"]) == pytest.approx(float(bias.max() - bias.min()))
    assert 1.0 <= float(last["route_load_imbalance/1"]) < 2.0
    assert 0.9 < float(last["router_aux"]) < 2.0  # the sequence-wise balance term
    record = json.loads((run / "run_config.json").read_text())
    held = sum(g["params"] for g in record["controls"]["optimizer_groups"])
    assert held == parameter_counts(model_spec(to_config(compose_config(*RUN, *ARMS["learned_v3"])))).total


@pytest.mark.subprocess
def test_the_learned_combine_gate_trains(runs):
    run = runs["combine"]
    final = load_checkpoint(run)["model"]
    spec = model_spec(to_config(compose_config(*RUN, *ARMS["combine"])))
    assert final["blocks.0.ffn.combine_gate.weight"].shape == (spec.num_experts, spec.hidden_size)
    assert "blocks.0.ffn.routed.route_table" in final  # the routes are still the table's
    record = json.loads((run / "run_config.json").read_text())
    held = sum(g["params"] for g in record["controls"]["optimizer_groups"])
    assert held == parameter_counts(model_spec(to_config(compose_config(*RUN, *ARMS["combine"])))).total
