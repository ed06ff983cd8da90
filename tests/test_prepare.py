"""The prepare tool: text / JSONL / Parquet -> a train/eval shard pair with the real o200k tokenizer, split by
the stable document rule, byte-identical on re-runs, and nothing written on bad input."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import cli

from trmoe.data.corpus import is_eval_document
from trmoe.data.prepare import prepare
from trmoe.data.shards import BIN_NAME, INDEX_NAME, open_shard
from trmoe.data.tokenizer import EOS_ID, load_o200k, tokenizer_fingerprint
from trmoe.errors import UserError

WORDS = "routing expert token shard window gradient cosine layer hash bucket prime table vocab".split()


def documents(n: int, seed: int = 0) -> list[str]:
    """n distinct multi-line documents with non-ASCII text."""
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(n):
        body = " ".join(rng.choice(WORDS, size=int(rng.integers(5, 40))))
        docs.append(f"Document {i} — naïve café {i * 7}:\n{body}.\nLine two of {i}.")
    return docs


def expected_ids(texts: list[str]) -> list[int]:
    enc = load_o200k()
    out: list[int] = []
    for text in texts:
        out += enc.encode_ordinary(text) + [EOS_ID]
    return out


def decode_documents(tokens: np.ndarray) -> list[str]:
    enc = load_o200k()
    ends = np.flatnonzero(np.asarray(tokens) == EOS_ID)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [enc.decode(tokens[s:e].tolist()) for s, e in zip(starts, ends, strict=True)]


def run_prepare(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return cli(args, cwd, module="trmoe.data.prepare")


def test_round_trip_split_rule_and_disjointness(tmp_path):
    docs = documents(120)
    (tmp_path / "corpus.txt").write_text("\ufeff" + "\n\n \n".join(docs) + "\n")
    summary = prepare(str(tmp_path / "corpus.txt"), tmp_path / "out", eval_fraction=0.2, split_seed=3)
    train, held_out = open_shard(tmp_path / "out" / "train"), open_shard(tmp_path / "out" / "eval")
    want_eval = [d for d in docs if is_eval_document("", d, 0.2, 3)]
    want_train = [d for d in docs if not is_eval_document("", d, 0.2, 3)]
    assert 0 < len(want_eval) < len(docs)
    # prepare -> load -> exactly the tokens of each split's documents, in input order, EOS after each
    assert train.tokens.tolist() == expected_ids(want_train)
    assert held_out.tokens.tolist() == expected_ids(want_eval)
    assert decode_documents(train.tokens) == want_train and decode_documents(held_out.tokens) == want_eval
    assert not set(decode_documents(train.tokens)) & set(decode_documents(held_out.tokens))
    for shard, part, texts in ((train, "train", want_train), (held_out, "eval", want_eval)):
        index = shard.index
        assert index["partition"] == part and index["documents"] == len(texts)
        assert index["text_bytes"] == sum(len(t.encode()) for t in texts)
        assert index["dtype"] == "<u4" and index["vocab_size"] == 200_019 and index["eos_id"] == EOS_ID
        assert index["tokenizer"] == "o200k_base" and index["tokenizer_sha256"] == tokenizer_fingerprint()
        assert index["source"]["inputs"][0]["path"] == "corpus.txt"
        assert summary["partitions"][part]["sha256"] == index["sha256"]
    assert json.loads((tmp_path / "out" / "dataset.json").read_text())["partitions"]["eval"][
        "documents"
    ] == len(want_eval)


def test_reruns_are_byte_identical_whatever_the_workers(tmp_path):
    docs = documents(300, seed=1)
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("\n\n".join(docs[:100]))
    (src / "b.jsonl").write_text(
        "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs[100:200]))
    )
    pq.write_table(pa.table({"text": docs[200:]}), src / "c.parquet", row_group_size=30)
    (src / "notes.md").write_text("not an input")
    prepare(str(src), tmp_path / "inline", eval_fraction=0.1, workers=0)
    prepare(str(src), tmp_path / "pool", eval_fraction=0.1, workers=2)
    prepare(str(src), tmp_path / "again", eval_fraction=0.1, workers=0)
    for part in ("train", "eval"):
        for name in (BIN_NAME, INDEX_NAME):
            a = (tmp_path / "inline" / part / name).read_bytes()
            assert (
                a
                == (tmp_path / "pool" / part / name).read_bytes()
                == (tmp_path / "again" / part / name).read_bytes()
            )
    assert (tmp_path / "inline" / "dataset.json").read_bytes() == (
        tmp_path / "pool" / "dataset.json"
    ).read_bytes()
    both = decode_documents(open_shard(tmp_path / "inline" / "train").tokens)
    both += decode_documents(open_shard(tmp_path / "inline" / "eval").tokens)
    assert sorted(both) == sorted(docs)  # every document of the three formats, nothing else
    inputs = json.loads((tmp_path / "inline" / "train" / INDEX_NAME).read_text())["source"]["inputs"]
    assert [i["path"] for i in inputs] == ["a.txt", "b.jsonl", "c.parquet"]


def test_glob_input_and_separator(tmp_path):
    (tmp_path / "x1.txt").write_text("alpha one@@beta two@@ @@gamma three")
    (tmp_path / "x2.txt").write_text("delta four@@epsilon five")
    prepare(str(tmp_path / "x*.txt"), tmp_path / "out", separator="@@", eval_fraction=0.5, split_seed=0)
    docs = decode_documents(open_shard(tmp_path / "out" / "train").tokens)
    docs += decode_documents(open_shard(tmp_path / "out" / "eval").tokens)
    assert sorted(docs) == sorted(["alpha one", "beta two", "gamma three", "delta four", "epsilon five"])


def _no_output(out: Path) -> None:
    assert not out.exists(), sorted(str(p) for p in out.rglob("*"))


@pytest.mark.parametrize(
    "name,content,expected",
    [
        ("empty.txt", b"", "contains no documents"),
        ("blank.txt", b"  \n\n\t\n", "contains no documents"),
        (
            "latin1.txt",
            b"good first document\n\ncaf\xe9 au lait",
            "not valid UTF-8 (byte 0xe9 at byte offset 24",
        ),
        ("bad.jsonl", b'{"text": "fine"}\n{"text": broken\n', "line 2 is not valid JSON"),
        ("field.jsonl", b'{"body": "no text field"}\n', "line 1 has no field 'text'"),
        (
            "half.jsonl",
            b'{"text": "ok"}\n{"text": "caf\\u00e9 \\ud800"}\n',
            "line 2: field 'text' holds an unpaired",
        ),
        ("bad.parquet", b"PAR1 this is not parquet", "unreadable"),
    ],
)
def test_bad_inputs_name_the_file_and_write_nothing(tmp_path, name, content, expected):
    good = tmp_path / "in" / "a_good.txt"
    good.parent.mkdir()
    good.write_text("\n\n".join(documents(20)))
    bad = tmp_path / "in" / name
    bad.write_bytes(content)
    before = {p: p.read_bytes() for p in (good, bad)}
    with pytest.raises(UserError) as err:
        prepare(str(tmp_path / "in"), tmp_path / "out", workers=0)
    assert str(bad) in str(err.value) and expected in str(err.value)
    _no_output(tmp_path / "out")
    assert {p: p.read_bytes() for p in (good, bad)} == before  # inputs untouched


def test_parquet_without_the_text_field(tmp_path):
    pq.write_table(pa.table({"content": documents(20)}), tmp_path / "d.parquet")
    with pytest.raises(UserError, match=r"d\.parquet: no column 'text' \(--text-field\); allowed: content"):
        prepare(str(tmp_path / "d.parquet"), tmp_path / "out")
    _no_output(tmp_path / "out")
    prepare(str(tmp_path / "d.parquet"), tmp_path / "out", text_field="content", eval_fraction=0.3)
    assert (
        open_shard(tmp_path / "out" / "train").index["documents"]
        + open_shard(tmp_path / "out" / "eval").index["documents"]
        == 20
    )


def test_one_split_empty_and_existing_output(tmp_path):
    (tmp_path / "one.txt").write_text("just one document")
    with pytest.raises(UserError, match="none of the 1 documents into"):
        prepare(str(tmp_path / "one.txt"), tmp_path / "out")
    _no_output(tmp_path / "out")
    (tmp_path / "two.txt").write_text("\n\n".join(documents(40)))
    prepare(str(tmp_path / "two.txt"), tmp_path / "out", eval_fraction=0.3)
    before = (tmp_path / "out" / "train" / BIN_NAME).read_bytes()
    with pytest.raises(UserError, match="already holds a prepared dataset"):
        prepare(str(tmp_path / "two.txt"), tmp_path / "out", eval_fraction=0.5)
    assert (tmp_path / "out" / "train" / BIN_NAME).read_bytes() == before


def test_cli_prepare_verify_and_errors(tmp_path):
    (tmp_path / "c.txt").write_text("\n\n".join(documents(50)))
    ok = run_prepare(
        ["c.txt", "--out", "ds", "--eval-fraction", "0.2", "--workers", "0", "--progress", "log"], tmp_path
    )
    assert ok.returncode == 0, ok.stderr
    assert "train" in ok.stdout and "data.path=" in ok.stdout
    verified = run_prepare(["verify", "ds"], tmp_path)
    assert verified.returncode == 0, verified.stderr
    assert verified.stdout.count("ok ") == 2
    data = bytearray((tmp_path / "ds" / "eval" / BIN_NAME).read_bytes())
    data[-1] ^= 0xFF
    (tmp_path / "ds" / "eval" / BIN_NAME).write_bytes(bytes(data))
    corrupt = run_prepare(["verify", "ds"], tmp_path)
    assert corrupt.returncode == 2 and "does not match the index" in corrupt.stderr
    assert len(corrupt.stderr.strip().splitlines()) == 1
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe not utf-8")
    bad = run_prepare(["bad.txt", "--out", "bad_out"], tmp_path)
    assert bad.returncode == 2 and str(tmp_path / "bad.txt") in bad.stderr and "UTF-8" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    _no_output(tmp_path / "bad_out")
    assert sorted(os.listdir(tmp_path)) == ["bad.txt", "c.txt", "ds"]


def test_cli_out_that_is_a_file_is_one_line_and_writes_nothing(tmp_path):
    (tmp_path / "good.txt").write_text("\n\n".join(documents(20)))
    (tmp_path / "afile").write_text("keep me\n")
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "train").write_text("a file where a partition goes\n")
    cases = [
        ("afile", f"--out {tmp_path / 'afile'}: it is a file, not a directory"),
        ("afile/sub", f"--out {tmp_path / 'afile' / 'sub'}: {tmp_path / 'afile'} is a file, not a directory"),
        ("ds", f"--out {tmp_path / 'ds'}: {tmp_path / 'ds' / 'train'} is a file, not a directory"),
    ]
    for out, expected in cases:
        result = run_prepare(["good.txt", "--out", out, "--workers", "0", "--eval-fraction", "0.3"], tmp_path)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and expected in result.stderr, result.stderr
    assert (tmp_path / "afile").read_text() == "keep me\n"
    assert os.listdir(tmp_path / "ds") == ["train"]
    assert (tmp_path / "ds" / "train").read_text() == "a file where a partition goes\n"
    assert sorted(os.listdir(tmp_path)) == ["afile", "ds", "good.txt"]
    with pytest.raises(UserError, match="none of the 20 documents into eval"):  # fails after mkdir
        prepare(str(tmp_path / "good.txt"), tmp_path / "new" / "deeper" / "out", eval_fraction=0.001)
    _no_output(tmp_path / "new")  # ... and leaves none of the parents it made behind


def _fill(mount: Path, leave: int) -> None:
    """Take all but `leave` bytes of the filesystem at `mount` with one file."""
    st = os.statvfs(mount)
    (mount / "filler").write_bytes(b"\0" * max(st.f_bavail * st.f_frsize - leave, 0))


@pytest.mark.parametrize(
    ("leave", "docs"),
    [
        (64 << 10, 3000),  # the disk fills while the shards are written
        (1 << 20, 40),  # the shards fit; token_counts.npy (8 bytes per o200k id: 1.6 MB) does not
    ],
)
def test_a_full_disk_is_one_line_and_leaves_no_partial_output(tmp_path, tmpfs, leave, docs):
    """A real 6 MiB filesystem, filled to `leave` bytes: the real command says the disk is full in one
    line (exit 3, a storage failure as a run's), and the dataset directory and the parents it made are gone,
    whichever write hit the limit."""
    (tmp_path / "c.txt").write_text("\n\n".join(documents(docs)))
    _fill(tmpfs, leave)
    out = tmpfs / "new" / "ds"
    result = run_prepare(["c.txt", "--out", str(out), "--eval-fraction", "0.3"], tmp_path)
    assert result.returncode == 3, result.stderr[-3000:]
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"--out {out}: cannot write the dataset: No space left on device" in result.stderr
    assert os.listdir(tmpfs) == ["filler"]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["c.txt", "--bogus", "--out", "ds"], "data.prepare: unrecognized arguments: --bogus"),
        (["c.txt"], "data.prepare: the following arguments are required: --out"),
        (["verify"], "data.prepare verify: the following arguments are required: paths"),
    ],
)
def test_usage_errors_are_one_line(tmp_path, monkeypatch, capsys, argv, needle):
    """argparse's own errors (an unknown option, a missing --out or path) as one line, not its usage block."""
    from trmoe.data.prepare import main

    (tmp_path / "c.txt").write_text("one document\n")
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith(f"trmoe: {needle}; allowed: see python -m trmoe.")
    assert len(captured.err.splitlines()) == 1, captured.err
    assert os.listdir(tmp_path) == ["c.txt"]


def test_token_counts_of_the_training_split_feed_the_frequency_strategy(tmp_path):
    """prepare writes token_counts.npy: the exact counts of the training split's tokens (EOS included, the
    held-out documents not); routing=frequency_balanced_secondary finds it through data.path, builds its
    tables from it, and refuses to start without it (one line naming routing.frequencies)."""
    import torch
    from helpers import compose_config

    from trmoe.config.resolve import to_config
    from trmoe.config.spec import model_spec
    from trmoe.model.routing import build_route_table
    from trmoe.model.transformer import TRMoETransformer

    docs = documents(80, seed=2)
    (tmp_path / "corpus.txt").write_text("\n\n".join(docs) + "\n")
    summary = prepare(str(tmp_path / "corpus.txt"), tmp_path / "out", eval_fraction=0.2, split_seed=1)
    counts = np.load(tmp_path / "out" / "token_counts.npy")
    train = [d for d in docs if not is_eval_document("", d, 0.2, 1)]
    want = np.bincount(expected_ids(train), minlength=200_019)
    assert counts.dtype == np.int64 and np.array_equal(counts, want)
    assert summary["token_counts"] == {
        "path": "token_counts.npy",
        "partition": "train",
        "total": int(want.sum()),
    }
    overrides = [
        "model=tiny",
        "data=tokens",
        f"data.path={tmp_path / 'out'}",
        "routing=frequency_balanced_secondary",
    ]
    spec = model_spec(to_config(compose_config(*overrides)))
    assert spec.route_frequencies == str(tmp_path / "out" / "token_counts.npy")
    torch.manual_seed(0)
    model = TRMoETransformer(spec)
    table = build_route_table("frequency_balanced_secondary", 200_019, 4, 2, 1, frequencies=counts)
    assert torch.equal(model.blocks[1].ffn.routed.route_table, table)
    mass = np.bincount(table[1].numpy(), weights=counts, minlength=4)
    assert mass.max() - mass.min() <= counts.max()  # the secondary balances occurrences
    (tmp_path / "out" / "token_counts.npy").unlink()
    with pytest.raises(UserError, match=r"^config error: routing.frequencies=None: .*token_counts.npy"):
        to_config(compose_config(*overrides))


# -------------------------------------------------------------- skipped inputs, bounded workers, no orphans


def test_every_skipped_input_is_named(tmp_path):
    """Old code: a dangling link and a FIFO among the inputs were skipped without a word."""
    src = tmp_path / "in"
    src.mkdir()
    (src / "a.txt").write_text("\n\n".join(documents(40)))
    (src / "b.txt").symlink_to(tmp_path / "gone.txt")
    os.mkfifo(src / "c.txt")
    result = run_prepare(["in", "--out", "ds", "--workers", "0", "--eval-fraction", "0.2"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"skipped {src / 'b.txt'}: a dangling symbolic link" in result.stderr
    assert f"skipped {src / 'c.txt'}: a FIFO" in result.stderr
    inputs = json.loads((tmp_path / "ds" / "dataset.json").read_text())["source"]["inputs"]
    assert [i["path"] for i in inputs] == ["a.txt"]


def test_workers_above_the_cores_are_lowered_with_a_message(tmp_path):
    from trmoe.cli import usable_cores

    (tmp_path / "c.txt").write_text("\n\n".join(documents(40)))
    result = run_prepare(["c.txt", "--out", "ds", "--workers", "1000", "--eval-fraction", "0.2"], tmp_path)
    assert result.returncode == 0, result.stderr
    cores = usable_cores()
    assert f"--workers 1000: this machine has {cores} usable cores; using {cores}" in result.stderr


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (state, ppid, pgrp, ...); None once it is gone."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _children(pid: int) -> set[int]:
    """The live processes whose parent is `pid` (Linux /proc)."""
    return {
        int(p.name)
        for p in Path("/proc").iterdir()
        if p.name.isdigit() and (fields := _stat(int(p.name))) and int(fields[1]) == pid
    }


def _alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_no_worker_outlives_a_killed_parent(tmp_path):
    """SIGKILL the parent (what the OOM killer does) once its tokenizer workers have started: they end with
    it. Old code: they went on loading the tokenizer and working through their tasks, orphaned."""
    import signal
    import time

    from helpers import start

    (tmp_path / "big.txt").write_text("\n\n".join(documents(20000)))
    proc = start("-m", "trmoe.data.prepare", "big.txt", "--out", "ds", "--workers", "2", cwd=tmp_path)
    deadline = time.monotonic() + 120
    workers: set[int] = set()
    while len(workers) < 2 and time.monotonic() < deadline and proc.poll() is None:
        # a worker leaves the parent's process group in its initializer (encode._init_worker)
        workers = {c for c in _children(proc.pid) if (f := _stat(c)) and int(f[2]) == c}
        time.sleep(0.01)
    assert proc.poll() is None and len(workers) == 2, "the workers never started"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 3  # the kernel kills them as the parent exits; old workers lived on
    while any(_alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [w for w in workers if _alive(w)]
    for w in left:  # not left to the rest of the suite
        os.kill(w, signal.SIGKILL)
    assert not left, f"workers {left} outlived their parent"


def test_closing_the_pool_while_workers_send_large_results_returns():
    """The clean-up path of an interrupted prepare and of a stopped stream: close() while workers are part-way
    through sending results larger than a pipe holds. multiprocessing.Pool.terminate() deadlocked here in
    about one try in five (a worker mid-send held the result queue's lock after the reader had stopped)."""
    import threading

    from trmoe.data.encode import make_pool

    for _ in range(3):
        pool = make_pool(2)
        results = [pool.submit(np.ones, (2_000_000,), np.uint8) for _ in range(6)]
        assert int(results[0].result().sum()) == 2_000_000
        closing = threading.Thread(target=pool.close, daemon=True)
        closing.start()
        closing.join(60)
        assert not closing.is_alive(), "close() never returned"
