"""`data`: how fast the data path is — token-shard reads, shard verification, the prepare tool and the
streamed Parquet reader. Not a test: figures go to bench/results.jsonl (and docs/data.md).

    python -m trmoe.bench data [--shard-mb 256] [--text-mb 16] [--reps 5] [--dir DIR]

Shard reads are timed with a warm page cache (the file was just written): they measure the gather and the
copy into int64 tensors, not the disk. Each figure is the median of --reps repetitions.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from trmoe import cli
from trmoe.bench.common import Parser, positive_int, record
from trmoe.data.tokenizer import O200K_VOCAB
from trmoe.errors import UserError, file_in_the_way


def _median_s(fn, reps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def bench_shard(root: Path, shard_mb: int, reps: int, micro: int, seq_len: int) -> dict:
    from trmoe.data.pipeline import ShardWindows
    from trmoe.data.shards import ShardWriter, open_shard, verify_shard

    vocab, chunk = O200K_VOCAB, 1 << 22
    tokens = shard_mb * 2**20 // 4
    writer = ShardWriter(root / "shard", vocab_size=vocab, tokenizer="bench", tokenizer_sha256=None,
                         partition="train", eos_id=None, source={"kind": "bench"})  # fmt: skip
    rng = np.random.default_rng(0)
    for start in range(0, tokens, chunk):
        writer.append(rng.integers(0, vocab, size=min(chunk, tokens - start), dtype=np.uint32))
    writer.close()
    open_s = _median_s(lambda: open_shard(root / "shard"), reps)
    shard = open_shard(root / "shard")
    steps = 50
    out = {
        "shard_mb": shard_mb,
        "shard_tokens": tokens,
        "open_s": open_s,
        "micro_batch": micro,
        "seq_len": seq_len,
    }
    for order in ("sequential", "shuffled"):
        sampler = ShardWindows(shard.tokens, seq_len, order, 0, name="bench", vocab_size=vocab)
        position = [0]

        def read(sampler=sampler, position=position):
            for _ in range(steps):
                sampler.batch(position[0], micro)
                position[0] += micro

        seconds = _median_s(read, reps)
        out[f"read_{order}_tokens_per_s"] = steps * micro * seq_len / seconds
        out[f"read_{order}_batch_ms"] = 1e3 * seconds / steps
    verify_s = _median_s(lambda: verify_shard(root / "shard", index=shard.index), max(1, reps // 2), warmup=0)
    out["verify_mb_per_s"] = shard_mb / verify_s
    return out


def _corpus(path: Path, text_mb: int) -> int:
    from pydoc_data.topics import topics

    docs = [topics[k] for k in sorted(topics)]
    written = 0
    with open(path, "w", encoding="utf-8") as f:
        copy = 0
        while written < text_mb * 2**20:
            for doc in docs:  # each copy differs, so the split rule sees distinct documents
                text = f"[copy {copy}] {doc}\n\n"
                f.write(text)
                written += len(text.encode())
            copy += 1
    return written


def bench_prepare(root: Path, text_mb: int, reps: int, workers: list[int]) -> dict:
    from trmoe.data.prepare import prepare

    corpus = root / "corpus.txt"
    size = _corpus(corpus, text_mb)
    out: dict = {"input_bytes": size, "prepare": {}}
    for n in workers:
        times, tokens = [], 0
        for rep in range(reps):
            target = root / f"out-{n}-{rep}"
            start = time.perf_counter()
            summary = prepare(str(corpus), target, workers=n, eval_fraction=0.01)
            times.append(time.perf_counter() - start)
            tokens = sum(p["num_tokens"] for p in summary["partitions"].values())
            shutil.rmtree(target)
        seconds = statistics.median(times)
        out["prepare"][str(n)] = {
            "seconds": seconds,
            "mb_per_s": size / 1e6 / seconds,
            "tokens_per_s": tokens / seconds,
        }
    out["tokens"] = tokens
    out["pool_start_s"] = {}  # spawn + import + tokenizer load, paid once per prepare run / training run
    for n in workers:
        if n > 0:
            out["pool_start_s"][str(n)] = _median_s(lambda n=n: _start_pool(n), 1, warmup=0)
    return out


def _start_pool(workers: int) -> None:
    from trmoe.data.encode import encode_documents, make_pool

    pool = make_pool(workers)  # returns once every worker has started and loaded the tokenizer
    try:
        pool.submit(encode_documents, ["warm"], 0.01, 0).result()
    finally:
        pool.close()


def bench_tokenizer(root: Path, reps: int) -> dict:
    """Why workers call encode_ordinary per document: tiktoken's encode_ordinary_batch wraps it in a thread
    pool whose per-document futures cost more than short documents take to encode."""
    from trmoe.data.tokenizer import load_o200k

    enc = load_o200k()
    texts = (root / "corpus.txt").read_text().split("\n\n")[:20_000]
    size = sum(len(t.encode()) for t in texts)
    cases = {
        "encode_ordinary_loop": lambda: [enc.encode_ordinary(t) for t in texts],
        "encode_ordinary_batch_1_thread": lambda: enc.encode_ordinary_batch(texts, num_threads=1),
        f"encode_ordinary_batch_{os.cpu_count()}_threads": lambda: enc.encode_ordinary_batch(
            texts, num_threads=os.cpu_count() or 1
        ),
    }
    return {name: {"mb_per_s": size / 1e6 / _median_s(fn, reps)} for name, fn in cases.items()}


def bench_stream(root: Path, text_mb: int, workers: list[int], seq_len: int) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from trmoe.data.fineweb import ParquetSource, StreamWindows

    texts = (root / "corpus.txt").read_text().split("\n\n")
    (root / "pq").mkdir(exist_ok=True)
    pq.write_table(pa.table({"text": texts}), root / "pq" / "part-0.parquet", row_group_size=1000)
    source = ParquetSource(str(root / "pq"), "text")
    out = {}
    for n in workers:
        stream = StreamWindows(source, seq_len, 0.01, 0, workers=n)
        stream.batch(0, 1)  # start-up (worker processes, first row group) is not throughput
        windows = max(1, int(text_mb * 2**20 / 4.5 / seq_len * 0.8))  # ~80% of one pass (~4.5 bytes/token)
        start = time.perf_counter()
        stream.batch(1, windows)
        seconds = time.perf_counter() - start
        stream.close()
        out[str(n)] = {"tokens_per_s": windows * seq_len / seconds, "windows": windows}
    return out


def _worker_counts(text: str) -> list[int]:
    """argparse type of --workers: comma-separated worker counts, each >= 0 (0 = tokenize in-process)."""
    try:
        counts = sorted({int(w) for w in text.split(",")})
    except ValueError:
        counts = [-1]
    if counts[0] < 0:
        raise argparse.ArgumentTypeError(
            f"got {text!r}; allowed: comma-separated whole numbers >= 0, e.g. 0,1,4"
        )
    return counts


def _scratch_dir(text: str) -> Path:
    """argparse type of --dir: a directory, or a path where one can be made (no file on the way)."""
    path = Path(text)
    if file_in_the_way(path) is not None:
        raise argparse.ArgumentTypeError(f"{text!r} is a file or lies under one; allowed: a directory path")
    return path


def _make_scratch(parent: Path | None) -> Path:
    """A new, empty directory of its own (inside `parent` when given): the benchmark writes fixed names
    (corpus.txt, shard, pq/) that must never replace a user's files."""
    if parent is None:
        return Path(tempfile.mkdtemp(prefix="trmoe-bench-data-"))
    try:
        parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix="trmoe-bench-data-", dir=parent))
    except OSError as e:
        raise UserError(f"bench data: --dir {parent}: {e.strerror}; allowed: a writable directory") from None


def main(argv: list[str] | None = None) -> None:
    parser = Parser(prog="python -m trmoe.bench data", description=__doc__)
    parser.add_argument(
        "--shard-mb", type=positive_int, default=256, help="size of the synthetic uint32 shard"
    )
    parser.add_argument(
        "--text-mb", type=positive_int, default=16, help="size of the text corpus for prepare/stream"
    )
    parser.add_argument("--reps", type=positive_int, default=5)
    parser.add_argument("--micro-batch", type=positive_int, default=8)
    parser.add_argument("--seq-len", type=positive_int, default=2048)
    parser.add_argument(
        "--workers",
        type=_worker_counts,
        default=f"0,1,{os.cpu_count() or 1}",
        help="worker counts to compare",
    )
    parser.add_argument(
        "--dir",
        type=_scratch_dir,
        help="where the scratch files go (e.g. the disk to measure): a fresh directory made inside it and "
        "removed afterwards, so nothing already there is touched (default: the system's temporary directory)",
    )
    args = parser.parse_args(argv)
    workers = args.workers
    scratch = _make_scratch(args.dir)
    try:
        shard = bench_shard(scratch, args.shard_mb, args.reps, args.micro_batch, args.seq_len)
        seq_tok, shuf_tok = shard["read_sequential_tokens_per_s"], shard["read_shuffled_tokens_per_s"]
        print(
            f"shard {args.shard_mb} MB: open {shard['open_s'] * 1e3:.2f} ms | read sequential "
            f"{seq_tok / 1e6:.1f} M tok/s ({shard['read_sequential_batch_ms']:.2f} ms/batch) | shuffled "
            f"{shuf_tok / 1e6:.1f} M tok/s ({shard['read_shuffled_batch_ms']:.2f} ms/batch) | verify "
            f"{shard['verify_mb_per_s']:.0f} MB/s"
        )
        prep = bench_prepare(scratch, args.text_mb, max(1, min(args.reps, 3)), workers)
        for n, r in prep["prepare"].items():
            print(f"prepare {prep['input_bytes'] / 1e6:.1f} MB, workers={n}: {r['mb_per_s']:.2f} MB/s, "
                  f"{r['tokens_per_s'] / 1e6:.2f} M tok/s")  # fmt: skip
        for n, seconds in prep["pool_start_s"].items():
            print(f"tokenizer pool start, workers={n}: {seconds:.2f} s")
        tokenizer = bench_tokenizer(scratch, max(1, min(args.reps, 3)))
        for name, r in tokenizer.items():
            print(f"tokenizer {name}: {r['mb_per_s']:.2f} MB/s")
        stream = bench_stream(scratch, args.text_mb, workers, args.seq_len)
        for n, r in stream.items():
            print(f"fineweb stream, workers={n}: {r['tokens_per_s'] / 1e6:.2f} M tok/s")
        record(
            "data",
            {"shard": shard, "prepare": prep, "tokenizer": tokenizer, "stream": stream, "reps": args.reps},
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(cli.run(main))
