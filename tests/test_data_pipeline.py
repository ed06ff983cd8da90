"""The data pipeline as the train loop sees it: data=tokens and data=fineweb through the real config, the
four evaluation figures, the exact data cursor across resumes with another number of ranks, and bad inputs
that stop a run before anything is written."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers import cli, compose_config, edit_index, make_shard, synthetic_tokens, text_documents
from presets import DATA_FAST as FAST

from trmoe.config.resolve import to_config
from trmoe.data.build import build_data
from trmoe.data.pipeline import micro_batch_samples
from trmoe.data.prepare import prepare
from trmoe.data.shards import BIN_NAME, INDEX_NAME
from trmoe.data.tokenizer import EOS_ID, load_o200k
from trmoe.errors import UserError
from trmoe.train.loop import train
from trmoe.train.producers import columns_documented


# hardware.threads=1: these runs are tiny, and a second intra-op thread only adds wake-ups on a busy machine.
@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """A prepared o200k dataset (train/ + eval/) of 200 short documents."""
    root = tmp_path_factory.mktemp("ds")
    (root / "corpus.txt").write_text("\n\n".join(text_documents(200)))
    prepare(str(root / "corpus.txt"), root / "ds", eval_fraction=0.25, workers=0)
    return root / "ds"


@pytest.fixture(scope="module")
def parquet_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pq")
    docs = text_documents(150, seed=4)
    for f in range(2):
        pq.write_table(
            pa.table({"text": docs[f * 75 : (f + 1) * 75]}), root / f"f{f}.parquet", row_group_size=10
        )
    return root


def build(*overrides: str):
    return build_data(
        to_config(compose_config(*FAST, *overrides)), to_config(compose_config(*overrides)).model.vocab_size
    )


def test_micro_batch_samples_cover_each_step_once():
    assert micro_batch_samples(3, 0, 1, 4, 2) == [(16, 4), (20, 4)]  # the loop's former inline formula
    for world, micro, accum in [(1, 8, 1), (2, 2, 2), (4, 1, 2), (8, 1, 1)]:
        seen = [
            s
            for step in (1, 2, 3)
            for rank in range(world)
            for first, count in micro_batch_samples(step, rank, world, micro, accum)
            for s in range(first, first + count)
        ]
        assert seen == list(range(3 * 8))  # same global order for every world size at global batch 8


def test_tokens_eval_sets_and_bits_per_byte(dataset):
    data = build("data=tokens", f"data.path={dataset}", "trainer.micro_batch=4", "data.verify=true")
    enc = load_o200k()
    train_tokens = np.fromfile(dataset / "train" / BIN_NAME, dtype="<u4").astype(np.int64)
    eval_tokens = np.fromfile(dataset / "eval" / BIN_NAME, dtype="<u4").astype(np.int64)
    held_out = torch.cat([x for x, _ in data.eval_set])
    fixed_train = torch.cat([x for x, _ in data.eval_train_set])
    assert held_out.shape == fixed_train.shape == (8, 16)
    assert held_out.reshape(-1).tolist() == eval_tokens[: 8 * 16].tolist()  # the first held-out windows
    assert fixed_train.reshape(-1).tolist() == train_tokens[: 8 * 16].tolist()  # a fixed training stream
    targets = torch.cat([y for _, y in data.eval_set]).reshape(-1).tolist()
    text_bytes = len(enc.decode_bytes([t for t in targets if t != EOS_ID]))
    assert data.eval_bytes == text_bytes > 0
    assert data.bpb(2.0) == pytest.approx(2.0 * len(targets) / math.log(2) / text_bytes)
    shards = data.info["shards"]
    assert shards["train"]["sha256"] == json.loads((dataset / "train" / INDEX_NAME).read_text())["sha256"]
    assert shards["eval"]["partition"] == "eval" and shards["eval"]["path"] == str(
        (dataset / "eval").resolve()
    )
    assert set(data.info["metric_streams"]) == {"train_loss", "eval_train_loss", "eval_loss", "eval_bpb"}
    assert "held-out" in data.info["metric_streams"]["eval_loss"]
    assert "not held out" in data.info["metric_streams"]["eval_train_loss"]
    assert "logging window" in data.info["metric_streams"]["train_loss"]  # a mean over it, not one batch


def test_single_shard_holds_out_whole_tail_documents(tmp_path):
    tokens = synthetic_tokens(3000)  # EOS (0) every 37 tokens
    make_shard(tmp_path / "one", tokens)
    data = build(
        "data=tokens", f"data.path={tmp_path / 'one'}", "model.vocab_size=512", "data.eval_fraction=0.1"
    )
    cut = data.info["shards"]["split_token"]
    assert tokens[cut - 1] == 0 and 3000 - cut >= 300  # train ends at a document end; >= 10% held out
    assert (
        torch.cat([x for x, _ in data.eval_set]).reshape(-1).tolist()
        == tokens[cut : cut + 2 * 8 * 16].tolist()
    )
    assert data.eval_bytes is None and math.isnan(data.bpb(1.0))  # not o200k text: no bits per byte
    inputs, _ = data.train.batch(0, 500)
    assert int(inputs.max()) < 512 and data.train.num_windows == (cut - 1) // 16


def _read_run(data_factory, world: int, micro: int, accum: int, steps: range, state=None):
    """Simulate `world` ranks (one pipeline each, as separate processes would hold) reading `steps`; returns
    (global sample indices in order, their windows, rank 0's data state after the last step)."""
    pipelines = [data_factory() for _ in range(world)]
    if state is not None:
        for p in pipelines:
            p.load_state_dict(json.loads(json.dumps(state)))
    indices, rows = [], []
    for step in steps:
        for rank, pipeline in enumerate(pipelines):
            for first, count in micro_batch_samples(step, rank, world, micro, accum):
                x, y = pipeline.train.batch(first, count)
                indices += list(range(first, first + count))
                rows.append(torch.cat([x, y[:, -1:]], dim=1))
    state = pipelines[0].state_dict()
    for p in pipelines:
        p.close()
    return indices, torch.cat(rows), state


@pytest.mark.parametrize("source", ["tokens-shuffled", "tokens-sequential", "fineweb"])
def test_resume_with_other_rank_counts_reads_the_uninterrupted_samples(source, dataset, parquet_dir):
    if source == "fineweb":
        over = ["data=fineweb", f"data.path={parquet_dir}", "data.eval_fraction=0.2", "data.workers=0"]
    else:
        over = ["data=tokens", f"data.path={dataset}", f"data.order={source.split('-')[1]}"]
    n, batch = 6, 12  # 6 steps, then 6 more; global batch 12 samples of 16 tokens

    def factory(micro: int):
        return lambda: build(*over, f"trainer.micro_batch={micro}")

    full_idx, full_rows, _ = _read_run(factory(12), 1, 12, 1, range(1, 2 * n + 1))
    assert full_idx == list(range(2 * n * batch))
    first_idx, first_rows, state = _read_run(factory(3), 2, 3, 2, range(1, n + 1))  # 2 ranks x 3 x accum 2
    assert state["source"] == source.split("-")[0] and (state["stream"] is not None) == (source == "fineweb")
    rest_idx, rest_rows, _ = _read_run(factory(1), 3, 1, 4, range(n + 1, 2 * n + 1), state)  # 3 ranks x 1 x 4
    assert first_idx + rest_idx == full_idx  # none twice, none skipped, same order
    assert torch.equal(torch.cat([first_rows, rest_rows]), full_rows)


def test_data_state_refuses_other_data(dataset, parquet_dir):
    tokens = build("data=tokens", f"data.path={dataset}", "trainer.micro_batch=2")
    stream = build(
        "data=fineweb", f"data.path={parquet_dir}", "data.eval_fraction=0.2", "trainer.micro_batch=2"
    )
    with pytest.raises(UserError, match="resume needs the same data"):
        tokens.load_state_dict(stream.state_dict())
    # the same source: what differs is named, with both values
    with pytest.raises(
        UserError, match=r"data cursor: data.eval_fraction: the checkpoint's 0.2, this run's 0.3; "
    ):
        build("data=fineweb", f"data.path={parquet_dir}", "data.eval_fraction=0.3").load_state_dict(
            stream.state_dict()
        )
    with pytest.raises(UserError, match="unknown format"):
        tokens.load_state_dict({"version": 99})
    stream.close()


def test_fineweb_eval_split_is_held_out(parquet_dir):
    from trmoe.data.corpus import is_eval_document

    data = build(
        "data=fineweb", f"data.path={parquet_dir}", "data.eval_fraction=0.2", "trainer.micro_batch=2"
    )
    enc = load_o200k()
    docs = [
        t for f in sorted(parquet_dir.glob("*.parquet")) for t in pq.read_table(f).column("text").to_pylist()
    ]
    held = [t for d in docs if is_eval_document("", d, 0.2, 0) for t in enc.encode_ordinary(d) + [EOS_ID]]
    scored = torch.cat([x for x, _ in data.eval_set]).reshape(-1).tolist()
    assert scored == held[: len(scored)]
    fixed = torch.cat([x for x, _ in data.eval_train_set])
    assert torch.equal(fixed, data.train.batch(0, fixed.shape[0])[0])  # the fixed train stream = samples 0..
    assert data.eval_bytes > 0 and data.info["metric_streams"]["eval_loss"].startswith(
        "the first windows of the held"
    )
    data.close()


def _bad(*overrides: str) -> str:
    with pytest.raises(UserError) as err:
        build(*overrides)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_bad_token_datasets_stop_before_training(dataset, tmp_path):
    assert "not a token shard or dataset" in _bad("data=tokens", f"data.path={tmp_path}")
    assert "model.vocab_size=512" in _bad("data=tokens", f"data.path={dataset}", "model.vocab_size=512")
    assert "partition is 'eval'" in _bad("data=tokens", f"data.path={dataset / 'eval'}")
    short = _bad("data=tokens", f"data.path={dataset}", "trainer.micro_batch=4", "trainer.seq_len=128",
                 "trainer.grad_accum=4000")  # fmt: skip
    assert "fewer than one batch" in short and str(dataset / "train") in short
    lying = synthetic_tokens(3000)
    lying[1500] = 599  # one id past the vocab, far from the fixed eval windows
    make_shard(tmp_path / "lying", lying, vocab_size=600)
    edit_index(tmp_path / "lying", vocab_size=512, max_token_id=511)  # the index hides it
    over = ("data=tokens", f"data.path={tmp_path / 'lying'}", "model.vocab_size=512", "data.order=sequential")
    assert "holds token id 599 >= vocab_size 512" in _bad(*over, "data.verify=true")
    data = build(*over)  # without verify the cheap checks pass, and the batch that holds it is refused
    data.train.batch(0, 90)
    with pytest.raises(UserError, match="token id >= model.vocab_size=512 in samples 90..99"):
        data.train.batch(90, 10)
    stale = tmp_path / "stale"  # prepared with another o200k rank file
    for part in ("train", "eval"):
        (stale / part).mkdir(parents=True)
        for name in (BIN_NAME, INDEX_NAME):
            (stale / part / name).write_bytes((dataset / part / name).read_bytes())
    edit_index(stale / "eval", tokenizer_sha256="0" * 64)
    assert "tokenizer_sha256 '000" in _bad("data=tokens", f"data.path={stale}")  # eval and train disagree
    edit_index(stale / "train", tokenizer_sha256="0" * 64)
    assert "rank-file sha256 000" in _bad("data=tokens", f"data.path={stale}")


def test_train_on_synthetic_shards_writes_the_four_figures(tmp_path):
    make_shard(tmp_path / "ds" / "train", synthetic_tokens(4000, seed=1))
    make_shard(tmp_path / "ds" / "eval", synthetic_tokens(1000, seed=2), partition="eval")
    cfg = compose_config(
        *FAST,
        "data=tokens",
        f"data.path={tmp_path / 'ds'}",
        "model.vocab_size=512",
        "trainer.micro_batch=4",
        "trainer.steps=4",
        "trainer.eval_every=2",
        "trainer.log_every=1",
        "optimizer.warmup_steps=1",
    )
    train(cfg, tmp_path / "run")
    with open(tmp_path / "run" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == tuple(c.name for c in columns_documented() if "/" not in c.name)
    evals = [r for r in rows if r["eval_loss"] != "nan"]
    assert [r["step"] for r in evals] == ["0", "2", "4"]
    assert all(r["eval_train_loss"] != "nan" and r["eval_bpb"] == "nan" for r in evals)  # ids are not text
    assert all(r["eval_train_loss"] == "nan" for r in rows if r["eval_loss"] == "nan")
    record = json.loads((tmp_path / "run" / "run_config.json").read_text())["data"]
    assert (
        record["shards"]["train"]["sha256"]
        == json.loads((tmp_path / "ds" / "train" / INDEX_NAME).read_text())["sha256"]
    )
    assert record["metric_streams"]["eval_train_loss"].startswith("the first windows of token shard")


def test_train_on_prepared_text_reports_bits_per_byte(dataset, tmp_path):
    cfg = compose_config(
        *FAST,
        "data=tokens",
        f"data.path={dataset}",
        "trainer.micro_batch=2",
        "trainer.steps=2",
        "trainer.eval_batches=1",
        "trainer.log_every=1",
    )
    train(cfg, tmp_path / "run")
    with open(tmp_path / "run" / "metrics.csv") as f:
        final = list(csv.DictReader(f))[-1]
    record = json.loads((tmp_path / "run" / "run_config.json").read_text())["data"]
    expected = (
        float(final["eval_loss"]) * record["eval_tokens_scored"] / math.log(2) / record["eval_bytes_scored"]
    )
    assert float(final["eval_bpb"]) == pytest.approx(expected, rel=1e-4)
    assert 0 < float(final["eval_train_loss"]) < 13


def test_cli_bad_shard_and_bad_parquet_exit_2_and_write_nothing(dataset, tmp_path):
    broken = tmp_path / "broken"
    for part in ("train", "eval"):
        (broken / part).mkdir(parents=True)
        for name in (BIN_NAME, INDEX_NAME):
            (broken / part / name).write_bytes((dataset / part / name).read_bytes())
    data = (broken / "train" / BIN_NAME).read_bytes()
    (broken / "train" / BIN_NAME).write_bytes(data[: len(data) // 2])
    pq.write_table(pa.table({"body": ["some text"] * 10}), tmp_path / "nofield.parquet")
    cases = [
        (["data=tokens", f"data.path={broken}"], f"{broken / 'train' / BIN_NAME}: truncated"),
        (["data=fineweb", f"data.path={tmp_path / 'nofield.parquet'}"], "no column 'text' (data.text_field)"),
    ]
    for overrides, expected in cases:
        result = cli([*overrides, "run.name=bad", *FAST], cwd=tmp_path)
        assert result.returncode == 2, result.stderr
        assert expected in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert not (tmp_path / "runs").exists()
    assert (broken / "train" / BIN_NAME).read_bytes() == data[: len(data) // 2]  # inputs untouched


def test_fineweb_run_extended_from_its_checkpoint_matches_the_uninterrupted_run(parquet_dir, tmp_path):
    """End to end through the loop's checkpoints: the stream cursor is saved, loaded and continued."""
    common = [
        *FAST,
        "data=fineweb",
        f"data.path={parquet_dir}",
        "data.eval_fraction=0.2",
        "data.workers=0",
        "model.hidden_size=16",  # the o200k embedding dominates: keep checkpoints small
        "model.num_heads=2",
        "model.num_kv_heads=1",
        "model.shared_width=32",
        "model.routed_width=32",
        "trainer.micro_batch=2",
        "trainer.log_every=1",
        "trainer.eval_every=0",
        "optimizer.warmup_steps=1",
        "optimizer.schedule=constant",
    ]
    train(compose_config(*common, "trainer.steps=3"), tmp_path / "resumed")
    train(compose_config(*common, "trainer.steps=6"), tmp_path / "resumed")  # continues from step 3
    train(compose_config(*common, "trainer.steps=6"), tmp_path / "straight")

    def losses(run: str) -> dict[str, str]:
        with open(tmp_path / run / "metrics.csv") as f:
            return {r["step"]: r["train_loss"] for r in csv.DictReader(f) if r["train_loss"] != "nan"}

    assert losses("resumed") == losses("straight")
    assert sorted(losses("straight")) == ["1", "2", "3", "4", "5", "6"]
