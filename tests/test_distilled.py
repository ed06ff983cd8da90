"""routing=distilled (Grouter 2026; docs/routing.md, "Distilled fixed router"): a route table counted from a
trained router's choices. The table against the rule computed independently on a fabricated parent (ties,
never-seen ids), a real learned_v3 parent and its distilled child (the record, the table in every checkpoint,
no router), bit-exact SIGKILL resume, sampling with the KV cache, export to transformers, parameter counts and
matching as every table arm, and bad input (one line, exit 2, nothing written)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_same_run, cached_logits, cli, compose_config, killed_and_resumed, metrics_rows
from presets import RANDOM_IDS_CPU

from trmoe.config.param_match import solve_match
from trmoe.config.resolve import to_config
from trmoe.config.spec import model_spec
from trmoe.model.distill import count_routes, distilled_table
from trmoe.model.routing import build_route_table
from trmoe.model.transformer import TRMoETransformer, parameter_counts
from trmoe.run.checkpoint import load_checkpoint

V, E, K = 512, 4, 2
RUN = [*RANDOM_IDS_CPU, "trainer.micro_batch=2", "trainer.steps=8", "trainer.log_every=1"]
RUN += ["checkpoint.every_steps=4", "run.name=r"]
TOKENS = 1000  # the child's pass: ceil(1000 / 32) = 32 windows of 32 tokens


def _child(parent: Path) -> list[str]:
    return [*RUN, "routing=distilled", f"routing.distill_from={parent}", f"routing.distill_tokens={TOKENS}"]


def _expected(counts: np.ndarray, layer: int, seed: int = 0) -> np.ndarray:
    """The rule per token: the K experts of largest count (ties: the lower id); unseen: balanced_hash."""
    fallback = build_route_table("balanced_hash", counts.shape[0], counts.shape[1], K, layer, seed).numpy()
    out = np.empty((K, counts.shape[0]), dtype=np.int64)
    for t, row in enumerate(counts):
        if row.sum() == 0:
            out[:, t] = fallback[:, t]
        else:
            out[:, t] = sorted(range(len(row)), key=lambda e: (-row[e], e))[:K]
    return out


# ------------------------------------------------------------------------------------------ the table


def test_ties_go_to_the_lower_expert_and_unseen_ids_to_balanced_hash():
    counts = np.zeros((6, E), dtype=np.int64)
    counts[0] = [0, 3, 3, 1]  # a tie for the first place: 1 before 2
    counts[1] = [2, 0, 5, 2]  # a tie for the second: 0 before 3
    counts[2] = [1, 1, 1, 1]  # all tied
    counts[4] = [0, 0, 4, 1]
    table = distilled_table(counts, K, layer=1, seed=3)
    fallback = build_route_table("balanced_hash", 6, E, K, 1, 3)
    assert table.dtype == torch.uint8 and table.shape == (K, 6)
    assert (
        table[:, 0].tolist() == [1, 2] and table[:, 1].tolist() == [2, 0] and table[:, 2].tolist() == [0, 1]
    )
    assert table[:, 4].tolist() == [2, 3]
    assert torch.equal(table[:, [3, 5]], fallback[:, [3, 5]])  # never seen


def test_the_table_is_the_argmax_of_counts_taken_independently_on_a_fabricated_parent():
    """A random learned parent (softmax router, so its top-K are those of x W_r^T); its FFN inputs captured by
    hooks give the routes a second way; ids 400.. never occur, so they take the fallback."""
    spec = model_spec(to_config(compose_config("model=tiny", f"model.vocab_size={V}", "routing=learned")))
    torch.manual_seed(0)
    parent = TRMoETransformer(spec).eval()
    with torch.no_grad():
        for block in parent.blocks:
            block.ffn.router.normal_(0.0, 1.0)  # decisive routes, not near-ties of a 0.02 init
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 400, (3, 16), generator=gen) for _ in range(5)]
    seen = {layer: np.zeros((V, E), dtype=np.int64) for layer in range(spec.num_layers)}
    inputs: dict[int, torch.Tensor] = {}
    hooks = [
        block.ffn.register_forward_pre_hook(lambda m, args, i=i: inputs.__setitem__(i, args[0]))
        for i, block in enumerate(parent.blocks)
    ]
    with torch.no_grad():
        for ids in batches:
            parent(ids)
            for layer, x in inputs.items():
                top = (x.reshape(-1, x.shape[-1]) @ parent.blocks[layer].ffn.router.T).topk(K).indices
                np.add.at(seen[layer], (ids.reshape(-1, 1).numpy(), top.numpy()), 1)
    for hook in hooks:
        hook.remove()
    counts = count_routes(parent, batches, range(spec.num_layers))
    for layer in range(spec.num_layers):
        assert np.array_equal(counts[layer].numpy(), seen[layer])
        assert seen[layer][400:].sum() == 0 and seen[layer][:400].sum() == 5 * 3 * 16 * K
        table = distilled_table(counts[layer], K, layer, seed=0)
        assert np.array_equal(table.numpy(), _expected(seen[layer], layer))


# ------------------------------------------------------------------------------- a parent and its child


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A learned_v3 parent (8 steps), a hash run (2 steps), and the parent's distilled child: uninterrupted,
    and SIGKILLed in step 6's forward then resumed from its step-4 checkpoint."""
    from trmoe.train.loop import train

    root = tmp_path_factory.mktemp("distilled")
    threads = torch.get_num_threads()
    try:
        train(compose_config(*RUN, "routing=learned_v3", "routing.bias_update=0.01"), root / "parent")
        train(compose_config(*RUN, "trainer.steps=2", "routing=balanced_hash"), root / "hash")
    finally:
        torch.set_num_threads(threads)
    out = killed_and_resumed(root, {"child": _child(root / "parent")})
    return {"parent": root / "parent", "hash": root / "hash", **out}


def _pass_tables(parent: Path) -> dict[int, torch.Tensor]:
    """The child's tables recomputed here: the parent's routes over the first windows of the child's training
    order, counted and turned into tables."""
    from trmoe.data.build import build_data
    from trmoe.load import load_model

    cfg = to_config(compose_config(*_child(parent)))
    data = build_data(cfg, cfg.model.vocab_size)
    windows = -(-TOKENS // cfg.trainer.seq_len)
    batches = [data.train.batch(first, 1)[0] for first in range(windows)]
    model = load_model(parent, device="cpu", dtype="fp32").model
    counts = count_routes(model, batches, range(model.spec.num_layers))
    return {layer: distilled_table(c, K, layer, seed=0) for layer, c in counts.items()}


@pytest.mark.subprocess
def test_the_child_trains_with_its_parents_table_fixed_and_records_the_parent(runs):
    child, parent = runs["child"], runs["parent"]
    record = json.loads((child / "run_config.json").read_text())["distilled"]
    meta = json.loads((parent / "checkpoints" / "step_00000008" / "meta.json").read_text())
    files_hash = hashlib.sha256(json.dumps(meta["files"], sort_keys=True).encode()).hexdigest()
    assert record["from"] == str(parent) and (child / record["run"]).resolve() == parent.resolve()
    assert (record["checkpoint"], record["step"], record["content_hash"]) == ("step_00000008", 8, files_hash)
    assert record["tokens"] == 32 * 32 and record["layers"] == [0, 1]
    assert "lower expert id" in record["order"] and "balanced_hash" in record["unseen"]
    expected = _pass_tables(parent)
    spec = model_spec(to_config(compose_config(*_child(parent))))
    for step in (4, 8):  # fixed: the same table in every checkpoint
        state = load_checkpoint(child / "checkpoints" / f"step_{step:08d}")["model"]
        assert not [k for k in state if "router" in k or "route_bias" in k]  # no router, no bias
        for layer, table in expected.items():
            assert torch.equal(state[f"blocks.{layer}.ffn.routed.route_table"], table), (step, layer)
            fallback = build_route_table("balanced_hash", V, spec.num_experts, K, layer, 0)
            assert not torch.equal(table, fallback)  # the parent's choices, not the placeholder
    losses = [float(r["train_loss"]) for r in metrics_rows(child) if int(r["step"]) > 0]
    assert len(losses) == 8 and all(np.isfinite(losses))
    assert "tables of layers [0, 1] distilled from" in (child / "train.log").read_text()


@pytest.mark.subprocess
def test_sigkill_resume_is_bit_exact(runs):
    """The killed attempt counted its tables at its start; the resumed one takes them from its checkpoint."""
    assert_same_run(runs["child/resumed"], runs["child"])
    assert "distilled from" not in (runs["child/resumed"] / "train.log").read_text().split("=== resume")[-1]
    resumed, base = (
        json.loads((runs[r] / "run_config.json").read_text())["distilled"] for r in ("child/resumed", "child")
    )
    keys = ("from", "step", "content_hash", "tokens")
    assert [resumed[k] for k in keys] == [base[k] for k in keys]  # the first attempt's record, kept


@pytest.mark.subprocess
def test_sampling_with_the_kv_cache_equals_the_full_forward(runs):
    from trmoe.load import load_model

    model = load_model(runs["child"], device="cpu", dtype="fp32").model
    ids = torch.randint(0, V, (2, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model.logits(model(ids))
        for chunks in ([1] * 30, [7, 1, 22]):
            assert (cached_logits(model, ids, chunks) - full).abs().max() < 1e-4


@pytest.mark.subprocess
def test_export_to_transformers_gives_equal_logits(runs, tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from trmoe.export import export
    from trmoe.load import load_model

    loaded = load_model(runs["child"], device="cpu", dtype="fp32")
    out = export(loaded, tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    ids = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        diff = (loaded.model.logits(loaded.model(ids)) - hf(ids).logits).abs().max().item()
    assert diff <= 1e-4


def test_parameters_are_counted_and_matched_as_every_table_arm():
    """No router: the counts and the matched width of a table arm (the smoke grid's distilled and modulo arms
    solve the same width on the same target)."""
    ours = model_spec(to_config(compose_config("model=tiny", "routing=distilled", "routing.distill_from=.")))
    table = model_spec(to_config(compose_config("model=tiny", "routing=balanced_hash")))
    assert parameter_counts(ours) == parameter_counts(table)
    grid = "experiment=controls_2026_smoke"
    distilled = solve_match(to_config(compose_config(grid, "arm=controls_2026/distilled")))
    modulo = solve_match(to_config(compose_config(grid, "arm=controls_2026/modulo_cyclic")))
    assert distilled.exact and (distilled.width, distilled.total) == (modulo.width, modulo.total)


# ----------------------------------------------------------------------------------------- bad input


@pytest.mark.subprocess
@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["routing=distilled", "routing.distill_from={hash}"], "no learned router"),
        (["routing=distilled", "routing.distill_from={missing}"], "no such file or directory"),
        (["routing=distilled", "routing.distill_from={parent}", "model.num_experts=8"], "num_experts 4"),
        (
            ["routing=distilled", "routing.distill_from={parent}", "routing.distill_tokens=0"],
            "distill_tokens=0",
        ),
        (
            ["routing=balanced_hash", "routing.distill_from={parent}"],
            "only read by routing.strategy=distilled",
        ),
        (["routing=distilled"], "routing.distill_from=None"),
        (["routing=distilled", "routing.distill_from=arm:learned_v3"], "no sweep job"),
    ],
)
def test_bad_input_is_one_line_exit_2_nothing_written(runs, tmp_path, args, needle):
    paths = {"hash": runs["hash"], "missing": tmp_path.parent / "nowhere", "parent": runs["parent"]}
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    out = cli([*[a.format(**paths) for a in args], *RUN[:-1], "trainer.steps=1"], cwd)
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], out.stderr
    assert list(cwd.iterdir()) == []
