"""`python -m trmoe.data.prepare INPUT --out DIR`: text -> a train/eval pair of token shards.

INPUT is a UTF-8 text file, a directory (every .txt, .jsonl and .parquet file below it, sorted by path) or
a glob. Documents: blank-line separated (or --separator) in text files, one JSON object per line in .jsonl
and one row per Parquet row, the text in --text-field. Each document goes to train or eval by the stable
content-hash rule (trmoe.data.corpus.is_eval_document), never by its position. Worker processes tokenize
chunks of documents with tiktoken's batch encoder; results are written in input order as they arrive, so
memory stays bounded and re-running on the same input gives byte-identical shards. Output files are written
as hidden .*.partial files and renamed when complete; any error removes them.

Tokenizer: o200k_base (`--tokenizer o200k`, the default), or `--tokenizer bpe --vocab-size N`: a byte-level
BPE of N ids (trmoe.data.bpe) trained first on the training split's documents (never on held-out text),
written beside the shards as tokenizer.json; its sha256 is in every shard index and in dataset.json. The
vocabulary is checked before anything is written. `--embedded` reads data=embedded's documents (CPython's
help topics) in place of INPUT.

    python -m trmoe.data.prepare corpus/ --out data/mycorpus --eval-fraction 0.01
    python -m trmoe.data.prepare --embedded --tokenizer bpe --vocab-size 2048 --eval-fraction 0.1 --out d/e
    python -m trmoe.data.prepare verify data/mycorpus

Over 400 lines on purpose: the tool's input discovery, worker pool, signal handling
and output writing are one command whose clean-up guarantees (no partial output, no orphan worker) span all of
them.
"""

from __future__ import annotations

import codecs
import contextlib
import glob
import io
import json
import os
import re
import shlex
import signal
import stat
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from trmoe import cli
from trmoe.cli import Parser
from trmoe.data.corpus import SPLIT_RULE
from trmoe.data.documents import first_line, open_parquet
from trmoe.data.encode import encode_documents, make_pool, ordered_map
from trmoe.data.identity import file_sha256
from trmoe.data.shards import (
    BIN_NAME,
    INDEX_NAME,
    PARTITIONS,
    TOKEN_COUNTS_NAME,
    ShardWriter,
    read_index,
    verify_shard,
)
from trmoe.data.tokenizer import Tokenizer, load_tokenizer
from trmoe.durable import FULL_OR_READ_ONLY, json_text, write_file
from trmoe.errors import RunFailed, UserError, require_directory

SUFFIXES = (".txt", ".jsonl", ".parquet")
CHUNK_DOCS = 512  # documents per worker task
CHUNK_BYTES = 2 << 20  # ... or this much text, whichever comes first
DATASET_FILE = "dataset.json"


# ----------------------------------------------------------------------------------------------- inputs


def _kind(path: Path) -> str:
    """What a directory entry is, in words, when it is not a regular file."""
    if path.is_symlink() and not path.exists():
        return "a dangling symbolic link"
    mode = path.stat().st_mode
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))
    kinds += ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    return next((word for test, word in kinds if test(mode)), "not a regular file")


def _skip(paths: list[Path]) -> list[Path]:
    """The regular files of `paths`; every other one is named on stderr (nothing is skipped silently)."""
    kept = []
    for path in paths:
        if path.is_file():
            kept.append(path)
        else:
            print(f"trmoe: data.prepare: skipped {path}: {_kind(path)}", file=sys.stderr)
    return kept


def discover_inputs(spec: str) -> tuple[Path, list[Path]]:
    """(root, files): a single file (read as text unless it is .jsonl/.parquet), every .txt/.jsonl/.parquet
    file below a directory, or the files a glob matches; sorted by path. An entry that would be an input
    but is no regular file (a dangling link, a FIFO, a socket; a directory a glob matches) is skipped and
    named on stderr."""
    if any(ch in spec for ch in "*?["):
        # absolute, not resolved: a match that is a symlink is named as matched, not by its target
        files = sorted(Path(os.path.abspath(p)) for p in glob.glob(os.path.expanduser(spec), recursive=True))
        files = _skip(files)
        if not files:
            raise UserError(f"input {spec}: the glob matches no files")
        bad = [p for p in files if p.suffix not in SUFFIXES]
        if bad:
            raise UserError(f"input {bad[0]}: unsupported file type; allowed: {', '.join(SUFFIXES)}")
        return Path(os.path.commonpath([str(p.parent) for p in files])), files
    path = Path(spec).expanduser().resolve()
    if not path.exists():
        raise UserError(f"input {path}: no such file or directory")
    if path.is_dir():
        candidates = sorted(p for p in path.rglob("*") if p.suffix in SUFFIXES)
        files = _skip([p for p in candidates if not (p.is_dir() and not p.is_symlink())])
        if not files:
            raise UserError(f"input {path}: the directory holds no {', '.join(SUFFIXES)} files")
        return path, files
    if not path.is_file():
        raise UserError(f"input {path}: not a regular file")
    return path.parent, [path]


def _utf8_error(path: Path, raw: bytes, exc: UnicodeDecodeError, offset: int) -> UserError:
    return UserError(
        f"text file {path}: not valid UTF-8 (byte 0x{raw[exc.start]:02x} at byte offset "
        f"{offset + exc.start}: "
        f"{exc.reason})"
    )


def text_documents(path: Path, separator: str | None) -> Iterator[tuple[str, int]]:
    """(document, bytes read so far) of a UTF-8 text file, streamed. Without a separator a document ends at
    one or more empty / whitespace-only lines (the data=text rule); each is stripped, empty ones dropped."""
    if separator is not None:
        yield from _separated_documents(path, separator)
        return
    lines: list[str] = []
    offset = 0
    with open(path, "rb") as f:
        for raw in f:
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise _utf8_error(path, raw, exc, offset) from None
            if offset == 0:
                line = line.removeprefix("\ufeff")
            offset += len(raw)
            if line.strip():
                lines.append(line)
            elif lines:
                doc = "".join(lines).strip()
                lines = []
                if doc:
                    yield doc, offset
    doc = "".join(lines).strip()
    if doc:
        yield doc, offset


def _separated_documents(path: Path, separator: str) -> Iterator[tuple[str, int]]:
    decoder = codecs.getincrementaldecoder("utf-8")()
    buffer, offset, first = "", 0, True
    with open(path, "rb") as f:
        while True:
            raw = f.read(1 << 20)
            try:
                text = decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as exc:
                raise _utf8_error(path, exc.object, exc, offset - (len(exc.object) - len(raw))) from None
            offset += len(raw)
            if first:
                text, first = text.removeprefix("\ufeff"), False
            buffer += text
            *done, buffer = buffer.split(separator)
            for piece in done:
                if piece.strip():
                    yield piece.strip(), offset
            if not raw:
                break
    if buffer.strip():
        yield buffer.strip(), offset


def jsonl_documents(path: Path, text_field: str, key: str = "--text-field") -> Iterator[tuple[str, int]]:
    """(document, bytes read so far) of a JSON Lines file: the string `text_field` of each line's object
    (blank lines and empty texts skipped). `key` names the option that chose the field in the errors."""
    offset = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise _utf8_error(path, raw, exc, offset) from None
            offset += len(raw)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(
                    # (json's msg can end in " at", the position it leaves to str(exc))
                    f"jsonl file {path}: line {lineno} is not valid JSON "
                    f"({exc.msg.removesuffix(' at')} at column {exc.colno})"
                ) from None
            if not isinstance(record, dict) or text_field not in record:
                raise UserError(f"jsonl file {path}: line {lineno} has no field {text_field!r} ({key})")
            text = record[text_field]
            if text is not None and not isinstance(text, str):
                raise UserError(
                    f"jsonl file {path}: line {lineno}: field {text_field!r} is a {type(text).__name__}, "
                    "not a string"
                )
            if text and not text.isascii():
                try:  # JSON can escape half a surrogate pair ("\ud800"), which no UTF-8 text holds
                    text.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise UserError(
                        f"jsonl file {path}: line {lineno}: field {text_field!r} holds an unpaired surrogate "
                        f"{text[exc.start]!r} at character {exc.start}: not Unicode text"
                    ) from None
            if text:
                yield text, offset


def parquet_documents(path: Path, text_field: str) -> Iterator[tuple[str, int]]:
    import pyarrow as pa

    handle = open_parquet(path, text_field, "--text-field")
    size = path.stat().st_size
    groups = handle.num_row_groups
    for rg in range(groups):
        try:
            column = handle.read_row_group(rg, columns=[text_field]).column(0).to_pylist()
        except (pa.ArrowException, OSError) as exc:
            raise UserError(f"parquet file {path}: unreadable ({first_line(exc)})") from None
        done = size * (rg + 1) // groups
        for text in column:
            if text:
                yield text, done


def file_documents(path: Path, text_field: str, separator: str | None) -> Iterator[tuple[str, int]]:
    """(document, input bytes consumed) of one input file; a file without documents is an error."""
    if path.suffix == ".parquet":
        reader = parquet_documents(path, text_field)
    elif path.suffix == ".jsonl":
        reader = jsonl_documents(path, text_field)
    else:
        reader = text_documents(path, separator)
    count = 0
    for item in reader:
        count += 1
        yield item
    if count == 0:
        raise UserError(f"{path.suffix.lstrip('.') or 'text'} file {path}: contains no documents (empty)")


# ----------------------------------------------------------------------------------------------- progress


class Progress:
    """Documents, tokens, MB/s and ETA: a tqdm bar on a terminal, a log line every few seconds elsewhere."""

    def __init__(self, mode: str, total_bytes: int):
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "log"
        self.mode, self.total = mode, max(total_bytes, 1)
        self.start = self._last_log = time.perf_counter()
        self.done = 0
        self._bar = None
        if mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="prepare", file=sys.stderr)

    def update(self, done_bytes: int, documents: int, tokens: int) -> None:
        if self._bar is not None:
            self._bar.update(done_bytes - self.done)
            self._bar.set_postfix(docs=f"{documents:,}", tokens=f"{tokens:,}", refresh=False)
        self.done = done_bytes
        now = time.perf_counter()
        if self.mode == "log" and now - self._last_log >= 5.0:
            self._last_log = now
            rate = done_bytes / max(now - self.start, 1e-9)
            eta = (self.total - done_bytes) / max(rate, 1e-9)
            print(
                f"prepare: {100 * done_bytes / self.total:5.1f}% | {documents:,} docs | {tokens:,} tokens | "
                f"{rate / 1e6:.1f} MB/s | eta {int(eta // 60)}m{int(eta % 60):02d}s",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


# ----------------------------------------------------------------------------------------------- prepare


def _embedded_chunks() -> Iterator[tuple[tuple[int, int], list[str]]]:
    """_chunks of --embedded: data=embedded's documents (corpus.embedded_documents), in its order."""
    from trmoe.data.corpus import embedded_documents

    texts: list[str] = []
    size, pos = 0, 0
    for _, text in embedded_documents():
        texts.append(text)
        size += len(text)
        pos += len(text.encode("utf-8"))
        if len(texts) >= CHUNK_DOCS or size >= CHUNK_BYTES:
            yield (0, pos), texts
            texts, size = [], 0
    if texts:
        yield (0, pos), texts


def _chunks(files: list[Path], text_field: str, separator: str | None) -> Iterator[tuple[tuple, list[str]]]:
    """((file index, bytes consumed in that file), texts) chunks of the documents of all files, in order."""
    for fi, path in enumerate(files):
        texts: list[str] = []
        size, pos = 0, 0
        for text, pos in file_documents(path, text_field, separator):
            texts.append(text)
            size += len(text)
            if len(texts) >= CHUNK_DOCS or size >= CHUNK_BYTES:
                yield (fi, pos), texts
                texts, size = [], 0
        if texts:
            yield (fi, pos), texts


def _check_tokenizer(tokenizer: str, vocab_size: int | None) -> None:
    from trmoe.data.bpe import check_vocab_size

    if tokenizer == "bpe":
        if vocab_size is None:
            raise UserError("--tokenizer bpe: needs --vocab-size N (the BPE's ids, e.g. 4096)")
        check_vocab_size(vocab_size)
    elif vocab_size is not None:
        raise UserError(
            f"--vocab-size {vocab_size}: o200k_base has its 200,019 ids; allowed with --tokenizer bpe"
        )


def _check_args(eval_fraction: float, workers: int, separator: str | None, text_field: str) -> None:
    if not 0.0 < eval_fraction < 1.0:
        raise UserError(f"--eval-fraction {eval_fraction}: must be in (0, 1)")
    if workers < 0:
        raise UserError(f"--workers {workers}: must be >= 0 (0 = tokenize in this process)")
    if separator == "":
        raise UserError("--separator: must be a non-empty string (or omit it to split on blank lines)")
    if not text_field:
        raise UserError("--text-field: must name the field that holds the text")


def bounded_workers(workers: int) -> int:
    """At most the usable cores: each worker is a process with its own tokenizer, so more only adds memory
    (1000 on two cores ran the machine out of it). The output does not depend on the count, so a larger one
    is lowered, with a message, rather than refused."""
    cores = cli.usable_cores()
    if workers > cores:
        print(
            f"trmoe: data.prepare: --workers {workers}: this machine has {cores} usable cores; using {cores}",
            file=sys.stderr,
        )
    return min(workers, cores)


def _train_bpe(chunks: Iterator[tuple[Any, list[str]]], eval_fraction: float, split_seed: int, n: int) -> str:
    """tokenizer.json of a BPE of `n` ids trained on the training split's documents, in input order."""
    from trmoe.data.bpe import train_bpe
    from trmoe.data.corpus import is_eval_document

    def train_texts() -> Iterator[list[str]]:
        for _, texts in chunks:
            yield [t for t in texts if not is_eval_document("", t, eval_fraction, split_seed)]

    return train_bpe(train_texts(), n)


def _embedded_input() -> dict[str, Any]:
    """dataset.json's `inputs` entry of --embedded: what corpus.embedded_documents reads, by its content."""
    import hashlib
    import sys as _sys

    from trmoe.data.corpus import embedded_documents

    digest, size = hashlib.sha256(), 0
    for key, text in embedded_documents():
        digest.update(f"{len(key)}:{key}{len(text)}:{text}".encode())
        size += len(text.encode("utf-8"))
    version = _sys.version.split()[0]
    return {
        "path": f"embedded: pydoc_data.topics (Python {version})",
        "bytes": size,
        "sha256": digest.hexdigest(),
    }


def _check_out(out: Path) -> None:
    """--out must be a directory, or not exist yet below one; train/ and eval/ in it directories if there."""
    require_directory(out, "--out", "a new or existing directory (the dataset directory of train/ and eval/)")
    for part in PARTITIONS:
        if (out / part).exists() and not (out / part).is_dir():
            raise UserError(
                f"--out {out}: {out / part} is a file, not a directory; allowed: a directory whose {part}/ "
                "is a directory or absent"
            )


def write_token_counts(out: Path, counts: np.ndarray) -> None:
    """<out>/token_counts.npy: int64 [vocab], how often each token id occurs in the training split (written
    through a temporary file: a partial table is never read as a whole one)."""
    buffer = io.BytesIO()  # np.save into the file itself reports a full disk without its errno (tofile)
    np.save(buffer, counts.astype(np.int64), allow_pickle=False)
    write_file(out / TOKEN_COUNTS_NAME, buffer.getvalue())


def prepare(
    input_spec: str,
    out: str | Path,
    *,
    text_field: str = "text",
    separator: str | None = None,
    eval_fraction: float = 0.01,
    split_seed: int = 0,
    workers: int = 0,
    progress: str = "none",
    overwrite: bool = False,
    tokenizer: str = "o200k",
    vocab_size: int | None = None,
) -> dict[str, Any]:
    """Tokenize the input (a path or glob; None: --embedded) into <out>/train and <out>/eval shards with
    `tokenizer` (o200k, or bpe of `vocab_size` ids trained here and written to <out>/tokenizer.json); returns
    the dataset summary (also written to <out>/dataset.json). Raises UserError, leaving nothing behind, on
    bad input."""
    from trmoe.data.bpe import FILE_NAME

    _check_args(eval_fraction, workers, separator, text_field)
    _check_tokenizer(tokenizer, vocab_size)
    workers = bounded_workers(workers)
    embedded = input_spec is None
    root, files = (Path.cwd(), []) if embedded else discover_inputs(input_spec)
    for path in files:  # fail on unreadable Parquet before writing anything
        if path.suffix == ".parquet":
            open_parquet(path, text_field, "--text-field")
    out = Path(out).expanduser().resolve()
    _check_out(out)
    existing = [out / p / INDEX_NAME for p in PARTITIONS if (out / p / INDEX_NAME).exists()]
    existing += [out / DATASET_FILE] if (out / DATASET_FILE).exists() else []
    if existing and not overwrite:
        raise UserError(f"output {out}: already holds a prepared dataset ({existing[0]}); use --overwrite")
    if any(out == p.resolve() or out in p.resolve().parents for p in files):
        raise UserError(f"output {out}: is the input or inside it; choose another --out")

    def chunks() -> Iterator[tuple[tuple[int, int], list[str]]]:
        return _embedded_chunks() if embedded else _chunks(files, text_field, separator)

    bpe_json = None
    if tokenizer == "bpe":  # trained, and its size checked, before anything is written
        bpe_json = _train_bpe(chunks(), eval_fraction, split_seed, int(vocab_size or 0))
    if embedded:
        inputs = [_embedded_input()]
    else:
        inputs = [
            {"path": p.relative_to(root).as_posix(), "bytes": p.stat().st_size, "sha256": file_sha256(p)}
            for p in files
        ]
    source = {
        "tool": "trmoe.data.prepare",
        "root": "embedded" if embedded else str(root),
        "inputs": inputs,
        "text_field": text_field,
        "separator": separator if separator is not None else "blank lines",
        "split_rule": SPLIT_RULE,
        "eval_fraction": eval_fraction,
        "split_seed": split_seed,
    }
    # Every directory this call makes (--out's missing parents too), removed again on error.
    created = [d for d in (*reversed(out.parents), out, *(out / p for p in PARTITIONS)) if not d.exists()]
    writers: dict[str, ShardWriter] = {}
    sizes = [inputs[0]["bytes"]] if embedded else [p.stat().st_size for p in files]
    offsets = np.cumsum([0, *sizes])
    bar = Progress(progress, int(offsets[-1]))
    start = time.perf_counter()
    pool, documents = None, 0
    # the finished files this call wrote, removed again on error (a full disk at the last write included)
    written: list[Path] = []
    try:
        tok_path = None
        if bpe_json is not None:  # the workers read it from its place in the dataset
            out.mkdir(parents=True, exist_ok=True)
            tok_path = out / FILE_NAME
            written.append(tok_path)
            write_file(tok_path, bpe_json)
        enc: Tokenizer = load_tokenizer(tokenizer, tok_path)
        meta = dict(vocab_size=enc.n_vocab, tokenizer=enc.name, tokenizer_sha256=enc.sha256)
        counts = np.zeros(enc.n_vocab, dtype=np.int64)  # the training split's token frequencies, exact
        for p in PARTITIONS:  # in the try: a directory that cannot be made leaves no other partial file
            try:
                writers[p] = ShardWriter(out / p, partition=p, eos_id=enc.eos_id, source=source, **meta)
            except OSError as exc:  # no permission, or a file put in the way since the check
                raise UserError(f"--out {out}: cannot write {out / p} ({exc.strerror or exc})") from None
        with interruptions_deferred():  # a Ctrl-C while the workers start would orphan them
            pool = make_pool(workers)
        path_arg = None if tok_path is None else str(tok_path)
        tasks = ((tag, (texts, eval_fraction, split_seed, "all", path_arg)) for tag, texts in chunks())
        for (fi, pos), (is_eval, text_bytes, lengths, ids) in ordered_map(
            pool, encode_documents, tasks, max_in_flight=2 * max(workers, 1) + 1
        ):
            held_out = np.repeat(is_eval, lengths)
            writers["train"].append(ids[~held_out], int((~is_eval).sum()), int(text_bytes[~is_eval].sum()))
            counts += np.bincount(ids[~held_out], minlength=enc.n_vocab)
            writers["eval"].append(ids[held_out], int(is_eval.sum()), int(text_bytes[is_eval].sum()))
            documents = writers["train"].documents + writers["eval"].documents
            tokens = writers["train"].num_tokens + writers["eval"].num_tokens
            bar.update(int(offsets[fi]) + pos, documents, tokens)
        for p, writer in writers.items():
            if writer.documents == 0:
                raise UserError(
                    f"input {input_spec or 'embedded'}: the split rule put none of the {documents} documents "
                    f"into {p}; "
                    f"{'raise' if p == 'eval' else 'lower'} --eval-fraction or add documents"
                )
        indexes = {}
        for p, writer in writers.items():
            written += [out / p / BIN_NAME, out / p / INDEX_NAME]
            indexes[p] = writer.close()
        written.append(out / TOKEN_COUNTS_NAME)
        write_token_counts(out, counts)
        elapsed = time.perf_counter() - start
        summary = {
            "format": "trmoe-dataset",
            "version": 1,
            "source": source,
            "tokenizer": enc.name,
            "tokenizer_sha256": enc.sha256,
            "vocab_size": enc.n_vocab,
            **({"tokenizer_file": FILE_NAME} if tok_path is not None else {}),
            "partitions": {
                p: {k: idx[k] for k in ("num_tokens", "documents", "text_bytes", "sha256", "dtype")}
                | {"path": p}
                for p, idx in indexes.items()
            },
            # routing.strategy=frequency_balanced_secondary reads it (docs/routing.md)
            "token_counts": {"path": TOKEN_COUNTS_NAME, "partition": "train", "total": int(counts.sum())},
        }
        written.append(out / DATASET_FILE)
        write_file(out / DATASET_FILE, json_text(summary, indent=2, sort_keys=True) + "\n", fsync=False)
        if tok_path is None:  # --overwrite of a bpe dataset: its tokenizer.json would pass for this one's
            (out / FILE_NAME).unlink(missing_ok=True)
    except BaseException as exc:
        with interruptions_deferred(reraise=False):  # a second Ctrl-C must not cut the clean-up short
            if pool is not None:
                pool.close()
                pool = None
            for writer in writers.values():
                writer.abort()
            for path in written:  # (with --overwrite, a previous dataset's replaced file goes too)
                path.unlink(missing_ok=True)
            for d in reversed(created):
                try:
                    d.rmdir()
                except OSError:
                    pass
        if isinstance(exc, OSError) and exc.errno in FULL_OR_READ_ONLY:
            where = f" ({exc.filename})" if exc.filename else ""
            raise RunFailed(
                f"--out {out}: cannot write the dataset: {exc.strerror}{where}; what this run wrote was "
                "removed"
            ) from None
        raise
    finally:
        bar.close()
        if pool is not None:
            pool.close()
    summary["elapsed_s"] = elapsed
    summary["input_bytes"] = int(offsets[-1])
    return summary


STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _interrupt(signum: int, frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


@contextlib.contextmanager
def interruptions_deferred(reraise: bool = True) -> Iterator[None]:
    """Ctrl-C, SIGTERM and SIGHUP inside the block are held until it ends (then raised as one
    KeyboardInterrupt, or dropped with reraise=False: the clean-up that an interruption started)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: held.append(signum)) for s in STOPS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if held and reraise:
        raise KeyboardInterrupt(signal.Signals(held[0]).name)


def _print_summary(out: Path, summary: dict[str, Any]) -> None:
    elapsed = summary["elapsed_s"]
    print(f"prepared {out}  ({summary['input_bytes'] / 1e6:.1f} MB of input in {elapsed:.1f} s, "
          f"{summary['input_bytes'] / 1e6 / max(elapsed, 1e-9):.1f} MB/s)")  # fmt: skip
    for p, part in summary["partitions"].items():
        print(
            f"  {p:5s} {part['documents']:>10,} documents  {part['num_tokens']:>14,} tokens  "
            f"{part['text_bytes']:>14,} bytes  {out / p}  sha256 {part['sha256'][:16]}"
        )
    bpe = " tokenizer=bpe" if summary["tokenizer"] == "bpe" else ""
    if bpe:
        print(f"  tokenizer bpe, {summary['vocab_size']:,} ids: {out / summary['tokenizer_file']}  sha256 "
              f"{summary['tokenizer_sha256'][:16]}")  # fmt: skip
    print(f"train with: python -m trmoe.train data=tokens {train_override('data.path', out)}{bpe}")


def train_override(key: str, value: Path | str) -> str:
    """`key=value` as one shell word that Hydra reads back as `value`: quoted for Hydra when the path holds
    anything but plain path characters (a space, a comma, a bracket), and for the shell around that."""
    text = str(value)
    if re.fullmatch(r"[\w./:+~-]+", text):
        return f"{key}={text}"
    hydra = "'" + text.replace("'", "\\'") + "'"
    word = f"{key}={hydra}"
    return f'"{word}"' if not re.search(r'["$`\\!]', word) else shlex.quote(word)


def _verify(paths: list[str]) -> None:
    for spec in paths:
        root = Path(spec).expanduser().resolve()
        shards = [root] if (root / INDEX_NAME).exists() else [root / p for p in PARTITIONS]
        if not (root / INDEX_NAME).exists() and not all((d / INDEX_NAME).exists() for d in shards):
            read_index(root)  # raises the precise error (missing directory / index)
        for shard in shards:
            index = read_index(shard)
            scan = verify_shard(shard, index=index)
            print(
                f"ok {shard}: {index['partition']}, {scan['num_tokens']:,} tokens ({index['dtype']}), "
                f"{index['documents']:,} documents, max id {scan['max_token_id']}, sha256 {scan['sha256']}"
            )


def _parser() -> Parser:
    parser = Parser(
        prog="python -m trmoe.data.prepare",
        description="Tokenize text into a train/eval pair of token shards (o200k_base, or a byte-level BPE "
        "trained on it: --tokenizer bpe --vocab-size N; docs/data.md). "
        "`python -m trmoe.data.prepare verify DIR...` checks shards.",
    )
    parser.add_argument(
        "input",
        nargs="?",
        help="a UTF-8 text file, a directory of .txt/.jsonl/.parquet files, or a glob (or --embedded)",
    )
    parser.add_argument(
        "--embedded", action="store_true", help="data=embedded's documents (CPython's help topics) as input"
    )
    parser.add_argument("--tokenizer", choices=("o200k", "bpe"), default="o200k", help="o200k_base or a BPE")
    parser.add_argument(
        "--vocab-size", type=int, default=None, help="--tokenizer bpe: its ids (>= 257; e.g. 512-32768)"
    )
    parser.add_argument("--out", required=True, help="output dataset directory (gets train/ and eval/)")
    parser.add_argument("--text-field", default="text", help="JSONL field / Parquet column with the text")
    parser.add_argument(
        "--separator", default=None, help="document separator in text files (default: blank lines)"
    )
    parser.add_argument("--eval-fraction", type=float, default=0.01, help="share of documents held out")
    parser.add_argument(
        "--split-seed", type=int, default=0, help="salt of the document hash that assigns splits"
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=cli.usable_cores(),
        help="tokenizer processes, at most the usable cores (0 = inline)",
    )
    parser.add_argument("--progress", choices=("auto", "bar", "log", "none"), default="auto")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an existing prepared dataset in --out"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, argv)


def _main(argv: list[str]) -> int:
    # SIGTERM / SIGHUP clean up like Ctrl-C (by default they end the process at once); a caller's own
    # handlers (main called in-process) are back afterwards
    previous = {stop: signal.signal(stop, _interrupt) for stop in STOPS[1:]}
    try:
        if argv[:1] == ["verify"]:
            verify = Parser(prog="python -m trmoe.data.prepare verify")
            verify.add_argument("paths", nargs="+", help="shard directories or prepared dataset directories")
            _verify(verify.parse_args(argv[1:]).paths)
            return 0
        args = _parser().parse_args(argv)
        if (args.input is None) == (not args.embedded):
            raise UserError("input: give a file, directory or glob, or --embedded (one of them)")
        summary = prepare(
            args.input,
            args.out,
            text_field=args.text_field,
            separator=args.separator,
            eval_fraction=args.eval_fraction,
            split_seed=args.split_seed,
            workers=args.workers,
            progress=args.progress,
            overwrite=args.overwrite,
            tokenizer=args.tokenizer,
            vocab_size=args.vocab_size,
        )
        _print_summary(Path(args.out).expanduser().resolve(), summary)
    except KeyboardInterrupt as exc:
        name = str(exc) if str(exc) in signal.Signals.__members__ else "SIGINT"
        print(f"trmoe: data.prepare: interrupted ({name}); partial files removed", file=sys.stderr)
        return 128 + signal.Signals[name]
    finally:
        for stop, handler in previous.items():
            signal.signal(stop, handler)
    return 0


if __name__ == "__main__":
    sys.exit(main())
