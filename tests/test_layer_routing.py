"""Per-layer routing (`routing.layers`, docs/routing.md): a strategy per layer range, e.g.
`routing=hybrid_first_k` (DeepSeek-V4's first-k hash layers under a learned router). The model, parameter
counts, trmoe.match, the planner, run_config.json and a bit-exact SIGKILL resume follow the layers' own
strategies. Bad ranges are one-line errors (tests/test_config.py)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import assert_same_run, compose_config, drive
from presets import RANDOM_IDS_CPU

from trmoe.config.resolve import to_config
from trmoe.config.spec import model_spec
from trmoe.match import solve_arm
from trmoe.model.routing import build_route_table
from trmoe.model.transformer import TRMoETransformer, parameter_counts
from trmoe.plan.memory import activation_bytes, layer_activation_bytes
from trmoe.run.checkpoint import load_checkpoint
from trmoe.train.loop import train

TINY = ["model=tiny", "model.vocab_size=512"]


def _cfg(*overrides: str):
    return to_config(compose_config(*TINY, *overrides))


def test_hybrid_first_k_has_a_table_below_a_router_above_and_counts_its_one_router():
    spec = model_spec(_cfg("routing=hybrid_first_k"))
    assert spec.strategies == ("balanced_hash", "learned")
    torch.manual_seed(0)
    model = TRMoETransformer(spec)
    low, high = model.blocks[0].ffn, model.blocks[1].ffn
    assert low.router is None and high.router is not None and high.routed.route_table is None
    assert torch.equal(low.routed.route_table, build_route_table("balanced_hash", 512, 4, 2, 0, 0))
    table = parameter_counts(model_spec(_cfg("routing=balanced_hash")))
    counts = parameter_counts(spec)
    router = spec.num_experts * spec.hidden_size  # one layer's
    assert counts.total - table.total == router and counts.active - table.active == router
    row = solve_arm([*TINY, "routing=hybrid_first_k"])
    assert row["total"] == counts.total
    assert "0:balanced_hash 1:learned" in row["ffn"] and "router 4x64 in 1 layers" in row["ffn"]
    # the override form of DeepSeek-V4's first 3 layers, on a deeper model
    deep = model_spec(_cfg("routing=hybrid_first_k", "model.num_layers=5", "routing.layers.0.last=2"))
    assert deep.strategies == ("balanced_hash",) * 3 + ("learned",) * 2


def test_the_planner_sums_each_layers_activations_by_its_own_dispatch():
    """A modulo_cyclic layer groups its rows by route tuple, a learned one by expert: a 2-layer mix saves the
    sum of one layer of each."""
    mixed = "routing.layers=[{first: 0, last: 0, strategy: modulo_cyclic}]"
    cfgs = {name: _cfg(f"routing={name}") for name in ("modulo_cyclic", "learned")}
    cfgs["mixed"] = _cfg("routing=learned", mixed)
    specs = {name: model_spec(cfg) for name, cfg in cfgs.items()}
    per_layer = [layer_activation_bytes(specs["mixed"], 4, False, layer) for layer in (0, 1)]
    assert per_layer == [layer_activation_bytes(specs[n], 4) for n in ("modulo_cyclic", "learned")]
    assert per_layer[0] != per_layer[1]
    total = {name: activation_bytes(specs[name], cfgs[name], 4) for name in cfgs}
    assert total["mixed"] * 2 == total["modulo_cyclic"] + total["learned"]
    checkpointed = replace(
        cfgs["mixed"], trainer=replace(cfgs["mixed"].trainer, activation_checkpointing=True)
    )
    tokens = checkpointed.trainer.micro_batch * checkpointed.trainer.seq_len
    plain = activation_bytes(specs["mixed"], checkpointed, 4) - tokens * max(per_layer)
    assert plain == tokens * (4 * 4 * 64 + 2 * 4 * 64)  # final norm and loss + the 2 fp32 block inputs


RUN = [*RANDOM_IDS_CPU, "routing=hybrid_first_k", "trainer.micro_batch=2", "trainer.steps=6"]
RUN += ["trainer.log_every=1", "checkpoint.every_steps=2", "telemetry.moe=true", "run.name=r"]


@pytest.fixture(scope="module")
def hybrid_runs(tmp_path_factory) -> tuple[Path, Path]:
    """An uninterrupted hybrid run, and one SIGKILLed in step 5's forward then resumed from step 4."""
    root = tmp_path_factory.mktemp("hybrid")
    threads = torch.get_num_threads()
    try:
        train(compose_config(*RUN), root / "base")
        killed = drive("step:5:forward", root / "killed", *RUN)
        assert killed.returncode == -9, killed.stderr[-3000:]
        resumed = root / "killed" / "runs" / "r"
        train(compose_config(*RUN), resumed)
    finally:
        torch.set_num_threads(threads)
    assert "=== resume from step 4 " in (resumed / "train.log").read_text()
    return root / "base", resumed


@pytest.mark.subprocess
def test_a_hybrid_run_records_its_layers_trains_only_the_upper_router_and_resumes_bit_exact(hybrid_runs):
    base, resumed = hybrid_runs
    assert_same_run(resumed, base)
    record = json.loads((base / "run_config.json").read_text())
    assert record["config"]["routing"]["layers"] == [{"first": 0, "last": 0, "strategy": "balanced_hash"}]
    assert record["model_spec"]["layer_strategies"] == ["balanced_hash", "learned"]
    final = load_checkpoint(base)["model"]
    assert "blocks.0.ffn.router" not in final and "blocks.1.ffn.routed.route_table" not in final
    assert torch.equal(
        final["blocks.0.ffn.routed.route_table"], build_route_table("balanced_hash", 512, 4, 2, 0)
    )
    # telemetry per layer: every layer's route shares, imbalance and dead experts
    rows = (base / "telemetry.csv").read_text().splitlines()
    header = rows[0].split(",")
    layers = {int(r.split(",")[header.index("layer")]) for r in rows[1:]}
    assert layers == {0, 1} and {"imbalance", "dead", "share_0"} <= set(header)
