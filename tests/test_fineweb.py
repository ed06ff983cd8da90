"""Streaming documents from local Parquet (data=fineweb): the same tokens as a prepared shard, a held-out
split by the document rule, an exact cursor across restarts and passes, and clear errors for bad files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from trmoe.data.corpus import is_eval_document
from trmoe.data.fineweb import Cursor, HubSource, ParquetSource, StreamWindows, split_stream_tokens
from trmoe.data.prepare import prepare
from trmoe.data.sampler import WindowSampler
from trmoe.data.shards import open_shard
from trmoe.data.tokenizer import EOS_ID, load_o200k
from trmoe.errors import UserError

WORDS = "stream parquet row group cursor epoch window rank shard token document eval".split()
SEQ = 16


def web_documents(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [f"Page {i}: " + " ".join(rng.choice(WORDS, size=int(rng.integers(3, 30)))) for i in range(n)]


def write_parquet_dir(directory: Path, docs: list[str | None], files: int = 3, row_group: int = 7) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    per_file = -(-len(docs) // files)
    for f in range(files):
        part = docs[f * per_file : (f + 1) * per_file]
        table = pa.table({"id": list(range(len(part))), "text": pa.array(part, type=pa.string())})
        pq.write_table(table, directory / f"part-{f:02d}.parquet", row_group_size=row_group)
    return directory


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, list[str]]:
    docs: list[str | None] = web_documents(90)
    docs[5], docs[40] = "", None  # empty rows are skipped, but keep their row numbers
    root = write_parquet_dir(tmp_path_factory.mktemp("web") / "pq", docs)
    return root, [d for d in docs if d]


def windows_of(tokens: np.ndarray, first: int, count: int) -> torch.Tensor:
    x, y = WindowSampler(tokens, SEQ, "sequential").batch(first, count)
    return torch.cat([x, y[:, -1:]], dim=1)


def stream_rows(stream: StreamWindows, first: int, count: int) -> torch.Tensor:
    x, y = stream.batch(first, count)
    return torch.cat([x, y[:, -1:]], dim=1)


def test_stream_equals_the_prepared_shard_and_holds_out_by_rule(corpus, tmp_path):
    root, docs = corpus
    prepare(str(root), tmp_path / "ds", eval_fraction=0.2, workers=0)
    train_tokens = np.asarray(open_shard(tmp_path / "ds" / "train").tokens, dtype=np.int64)
    eval_tokens = np.asarray(open_shard(tmp_path / "ds" / "eval").tokens, dtype=np.int64)
    enc = load_o200k()
    train_docs = [d for d in docs if not is_eval_document("", d, 0.2, 0)]
    assert train_tokens.tolist() == [t for d in train_docs for t in enc.encode_ordinary(d) + [EOS_ID]]
    source = ParquetSource(str(root), "text")
    windows = (train_tokens.size - 1) // SEQ
    stream = StreamWindows(source, SEQ, 0.2, 0, workers=1)  # one tokenizer process behind the reader thread
    try:
        assert torch.equal(stream_rows(stream, 0, windows), windows_of(train_tokens, 0, windows))
    finally:
        stream.close()
    held_out, n_docs = split_stream_tokens(source, True, 10**9, 0.2, 0)
    assert (
        held_out.tolist() == eval_tokens.tolist()
        and n_docs == open_shard(tmp_path / "ds" / "eval").index["documents"]
    )
    head, _ = split_stream_tokens(source, False, 100, 0.2, 0)
    assert head.tolist() == train_tokens[:100].tolist()


def test_cursor_resume_skip_and_wrap_around(corpus):
    root, _ = corpus
    source = ParquetSource(str(root), "text")
    one_pass, _ = split_stream_tokens(source, False, 10**9, 0.2, 0)
    endless = np.concatenate([one_pass, one_pass, one_pass])  # the stream starts over after its last document
    per_pass = one_pass.size / SEQ
    a = StreamWindows(source, SEQ, 0.2, 0, workers=0)
    first = int(per_pass) - 3  # batches that straddle the end of the first pass
    assert torch.equal(stream_rows(a, 0, 4), windows_of(endless, 0, 4))
    assert torch.equal(stream_rows(a, first, 6), windows_of(endless, first, 6))  # skips forward
    state = json.loads(json.dumps(a.state_dict()))  # JSON-serialisable, as checkpoints store it
    assert state["next_sample"] == first + 6 and state["cursor"]["epoch"] == 1
    assert state["cursor"]["file_name"].startswith("sha256:")  # the file by its content (it may move)
    reads = []  # where each (re)started reader begins: a loaded cursor must not re-read the stream
    watched = ParquetSource(str(root), "text")

    def recorded(start: Cursor):
        reads.append(start)
        return ParquetSource.documents(watched, start)

    watched.documents = recorded
    b = StreamWindows(watched, SEQ, 0.2, 0, workers=0)
    b.load_state_dict(state)
    assert torch.equal(stream_rows(b, first + 6, 5), stream_rows(a, first + 6, 5))
    c = state["cursor"]
    assert reads[0] == Cursor(1, c["file"], c["row_group"], c["row"], c["offset"]) and reads[0] != Cursor(1)
    assert torch.equal(stream_rows(b, first + 20, 3), windows_of(endless, first + 20, 3))
    assert torch.equal(stream_rows(b, 2, 2), windows_of(endless, 2, 2))  # backwards: restarts from the start
    a.close()
    b.close()


def test_cursor_for_other_files_is_refused(corpus, tmp_path):
    root, _ = corpus
    a = StreamWindows(ParquetSource(str(root), "text"), SEQ, 0.2, 0, workers=0)
    a.batch(0, 3)
    state = a.state_dict()
    a.close()
    other = write_parquet_dir(tmp_path / "other", web_documents(30, seed=9), files=1)
    b = StreamWindows(ParquetSource(str(other), "text"), SEQ, 0.2, 0, workers=0)
    with pytest.raises(UserError, match="source files differ"):
        b.load_state_dict(state)
    with pytest.raises(UserError, match="malformed"):
        b.load_state_dict({"cursor": {}})


def test_bad_parquet_inputs(tmp_path):
    with pytest.raises(UserError, match="no such file or directory"):
        ParquetSource(str(tmp_path / "missing"), "text")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="holds no \\*.parquet files"):
        ParquetSource(str(tmp_path / "empty"), "text")
    with pytest.raises(UserError, match="matches no files"):
        ParquetSource(str(tmp_path / "*.parquet"), "text")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "broken.parquet").write_bytes(b"PAR1 not really parquet")
    with pytest.raises(UserError) as err:
        ParquetSource(str(tmp_path / "bad"), "text")
    assert f"parquet file {tmp_path / 'bad' / 'broken.parquet'}: unreadable" in str(err.value)
    pq.write_table(pa.table({"body": ["x"], "n": [1]}), tmp_path / "field.parquet")
    with pytest.raises(UserError, match="no column 'text' \\(data.text_field\\); allowed: body, n"):
        ParquetSource(str(tmp_path / "field.parquet"), "text")
    with pytest.raises(UserError, match="column 'n' has type int64, not a string"):
        ParquetSource(str(tmp_path / "field.parquet"), "n")


def test_hub_source_without_the_datasets_package(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets":
            raise ImportError("No module named 'datasets'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(UserError, match=r"datasets` package is not installed; pip install 'trmoe\[hf\]'"):
        HubSource("HuggingFaceFW/fineweb-edu", "sample-10BT", None, "train", "text")
