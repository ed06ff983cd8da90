"""Token shards: the on-disk format, memory-mapped reading, verification, and every bad shard a user can hand
over (one UserError naming the file)."""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import SYNTH, edit_index, make_shard, synthetic_tokens

from trmoe.data.sampler import WindowSampler
from trmoe.data.shards import (
    BIN_NAME,
    INDEX_NAME,
    ShardWriter,
    dtype_for_vocab,
    open_shard,
    read_index,
    verify_shard,
)
from trmoe.errors import UserError


def test_dtype_follows_the_vocab():
    assert dtype_for_vocab(512) == "<u2"
    assert dtype_for_vocab(65_536) == "<u2"  # ids 0..65535 fit uint16
    assert dtype_for_vocab(65_537) == "<u4"
    assert dtype_for_vocab(200_019) == "<u4"  # o200k


@pytest.mark.parametrize("vocab", [512, 200_019])
def test_round_trip_is_exact_and_memory_mapped(tmp_path, vocab):
    tokens = synthetic_tokens(10_000, vocab=vocab)
    index = make_shard(tmp_path / "s", tokens, vocab_size=vocab)
    raw = (tmp_path / "s" / BIN_NAME).read_bytes()
    assert index["dtype"] == dtype_for_vocab(vocab) and len(raw) == tokens.size * (2 if vocab == 512 else 4)
    assert np.array_equal(
        np.frombuffer(raw, dtype=index["dtype"]), tokens
    )  # flat little-endian ids, no header
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == [BIN_NAME, INDEX_NAME]  # no .partial left
    on_disk = json.loads((tmp_path / "s" / INDEX_NAME).read_text())
    assert on_disk == index and on_disk["format"] == "trmoe-token-shard" and on_disk["version"] == 1
    assert on_disk["num_tokens"] == 10_000 and on_disk["max_token_id"] == int(tokens.max())
    assert on_disk["documents"] == int((tokens == 0).sum())
    shard = open_shard(tmp_path / "s")
    assert isinstance(shard.tokens, np.memmap) and not shard.tokens.flags.writeable
    assert np.array_equal(shard.tokens, tokens)
    scan = verify_shard(tmp_path / "s")
    assert scan["sha256"] == index["sha256"] and scan["eos_count"] == index["documents"]
    fp = shard.fingerprint()
    assert fp["path"] == str((tmp_path / "s").resolve()) and fp["sha256"] == index["sha256"]


def test_writer_streams_chunks_and_abort_leaves_nothing(tmp_path):
    writer = ShardWriter(tmp_path / "w", partition="eval", **SYNTH)
    chunks = [synthetic_tokens(1000, seed=s) for s in range(3)]
    for chunk in chunks:
        writer.append(chunk, documents=int((chunk == 0).sum()), text_bytes=5)
    assert not (tmp_path / "w" / INDEX_NAME).exists()  # not a shard until close()
    index = writer.close()
    assert index["partition"] == "eval" and index["text_bytes"] == 15
    assert np.array_equal(open_shard(tmp_path / "w").tokens, np.concatenate(chunks))
    aborted = ShardWriter(tmp_path / "a", partition="train", **SYNTH)
    aborted.append(chunks[0])
    aborted.abort()
    assert not (tmp_path / "a").exists()
    with pytest.raises(ValueError, match="token ids"):
        ShardWriter(tmp_path / "b", partition="train", **SYNTH).append(np.array([3, 512]))


def _rss_anon() -> int:
    """Anonymous resident memory: what a copy of the shard into the process would add. (Mapped file pages,
    RssFile, are the shared page cache; on kernels with large folios a fault maps a whole folio, so RssFile
    grows in MB steps even when a few bytes are read.)"""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_opening_and_sampling_a_shard_does_not_load_it(tmp_path):
    """128 MB shard: opening it, drawing shuffled batches and verifying it leave the process's own memory
    within a few MB (a copy would add 128 MB)."""
    vocab, chunk, chunks = 100_000, 1 << 20, 32
    writer = ShardWriter(tmp_path / "big", partition="train", **{**SYNTH, "vocab_size": vocab})
    for c in range(chunks):
        writer.append((np.arange(c * chunk, (c + 1) * chunk, dtype=np.int64) * 7919) % vocab)
    writer.close()
    size = (tmp_path / "big" / BIN_NAME).stat().st_size
    assert size == chunk * chunks * 4
    gc.collect()
    before = _rss_anon()
    shard = open_shard(tmp_path / "big")
    assert isinstance(shard.tokens, np.memmap)
    sampler = WindowSampler(shard.tokens, 128, "shuffled", seed=0)
    for step in range(20):
        inputs, targets = sampler.batch(step * 8, 8)
        j = sampler.window_index(step * 8)
        assert inputs[0].tolist() == ((np.arange(j * 128, j * 128 + 128) * 7919) % vocab).tolist()
    grown = _rss_anon() - before
    assert grown < 16 * 2**20, f"RSS grew {grown / 2**20:.1f} MB for a {size / 2**20:.0f} MB shard"
    verify_shard(tmp_path / "big")  # chunked reads into one 16 MB buffer
    assert _rss_anon() - before < 24 * 2**20


# ----------------------------------------------------------------------------------------------- bad shards


@pytest.fixture
def good(tmp_path) -> Path:
    make_shard(tmp_path / "good", synthetic_tokens(2000))
    return tmp_path / "good"


def _error(directory: Path, verify: bool = False) -> str:
    with pytest.raises(UserError) as err:
        open_shard(directory, verify=verify)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_missing_directory_index_and_bin(tmp_path, good):
    assert "no such directory" in _error(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    assert f"{tmp_path / 'empty' / INDEX_NAME}: missing" in _error(tmp_path / "empty")
    (good / BIN_NAME).unlink()
    assert f"{good / BIN_NAME}: missing" in _error(good)


def test_truncated_bin(good):
    data = (good / BIN_NAME).read_bytes()
    (good / BIN_NAME).write_bytes(data[:-6])
    message = _error(good)
    assert str(good / BIN_NAME) in message and "truncated" in message and "num_tokens x itemsize" in message


def test_dtype_that_does_not_match_the_file(good):
    edit_index(good, dtype="<u4")  # written as uint16: the file is half the size a uint32 shard would be
    assert "dtype <u4" in _error(good) and "truncated" in _error(good)
    edit_index(good, dtype="<i8")
    assert "dtype is '<i8'" in _error(good)
    edit_index(good, dtype="<u2", vocab_size=200_019)
    assert "cannot hold ids of vocab_size 200019" in _error(good)


@pytest.mark.parametrize(
    "content,expected",
    [
        ("{not json", "malformed JSON"),
        ("[1, 2]", "top level must be a JSON object"),
        ('{"format": "other-shard"}', "format is 'other-shard'; allowed: 'trmoe-token-shard', 'complexity"),
        ('{"format": "complexity-token-shard-v1"}', "token-shard-v1 index: field 'bin' is missing"),
        ('{"format": "trmoe-token-shard", "version": 2}', "version is 2; this trmoe reads version 1"),
        ('{"format": "trmoe-token-shard", "version": 1}', "field 'bin' is missing"),
    ],
)
def test_malformed_or_wrong_version_index(good, content, expected):
    (good / INDEX_NAME).write_text(content)
    message = _error(good)
    assert str(good / INDEX_NAME) in message and expected in message


def test_index_field_checks(good):
    edit_index(good, num_tokens="2000")
    assert "'num_tokens' has the wrong type" in _error(good)
    edit_index(good, num_tokens=2000, partition="test")
    assert "partition is 'test'" in _error(good)
    edit_index(good, partition="train", bin="../tokens.bin")
    assert "bin must be a file name" in _error(good)
    edit_index(good, bin=BIN_NAME, max_token_id=512)
    assert "max_token_id 512 is outside the vocab [0, 512)" in _error(good)


def test_verify_catches_corruption_and_lying_indexes(good):
    open_shard(good, verify=True)
    data = bytearray((good / BIN_NAME).read_bytes())
    data[10] ^= 1
    (good / BIN_NAME).write_bytes(bytes(data))
    # the default identity (data.verify=false) catches an edit in place to the same size: a small shard is
    # hashed whole at open (old code: the cheap checks passed)
    assert "does not match the index's" in _error(good) and "edited in place" in _error(good)
    assert "does not match the index" in _error(good, verify=True)
    tokens = synthetic_tokens(2000)
    tokens[5] = 511
    make_shard(good, tokens)
    edit_index(good, max_token_id=400)  # the index under-reports the ids
    assert "max token id is 511, the index says 400" in _error(good, verify=True)
    make_shard(good, tokens)
    edit_index(good, documents=3)
    assert "EOS tokens but the index counts 3 documents" in _error(good, verify=True)
    assert read_index(good)["documents"] == 3


def _legacy_shard(directory: Path, tokens: np.ndarray, **extra) -> None:
    """A shard as the previous runner wrote it: the same tokens.bin, its own index (format v1; fields as
    ../shared/reference/anchor-complexity-framework.md section 4.5.1 lists them)."""
    import hashlib

    directory.mkdir(parents=True)
    data = tokens.astype("<u4").tobytes()
    (directory / BIN_NAME).write_bytes(data)
    index = {
        "format": "complexity-token-shard-v1",
        "bin": BIN_NAME,
        "dtype": "<u4",
        "num_tokens": int(tokens.size),
        "max_token_id": int(tokens.max()),
        "vocab_size": 200_019,
        "tokenizer": "o200k_base",
        "sha256": hashlib.sha256(data).hexdigest(),
        **extra,
    }
    (directory / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True))


def test_the_previous_runners_shards_are_read_and_train(tmp_path):
    """A dataset of the runner trmoe replaces (train/ and eval/, format complexity-token-shard-v1) trains
    as it is: no re-tokenization, its split kept. Its tokenizer hash (over a tokenizer directory) is not
    the rank-file hash trmoe checks, so it is kept in the fingerprint's source, not compared."""
    from helpers import compose_config

    from trmoe.train.loop import train

    eos = 199_999  # o200k's <|endoftext|>
    rule = {"eos_token_id": eos, "tokenizer_sha256": "ab" * 32, "eval_document_rule": "index % 200 == 0"}
    for partition, seed in (("train", 1), ("eval", 2)):
        tokens = synthetic_tokens(4_000, vocab=200_019, seed=seed)
        tokens[tokens == 0] = eos
        documents = int((tokens == eos).sum())
        _legacy_shard(tmp_path / "old" / partition, tokens, partition=partition, documents=documents, **rule)
    train_index = read_index(tmp_path / "old" / "train")
    assert train_index["eos_id"] == eos and train_index["partition"] == "train"
    assert train_index["converted_from"] == "complexity-token-shard-v1" and train_index["text_bytes"] == 0
    verify_shard(tmp_path / "old" / "eval")  # sha256, max id and the EOS count = documents
    overrides = ["data=tokens", f"data.path={tmp_path / 'old'}", "data.verify=true", "trainer.steps=2"]
    overrides += ["trainer.micro_batch=2", "trainer.seq_len=32", "trainer.eval_batches=1", "hardware=cpu"]
    train(compose_config(*overrides, "run.progress=log"), tmp_path / "run")
    record = json.loads((tmp_path / "run" / "run_config.json").read_text())
    shards = record["data"]["shards"]
    assert shards["train"]["sha256"] == train_index["sha256"] and shards["eval"]["partition"] == "eval"
    assert shards["train"]["source"]["tokenizer_dir_sha256"] == "ab" * 32
    # a bad legacy index names the field
    _legacy_shard(tmp_path / "bad", synthetic_tokens(100, vocab=200_019), num_tokens="100")
    with pytest.raises(UserError, match="complexity-token-shard-v1 index: field 'num_tokens'"):
        read_index(tmp_path / "bad")


def test_a_large_shard_is_identified_by_sampled_blocks(tmp_path):
    """Above SAMPLE_WHOLE the identity is SAMPLE_BLOCKS sampled blocks (docs/data.md): an in-place edit inside
    one changes the recorded identity (a resume then refuses); one between them is data.verify=true's."""
    from trmoe.data.shards import SAMPLE_BLOCK, SAMPLE_BLOCKS, SAMPLE_WHOLE

    n = SAMPLE_WHOLE // 2 + 1_000_000  # uint16 ids: just above SAMPLE_WHOLE bytes
    make_shard(tmp_path / "big", synthetic_tokens(n))
    path = tmp_path / "big" / BIN_NAME
    size = path.stat().st_size
    assert size > SAMPLE_WHOLE
    first = open_shard(tmp_path / "big").fingerprint()["sample_sha256"]
    gap = (size - SAMPLE_BLOCK) // (SAMPLE_BLOCKS - 1)
    with open(path, "r+b") as f:  # inside block 1 (offset gap), same size
        f.seek(gap + 10)
        byte = f.read(1)
        f.seek(gap + 10)
        f.write(bytes([byte[0] ^ 1]))
    assert open_shard(tmp_path / "big").fingerprint()["sample_sha256"] != first
    with open(path, "r+b") as f:  # restore it, then change a byte between blocks 0 and 1
        f.seek(gap + 10)
        f.write(byte)
        f.seek(SAMPLE_BLOCK + 10)
        f.write(b"\x07")
    assert open_shard(tmp_path / "big").fingerprint()["sample_sha256"] == first  # not caught by the default
    assert "does not match the index" in _error(tmp_path / "big", verify=True)
