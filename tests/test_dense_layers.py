"""Dense layers inside `routing.layers` (`strategy: dense`, docs/routing.md "Dense layers"): the layer's FFN
is the shared SwiGLU widened to a routed layer's active width, S + K x W_e. Its formula, its parameters
counted by hand, the active-parameter match (model.match_count=active), muP's multiplier, the KV cache
(test_sample.py), FLOPs and activations (test_plan.py), telemetry, the Hugging Face export with equal
logits, bit-exact SIGKILL resume of a first-k-dense run, init_from, and bad input as one line with exit
code 2."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch
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
from trmoe.match import solve_arm
from trmoe.model.moe import swiglu
from trmoe.model.mup import dense_mult, fan_in_mult
from trmoe.model.transformer import TRMoETransformer, parameter_counts
from trmoe.run.checkpoint import load_checkpoint

TINY = ["model=tiny", "model.vocab_size=512", "model.gates=false"]
DENSE_0 = "routing.layers=[{first: 0, last: 0, strategy: dense}]"


def _spec(*overrides: str):
    return model_spec(to_config(compose_config(*TINY, *overrides)))


def test_a_dense_layer_is_one_swiglu_of_the_routed_layers_active_width():
    """y = a * S'(x), width(S') = shared_width + K x routed_width / E; no routed experts, no gates."""
    spec = _spec("routing=learned_v3", DENSE_0, "model.gates=true", "model.shared_scale=0.5")
    assert spec.strategies == ("dense", "learned_v3")
    torch.manual_seed(0)
    model = TRMoETransformer(spec).double()
    dense, routed = model.blocks[0].ffn, model.blocks[1].ffn
    width = spec.shared_width + spec.top_k * spec.routed_width // spec.num_experts
    assert spec.dense_width == width == 192 + 2 * 16
    assert dense.shared.w_in.shape == (64, 2 * width) and dense.shared.w_out.shape == (width, 64)
    assert dense.routed is None and dense.router is None and dense.route_bias is None
    assert dense.shared_gate is None and dense.routed_gate is None  # one branch: nothing to weigh
    assert routed.routed is not None and routed.shared.w_out.shape == (spec.shared_width, 64)
    assert routed.shared_gate is not None  # the routed layer keeps its gates
    x = torch.randn(3, 5, 64, dtype=torch.float64)
    y = dense(x, torch.zeros(3, 5, dtype=torch.long))
    expected = 0.5 * swiglu(x.reshape(-1, 64), dense.shared.w_in, dense.shared.w_out)
    torch.testing.assert_close(y.reshape(-1, 64), expected)
    assert dense.router_terms is None and dense.route_key == "token"


def _by_hand(spec, dense_layers: set[int], routers: set[int]) -> tuple[int, int]:
    """(total, active) from the shapes alone: embedding, norms, attention, and per layer its FFN."""
    h, d = spec.hidden_size, spec.head_dim
    q, kv = spec.num_heads * d, spec.num_kv_heads * d
    w_e, e, k = spec.routed_width // spec.num_experts, spec.num_experts, spec.top_k
    total = active = spec.embedding_rows * h + h  # tied embedding, final norm
    for layer in range(spec.num_layers):
        common = 2 * h + h * (q + 2 * kv) + q * h + 2 * d  # 2 norms, qkv, out, q/k norms
        if layer in dense_layers:
            ffn = ffn_active = 3 * h * (spec.shared_width + k * w_e)  # w_in [H, 2W] + w_out [W, H]
        else:
            ffn = 3 * h * spec.shared_width + e * 3 * h * w_e + (e * h if layer in routers else 0)
            ffn_active = ffn - (e - k) * 3 * h * w_e
        total += common + ffn
        active += common + ffn_active
    return total, active


@pytest.mark.parametrize(
    ("overrides", "dense", "routers"),
    [
        (["routing=balanced_hash"], set(), set()),
        (["routing=balanced_hash", DENSE_0], {0}, set()),
        (["routing=learned_v3", DENSE_0], {0}, {1}),
        (
            [
                "routing=balanced_hash",
                "routing.layers=[{first: 1, last: 2, strategy: dense}]",
                "model.num_layers=4",
            ],
            {1, 2},
            set(),
        ),
    ],
)
def test_parameters_are_counted_as_by_hand(overrides, dense, routers):
    spec = _spec(*overrides)
    counts = parameter_counts(spec)
    assert (counts.total, counts.active) == _by_hand(spec, dense, routers)
    assert solve_arm([*TINY, *overrides])["total"] == counts.total  # what python -m trmoe.match prints


def test_a_dense_layer_has_a_routed_layers_active_parameters_and_fewer_total():
    hashed, dense = _spec("routing=balanced_hash"), _spec("routing=balanced_hash", DENSE_0)
    a, b = parameter_counts(hashed), parameter_counts(dense)
    idle = (hashed.num_experts - hashed.top_k) * 3 * hashed.hidden_size * hashed.expert_width
    assert a.active == b.active and a.total - b.total == idle


def test_match_count_active_matches_the_first_k_arms_exactly_and_total_would_not():
    """At E = 6 the learned_v3 router (6 x 64 per layer) is exactly one unit of shared width (3 x 64 x 2
    layers): every arm lands on the all-hash arm's active count."""
    base = [*TINY, "model.num_experts=6", "model.routed_width=192", "model.match_multiple=1"]
    target = parameter_counts(_spec(*base[3:], "routing=balanced_hash")).active
    arms = {
        "all_hash": ["routing=balanced_hash"],
        "first_k_hash": ["routing=learned_v3", "routing.layers=[{first: 0, last: 0, strategy: multi_hash}]"],
        "first_k_dense": ["routing=learned_v3", DENSE_0],
        "all_learned": ["routing=learned_v3"],
    }
    widths, active = {}, ["model.match_count=active", f"model.match_params={target}"]
    for arm, extra in arms.items():
        cfg = to_config(compose_config(*base, *extra, *active))
        solution = solve_match(cfg)
        assert solution.exact and solution.count == "active" and solution.active == target, (arm, solution)
        assert parameter_counts(model_spec(cfg)).active == target
        widths[arm] = cfg.model.shared_width
    assert widths == {"all_hash": 192, "first_k_hash": 191, "first_k_dense": 191, "all_learned": 190}
    row = solve_arm([*base, *arms["first_k_dense"], *active])
    assert "0:dense 255 1:learned_v3" in row["ffn"] and row["active"] == target
    # the same target as a total: the dense arm's shared expert would take the idle experts' weights too
    total = solve_match(to_config(compose_config(*base, *arms["first_k_dense"], active[1])))
    assert total.count == "total" and total.active < target


def test_mup_gives_the_dense_layers_w_out_its_own_fan_in_multiplier():
    mup = ["model.parametrization=mup", "model.mup_base_width=32", "routing=balanced_hash", DENSE_0]
    spec = _spec(*mup)
    m_d = spec.mup_width_mult
    assert dense_mult(spec) == pytest.approx(m_d)  # default bases: every width scales with m_d
    spec = _spec(*mup, "model.mup_base_shared_width=64", "model.mup_base_routed_width=32")
    expected = (192 + 2 * 16) / (192 / 3 + 2 * 16 / 2)  # (S + K W_e) / (S / m_s + K W_e / m_r)
    assert fan_in_mult("blocks.0.ffn.shared.w_out", spec) == pytest.approx(expected)
    assert fan_in_mult("blocks.1.ffn.shared.w_out", spec) == pytest.approx(3.0)  # a routed layer's m_s
    assert fan_in_mult("blocks.0.ffn.shared.w_in", spec) == m_d


def test_hf_export_of_dense_layers_gives_trmoe_logits(tmp_path):
    pytest.importorskip("transformers")
    for name, overrides in {
        "table": ["routing=balanced_hash", DENSE_0],
        "hashed_key_and_gate": [
            "routing=bigram_hash",
            "routing.layers=[{first: 1, last: 1, strategy: dense}]",
            "routing.combine=learned",
        ],
    }.items():
        torch.manual_seed(0)
        model = TRMoETransformer(_spec(*overrides)).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        ids = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(1))
        full, decoded = hf_export_differences(model, tmp_path / name, ids)
        config = json.loads((tmp_path / name / "config.json").read_text())
        assert config["dense_layers"] == [i for i in range(2) if model.spec.is_dense(i)]
        print(f"hf export vs trmoe, dense layers ({name}): {full:.1e} / cached {decoded:.1e}")
        assert full < 1e-4 and decoded < 1e-4, name


# ----------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["routing.layers=[{first: 0, last: 2, strategy: dense}]"], "routing.layers[0]={first: 0, last: 2}"),
        (["routing.layers=[{first: -1, last: 0, strategy: dense}]"], "routing.layers[0]={first: -1"),
        (
            [
                "routing.layers=[{first: 0, last: 1, strategy: learned_v3}, "
                "{first: 1, last: 1, strategy: dense}]"
            ],
            "overlaps routing.layers[0] at layer 1",
        ),
        (["routing=dense"], "routing.strategy=dense: every layer dense"),
        (["routing.layers=[{first: 0, last: 1, strategy: dense}]"], "routing.layers[0].strategy=dense"),
        (
            [DENSE_0, "model.num_experts=1", "routing.top_k=1", "model.routed_width=0"],
            "routing.layers[0].strategy=dense: a dense layer is widened",
        ),
        (["routing=learned_v3", DENSE_0, "routing.combine=learned"], "routing.combine=learned"),
    ],
)
def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path, args, needle):
    out = cli([*args, "model=tiny", "trainer.steps=1", "data=random", "hardware=cpu"], tmp_path)
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], out.stderr
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------- training, resume, telemetry

RUN = [*RANDOM_IDS_CPU, "trainer.micro_batch=2", "trainer.steps=8", "trainer.log_every=1"]
RUN += ["checkpoint.every_steps=4", "telemetry.moe=true", "run.name=r"]
FIRST_K_DENSE = ["routing=learned_v3", DENSE_0, "routing.bias_update=0.01"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A first-k-dense + learned_v3 run of 8 steps, and the same SIGKILLed in step 6's forward (a forked
    child) then resumed from its step-4 checkpoint."""
    return killed_and_resumed(tmp_path_factory.mktemp("dense"), {"first_k_dense": [*RUN, *FIRST_K_DENSE]})


@pytest.mark.subprocess
def test_a_first_k_dense_run_trains_and_resumes_bit_exact_after_sigkill(runs):
    run = runs["first_k_dense"]
    assert_same_run(runs["first_k_dense/resumed"], run)
    losses = [float(r["train_loss"]) for r in metrics_rows(run) if int(r["step"]) > 0]
    assert len(losses) == 8 and all(math.isfinite(v) for v in losses)
    # the dense layer's widened expert trains: its weights moved between the step-4 and step-8 checkpoints
    early = load_checkpoint(run / "checkpoints" / "step_00000004")["model"]
    final = load_checkpoint(run)["model"]
    assert early["blocks.0.ffn.shared.w_in"].shape == (64, 2 * (192 + 2 * 16))
    assert not torch.equal(early["blocks.0.ffn.shared.w_in"], final["blocks.0.ffn.shared.w_in"])
    assert "blocks.0.ffn.router" not in final and "blocks.0.ffn.routed.w_in" not in final
    record = json.loads((run / "run_config.json").read_text())
    assert record["model_spec"]["layer_strategies"] == ["dense", "learned_v3"]
    held = sum(g["params"] for g in record["controls"]["optimizer_groups"])
    assert held == parameter_counts(model_spec(to_config(compose_config(*RUN, *FIRST_K_DENSE)))).total


@pytest.mark.subprocess
def test_telemetry_skips_the_dense_layers_expert_columns(runs):
    """A dense layer has no route slots: its telemetry row carries its shared branch only, and the expert
    aggregates (imbalance, dead experts) are the routed layer's."""
    with open(runs["first_k_dense"] / "telemetry.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    dense = [r for r in rows if r["layer"] == "0"]
    routed = [r for r in rows if r["layer"] == "1"]
    assert dense and all(r["route_slots"] == "0" and r["imbalance"] in ("", "nan") for r in dense)
    assert all(float(r["shared_rms"]) > 0 and r["share_0"] in ("", "nan") for r in dense)
    assert all(int(r["route_slots"]) > 0 and float(r["imbalance"]) >= 1.0 for r in routed)
    last = metrics_rows(runs["first_k_dense"])[-1]
    assert float(last["expert_imbalance"]) == pytest.approx(float(routed[-1]["imbalance"]))


@pytest.mark.subprocess
def test_init_from_a_dense_run_needs_the_same_dense_layers(runs, tmp_path):
    parent = runs["first_k_dense"]
    base = [*RUN, "trainer.steps=1", f"trainer.init_from={parent}", "run.name=child"]
    for where in ("other", "same"):
        (tmp_path / where).mkdir()
    refused = cli([*base, "routing=learned_v3"], tmp_path / "other")
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert refused.returncode == 2 and len(lines) == 1 and "another model shape" in lines[0], refused.stderr
    assert "blocks.0.ffn" in lines[0]
    assert not (tmp_path / "other" / "runs" / "child").exists()
    same = cli([*base, *FIRST_K_DENSE], tmp_path / "same")
    assert same.returncode == 0, same.stderr[-3000:]
