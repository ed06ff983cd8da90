"""Routes on a key other than the input id (trmoe/model/context_routing.py): each strategy's defining
property, the KV cache and the Hugging Face export of those that can be sampled, bit-exact SIGKILL resume of a
bigram_hash run, and oracle_future_hash (analysis only) refused by sampling, export and downstream
evaluation with one line and exit 2."""

from __future__ import annotations

import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_same_run, cached_logits, cli, compose_config, drive, train_in_process
from presets import RESUME_BASE

from trmoe.config.resolve import to_config
from trmoe.config.spec import model_spec
from trmoe.errors import UserError
from trmoe.generate import Sampling, generate
from trmoe.model.context_routing import hash_routes, mix32_torch, units_tensor
from trmoe.model.routing import build_route_table, layer_salt, mix32
from trmoe.model.transformer import TRMoETransformer

SAMPLED = ("bigram_hash", "prev_token_hash", "position_hash")
VOCAB = 512


def _model(strategy: str, *overrides: str) -> TRMoETransformer:
    torch.manual_seed(0)
    cfg = compose_config(
        f"model.vocab_size={VOCAB}", f"routing={strategy}", "model.num_experts=8", *overrides
    )
    model = TRMoETransformer(model_spec(to_config(cfg))).eval()
    with torch.no_grad():  # non-trivial norms, gates and attention (init leaves them near uniform)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _routes(model: TRMoETransformer, ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
    """[L, K, B, S] each layer's routes of a full forward over ids [B, S]."""
    keys = model.route_keys(ids, torch.arange(ids.shape[1]), targets=targets)
    out = [b.ffn.routed.routes(k).view(-1, *ids.shape) for b, k in zip(model.blocks, keys, strict=True)]
    return torch.stack(out)


def _ids(seed: int, shape=(64, 12)) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def test_the_hash_is_mix32_and_affine_hash_of_the_key():
    """The torch hash is the numpy one bit for bit; keyed by the token id it is affine_hash's table."""
    x = np.random.default_rng(0).integers(0, 2**32, 50_000, dtype=np.uint64)
    assert np.array_equal(
        mix32_torch(torch.from_numpy(x.astype(np.int64))).numpy(), mix32(x.astype(np.uint32))
    )
    for experts, top_k in ((8, 3), (6, 2), (1, 1)):
        table = build_route_table("affine_hash", 1000, experts, top_k, 2, 5).long()
        keyed = hash_routes(torch.arange(1000), experts, top_k, layer_salt(5, 2), units_tensor(experts))
        assert torch.equal(keyed, table)
        assert all(len(set(col)) == top_k for col in keyed.T.tolist())  # K distinct experts per key


def test_bigram_routes_change_with_the_previous_token_and_nothing_else():
    model = _model("bigram_hash")
    ids = _ids(1)
    base = _routes(model, ids)
    older = ids.clone()
    older[:, 5] = (ids[:, 5] + 1 + _ids(2)[:, 5] % (VOCAB - 1)) % VOCAB  # another token two positions back
    prev = ids.clone()
    prev[:, 6] = older[:, 5]  # another previous token
    current = ids.clone()
    current[:, 7] = older[:, 5]
    a, b, c = _routes(model, older), _routes(model, prev), _routes(model, current)
    # position 7 reads (t_6, t_7) only: a token further back changes nothing, the previous one changes it
    assert torch.equal(a[..., 7], base[..., 7])
    changed = (b[..., 7] != base[..., 7]).any(dim=1).float().mean().item()  # of (layer, row)
    assert changed > 0.7, changed  # a different pair keeps all K routes with probability ~1/56 at E=8, K=2
    assert (c[..., 7] != base[..., 7]).any(dim=1).float().mean().item() > 0.7
    # the first position routes on (FIRST, t_0): the same id there routes the same in every row
    same = torch.full_like(ids, 3)
    first = _routes(model, same)[..., 0]
    assert (first == first[..., :1]).all()
    assert not torch.equal(_routes(model, same)[..., 1], first)  # (3, 3) is another pair than (FIRST, 3)


def test_prev_token_routes_read_only_the_previous_token():
    model = _model("prev_token_hash")
    ids = _ids(3)
    odd = ids.clone()
    odd[:, 1::2] = (ids[:, 1::2] + 1) % VOCAB  # another token at every odd position
    r, s = _routes(model, ids), _routes(model, odd)
    assert torch.equal(r[..., 1::2], s[..., 1::2])  # their own token changed, their previous one did not
    assert (r[..., 2::2] != s[..., 2::2]).any(dim=1).float().mean().item() > 0.7  # the previous one did
    assert torch.equal(r[..., 0], r[..., :1, 0].expand_as(r[..., 0]))  # position 0 routes on FIRST
    # and it is affine_hash's table looked up by the previous id
    table = build_route_table("affine_hash", VOCAB, 8, 2, 1, 0).long()
    assert torch.equal(r[1][..., 1:], table[:, ids[:, :-1]])


def test_position_routes_are_independent_of_content():
    model = _model("position_hash")
    r, s = _routes(model, _ids(5)), _routes(model, _ids(6))
    assert torch.equal(r, s)
    assert (r[..., :1, :] == r).all()  # every row alike
    assert len({tuple(r[0, :, 0, i].tolist()) for i in range(12)}) > 4  # positions spread over experts


def test_oracle_routes_depend_only_on_the_target():
    model = _model("oracle_future_hash")
    ids, other, targets = _ids(7), _ids(8), _ids(9)
    r = _routes(model, ids, targets)
    assert torch.equal(r, _routes(model, other, targets))  # other inputs, the same targets
    table = build_route_table("affine_hash", VOCAB, 8, 2, 0, 0).long()
    assert torch.equal(r[0], table[:, targets])
    with pytest.raises(ValueError, match="needs the targets"):
        model(ids)
    assert model(ids, targets=targets).shape == (*ids.shape, model.spec.hidden_size)


@pytest.mark.parametrize("strategy", SAMPLED)
def test_kv_cache_gives_the_full_forward_logits(strategy):
    model = _model(strategy)
    ids = _ids(10, (3, 30))
    with torch.no_grad():
        full = model.logits(model(ids))
        worst = max(
            (cached_logits(model, ids, chunks) - full).abs().max().item() for chunks in ([1] * 30, [7, 1, 22])
        )
        # a left-padded row decodes as it would alone: its first real token has no previous token
        short = ids[:1, :9]
        padded = torch.cat([torch.full((1, 5), 7), short], dim=1)
        cache = model.new_cache(1, 14, torch.tensor([5]))
        both = model.logits(model(padded, cache))
        alone = model.logits(model(short))
    print(f"{strategy}: KV cache vs full forward, fp32: max abs logit difference {worst:.2e}")
    assert worst < 1e-4
    assert (both[0, 5:] - alone[0]).abs().max() < 1e-4
    prompts = [ids[0, :9].tolist(), ids[1, :4].tolist()]
    s = Sampling(max_new_tokens=5, greedy=True)
    assert generate(model, prompts, s) == [generate(model, [p], s)[0] for p in prompts]


def _loaded(model: TRMoETransformer, root: Path):
    from trmoe.load import LoadedModel

    return LoadedModel(model, model.spec, 0, root / "r" / "checkpoints" / "step_0", {}, torch.device("cpu"))


def test_hf_export_gives_trmoe_logits_with_and_without_its_cache(tmp_path):
    pytest.importorskip("transformers")
    import json

    from transformers import AutoModelForCausalLM

    from trmoe.export import export

    ids = _ids(11, (2, 20))
    for strategy in SAMPLED:
        model = _model(strategy)
        out = export(_loaded(model, tmp_path), tmp_path / strategy)
        config = json.loads((out / "config.json").read_text())
        assert config["route_key"] != "token" and len(config["route_salts"]) == model.spec.num_layers
        hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
        with torch.no_grad():
            ours = model.logits(model(ids))
            assert (hf(ids).logits - ours).abs().max() < 1e-4, strategy
            step = hf(ids[:, :-3], use_cache=True)
            cached = hf(ids[:, -3:-1], cache=step.cache, use_cache=True)
            last = hf(ids[:, -1:], cache=cached.cache, use_cache=True).logits
            assert (torch.cat([cached.logits, last], 1) - ours[:, -3:]).abs().max() < 1e-4, strategy
        new = hf.generate(ids[:1, :8], max_new_tokens=5, do_sample=False)[0, 8:].tolist()
        assert new == generate(model, [ids[0, :8].tolist()], Sampling(5, greedy=True))[0], strategy


@pytest.fixture(scope="module")
def oracle_run(tmp_path_factory) -> Path:
    """A finished 2-step oracle_future_hash run: its training and held-out loss forwards route on targets."""
    run_dir = tmp_path_factory.mktemp("oracle") / "r"
    train_in_process(run_dir, "routing=oracle_future_hash", "trainer.steps=2", "trainer.eval_every=2")
    return run_dir


def test_oracle_trains_and_is_refused_by_sampling_export_and_downstream_eval(oracle_run, tmp_path, capsys):
    from helpers import metrics_rows

    from trmoe.eval.lm import TRMoELM
    from trmoe.export.__main__ import main as export_main
    from trmoe.sample import main as sample_main

    assert np.isfinite(float(metrics_rows(oracle_run)[-1]["eval_loss"]))
    for main, argv in (
        (sample_main, [str(oracle_run), "--prompt", "hi"]),
        (export_main, [str(oracle_run), "--out", str(tmp_path / "out")]),
    ):
        capsys.readouterr()
        assert main(argv) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and "oracle_future_hash" in lines[0] and "analysis only" in lines[0], lines
    assert not (tmp_path / "out").exists()
    with pytest.raises(UserError, match="downstream evaluation: routing.strategy=oracle_future_hash"):
        TRMoELM(run=str(oracle_run), device="cpu")
    with pytest.raises(UserError, match="downstream.tasks"):
        to_config(compose_config("routing=oracle_future_hash", "downstream.tasks=[arc_easy]"))


RESUME_BIGRAM = (
    "routing=bigram_hash",
    "trainer.steps=8",
    "checkpoint.every_steps=4",
    "trainer.log_every=1",
    "trainer.eval_every=4",
)


def test_kill_9_then_resume_of_a_bigram_run_is_bit_exact(tmp_path):
    baseline = tmp_path / "baseline"
    train_in_process(baseline, *RESUME_BIGRAM)
    proc = drive("step:6:forward", tmp_path / "killed", *RESUME_BASE, *RESUME_BIGRAM)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    run_dir = tmp_path / "killed" / "runs" / "r"
    train_in_process(run_dir, *RESUME_BIGRAM)
    assert "=== resume from step 4 " in (run_dir / "train.log").read_text()
    assert_same_run(run_dir, baseline)


def _checkpoint_payload(run_dir: Path) -> Path:
    from trmoe.run.checkpoint import read_pointer

    return run_dir / "checkpoints" / read_pointer(run_dir / "checkpoints") / "model_optim.pt"


def test_clustered_and_dispersed_tables_on_a_trained_embedding(oracle_run):
    """The embedding of a trained run (its checkpoint file): clustered_hash gives similar ids (one k-means
    cluster; nearest neighbours) the same expert more often than chance 1/E, dispersed_hash ids of one
    cluster less often (the fewest possible); both are balanced in ids exactly. (Nearest neighbours under
    dispersed_hash are at chance on an embedding trained 2 steps: the deal within a cluster is by id.)"""
    from trmoe.model.embedding_routing import clusters, load_embedding
    from trmoe.model.routing import route_counts

    source = _checkpoint_payload(oracle_run)
    experts = 4
    cluster = clusters(str(source), VOCAB, experts, 0)
    emb = load_embedding(source, VOCAB)
    unit = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    sim = unit @ unit.T
    np.fill_diagonal(sim, -2)
    neighbour = sim.argmax(1)
    same = cluster[:, None] == cluster[None, :]
    np.fill_diagonal(same, False)
    share = {}
    for strategy in ("clustered_hash", "dispersed_hash"):
        table = build_route_table(strategy, VOCAB, experts, 2, 1, 0, embedding=str(source)).long()
        counts = route_counts(table, experts)
        assert int(counts.max() - counts.min()) <= 1  # every slot balanced in ids
        primary = table[0].numpy()
        pairs = primary[:, None] == primary[None, :]
        share[strategy] = (pairs[same].mean(), (primary == primary[neighbour]).mean())
        # a new layer relabels the experts, the partition stays
        other = build_route_table(strategy, VOCAB, experts, 2, 2, 0, embedding=str(source))[0].numpy()
        assert np.array_equal(pairs, other[:, None] == other[None, :])
    print(f"P(same expert | same cluster, nearest neighbour), chance {1 / experts}: {share}")
    assert share["clustered_hash"][0] > 0.8 and share["clustered_hash"][1] > 1.5 / experts
    # dispersed: each cluster's ids dealt evenly over the experts, the fewest same-expert pairs there can be
    sizes = np.bincount(cluster, minlength=experts)
    fewest = sum(
        (
            (n // experts) * (n // experts - 1) * (experts - n % experts)
            + (n // experts + 1) * (n // experts) * (n % experts)
        )
        for n in sizes
    ) / sum(n * (n - 1) for n in sizes)
    assert share["dispersed_hash"][0] == pytest.approx(fewest) and fewest < 1 / experts


def test_embedding_source_is_recorded_and_bad_sources_are_one_line(oracle_run, tmp_path):
    import hashlib
    import json

    from helpers import cli

    source = _checkpoint_payload(oracle_run)
    run_dir = tmp_path / "clustered"
    train_in_process(run_dir, "routing=clustered_hash", f"routing.embedding={source}", "trainer.steps=1")
    record = json.loads((run_dir / "run_config.json").read_text())["route_embedding"]
    assert record["path"] == str(source.resolve()) and record["rows"] == VOCAB
    assert record["sha256"] == hashlib.sha256(source.read_bytes()).hexdigest()
    np.save(tmp_path / "flat.npy", np.zeros(VOCAB, dtype=np.float32))
    np.save(tmp_path / "short.npy", np.zeros((VOCAB - 1, 8), dtype=np.float32))
    cases = [
        ((), "dispersed_hash needs a [V, H] token embedding"),
        ((f"routing.embedding={tmp_path / 'nope.npy'}",), "no such file"),
        ((f"routing.embedding={tmp_path / 'flat.npy'}",), "2-D float array"),
        ((f"routing.embedding={tmp_path / 'short.npy'}",), f"{VOCAB - 1} rows for model.vocab_size={VOCAB}"),
    ]
    for extra, expected in cases:
        with pytest.raises(UserError, match="routing.embedding") as e:
            to_config(compose_config(*RESUME_BASE, "routing=dispersed_hash", *extra))
        assert expected in str(e.value) and "\n" not in str(e.value)
    unread = to_config(
        compose_config(*RESUME_BASE, f"routing.embedding={source}")
    )  # other strategies: ignored
    assert model_spec(unread).route_embedding is None
    result = cli([*RESUME_BASE, "routing=clustered_hash", "run.name=bad"], cwd=tmp_path)  # the real command
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "routing.embedding" in result.stderr
    assert not (tmp_path / "runs").exists()


def _bad_embeddings(d: Path) -> dict[str, str]:
    """One file per class of unreadable or unusable embedding, and what its one line must say."""
    import pickle

    nan = np.ones((VOCAB, 8), dtype=np.float32)
    nan[3, 1] = np.nan
    np.save(d / "nan.npy", nan)
    inf = np.ones((VOCAB, 8), dtype=np.float32)
    inf[5] = np.inf
    torch.save({"embed.weight": torch.from_numpy(inf)}, d / "inf.pt")
    (d / "pickled.pt").write_bytes(pickle.dumps({"embed.weight": np.ones((VOCAB, 8))}))
    (d / "garbage.safetensors").write_bytes(b"\xff" * 100)
    (d / "text.npy").write_text("0.1 0.2\n")
    np.save(d / "objects.npy", np.array([{"a": 1}] * VOCAB), allow_pickle=True)
    return {
        "nan.npy": "1 rows hold NaN or inf (the first: token id 3)",
        "inf.pt": "1 rows hold NaN or inf (the first: token id 5)",
        "pickled.pt": "holds pickled Python objects, which are never unpickled here",
        "garbage.safetensors": "not readable as a safetensors file",
        "text.npy": "no .npy header",
        "objects.npy": "holds pickled Python objects",
    }


def test_unusable_embedding_files_are_one_line_exit_2_nothing_written(tmp_path):
    """NaN or inf rows (k-means over them clusters nothing), a .pt that weights_only refuses, a damaged
    .safetensors, a text file named .npy: the real command says so in one line naming the file, with no
    reader's advice (allow_pickle, weights_only) that no trmoe option reaches, exit 2, no run directory."""
    files = tmp_path / "files"
    files.mkdir()
    for name, says in _bad_embeddings(files).items():
        args = [*RESUME_BASE, "routing=clustered_hash", f"routing.embedding={files / name}", "run.name=bad"]
        result = cli(args, cwd=tmp_path)
        assert result.returncode == 2, (name, result.stderr[-2000:])
        assert result.stderr.count("\n") == 1 and says in result.stderr, (name, result.stderr)
        assert str(files / name) in result.stderr
        assert "allow_pickle" not in result.stderr and "weights_only" not in result.stderr
        assert not (tmp_path / "runs").exists(), name


def test_plan_reports_the_table_balance_of_ids_and_occurrences(oracle_run, tmp_path):
    import json

    from helpers import cli

    counts = np.arange(VOCAB, dtype=np.int64) ** 2  # very uneven occurrences
    np.save(tmp_path / "token_counts.npy", counts)
    base = [f"model.vocab_size={VOCAB}", "--json"]

    def plan(*overrides: str) -> dict:
        done = cli([*base, *overrides], tmp_path, module="trmoe.plan")
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)["routing"]

    freq = plan(
        "routing=frequency_balanced_secondary", f"routing.frequencies={tmp_path / 'token_counts.npy'}"
    )
    table = build_route_table("frequency_balanced_secondary", VOCAB, 4, 2, 0, 0, frequencies=counts)
    ids = np.bincount(table[0].long().numpy(), minlength=4)
    assert freq["ids"]["primary_max_over_mean"] == pytest.approx(ids.max() / ids.mean())
    primary = np.bincount(table[0].long().numpy(), weights=counts, minlength=4)
    assert freq["occurrences"]["primary_max_over_mean"] == pytest.approx(primary.max() / primary.mean())
    assert freq["occurrences"]["primary_max_over_mean"] > freq["ids"]["primary_max_over_mean"]
    clustered = plan("routing=clustered_hash", f"routing.embedding={_checkpoint_payload(oracle_run)}")
    assert clustered["ids"]["primary_max_over_mean"] == pytest.approx(1.0, abs=1 / VOCAB * 4)
    oracle = plan("routing=oracle_future_hash")
    assert oracle["analysis_only"] and oracle["ids"] is None
    text = cli(
        [f"model.vocab_size={VOCAB}", "routing=oracle_future_hash"], tmp_path, module="trmoe.plan"
    ).stdout
    assert "analysis only" in text


def test_the_report_marks_an_oracle_arm_analysis_only(oracle_run):
    from trmoe.report.compare import group_arms
    from trmoe.report.runs import load_runs

    (arm,) = group_arms(load_runs([oracle_run]))
    assert arm.label.endswith(" (analysis only)")
