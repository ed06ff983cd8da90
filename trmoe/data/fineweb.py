"""Streamed corpora (`data=fineweb`): documents from local Parquet files (a downloaded FineWeb-Edu sample, any
Parquet with a text column) or, with the optional `hf` extra, from the Hugging Face hub.

Documents keep their source order. The held-out split is the same stable content-hash rule as everywhere in
trmoe (`trmoe.data.corpus.is_eval_document`), so it does not depend on the number of ranks or workers. The
training stream is the train documents' o200k ids, EOS after each, cut into windows of seq_len + 1 tokens with
stride seq_len: sample g is window g of that stream, whatever the world size. Tokenization runs ahead of the
training loop in a background thread fed by worker processes; a cursor (epoch, file, row group, row, token
offset) names the next window exactly, for checkpoints.

Over 400 lines on purpose: the streamed source's cursor, its reader thread and its
worker pool are one mechanism whose exact-resume invariant spans all three.
"""

from __future__ import annotations

import collections
import glob
import hashlib
import os
import queue
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trmoe.data.documents import first_line, open_parquet
from trmoe.data.encode import encode_documents, make_pool, ordered_map
from trmoe.data.identity import file_sha256
from trmoe.errors import UserError

CHUNK_DOCS = 256  # documents per tokenizer task
CHUNK_BYTES = 4 << 20  # ... or this much text, whichever comes first
QUEUE_DOCS = 4096  # tokenized documents buffered ahead of the training loop


@dataclass(frozen=True)
class Cursor:
    """Where the next training window starts: token `offset` of the train document at (file, row_group, row)
    in pass `epoch` over the source."""

    epoch: int = 0
    file: int = 0
    row_group: int = 0
    row: int = 0
    offset: int = 0


Doc = tuple[int, int, int, str]  # (file index, row group, row, text)


def _arrow():
    import pyarrow as pa
    import pyarrow.parquet as pq

    return pa, pq


def resolve_parquet_files(spec: str) -> list[Path]:
    """A Parquet file, a directory (every *.parquet below it) or a glob -> sorted absolute paths."""
    path = Path(spec).expanduser()
    if any(ch in spec for ch in "*?["):
        # absolute, not resolved: a match that is a symlink is named as matched, not by its target
        files = sorted(
            Path(os.path.abspath(p)) for p in glob.glob(str(path), recursive=True) if Path(p).is_file()
        )
        if not files:
            raise UserError(f"data.path={spec}: the glob matches no files")
        return files
    if not path.exists():
        raise UserError(f"data.path={spec}: no such file or directory")
    if path.is_dir():
        files = sorted(Path(os.path.abspath(p)) for p in path.rglob("*.parquet") if p.is_file())
        if not files:
            raise UserError(f"data.path={spec}: the directory holds no *.parquet files")
        return files
    return [Path(os.path.abspath(path))]


class ParquetSource:
    """Documents of local Parquet files in (sorted file, row group, row) order; empty/null texts skipped."""

    kind = "parquet"

    def __init__(self, spec: str, text_field: str):
        self.files = resolve_parquet_files(spec)
        self.text_field = text_field
        self.row_groups: list[int] = []
        rows = 0
        for path in self.files:
            meta = open_parquet(path, text_field, "data.text_field")
            self.row_groups.append(meta.num_row_groups)
            rows += meta.metadata.num_rows
        # content identity (trmoe.data.identity): hashed once per launch and recorded; a resume compares
        # them (data_info.stream.files) and the data cursor checks the fingerprint made of them
        self.hashes = [file_sha256(p) for p in self.files]
        self.info = {
            "kind": self.kind,
            "path": spec,
            "paths": [str(p) for p in self.files],  # where they are now (volatile: they may move)
            "files": [
                {"bytes": p.stat().st_size, "sha256": h, "row_groups": n}
                for p, h, n in zip(self.files, self.hashes, self.row_groups, strict=True)
            ],
            "rows": rows,
            "text_field": text_field,
        }
        listing = "\n".join(f"{h}:{n}" for h, n in zip(self.hashes, self.row_groups, strict=True))
        self.fingerprint = hashlib.sha256(listing.encode()).hexdigest()

    def file_name(self, index: int) -> str:
        """The file's identity in a data cursor: its content (a moved or renamed copy is the same file)."""
        return f"sha256:{self.hashes[index][:16]}"

    def documents(self, start: Cursor = Cursor()) -> Iterator[Doc]:
        pa, pq = _arrow()
        for fi in range(start.file, len(self.files)):
            path = self.files[fi]
            first_group = start.row_group if fi == start.file else 0
            try:
                handle = pq.ParquetFile(path)
                for rg in range(first_group, handle.num_row_groups):
                    column = handle.read_row_group(rg, columns=[self.text_field]).column(0).to_pylist()
                    first_row = start.row if (fi, rg) == (start.file, start.row_group) else 0
                    for row in range(first_row, len(column)):
                        if column[row]:
                            yield fi, rg, row, column[row]
            except (pa.ArrowException, OSError) as exc:
                raise UserError(f"parquet file {path}: unreadable ({first_line(exc)})") from None


class HubSource:
    """Documents of a Hugging Face hub dataset, streamed with the `datasets` library (optional extra `hf`).
    Coordinates are (0, 0, document index); a resume skips that many documents."""

    kind = "hub"

    def __init__(self, name: str, subset: str | None, revision: str | None, split: str, text_field: str):
        try:
            import datasets  # noqa: F401
        except ImportError:
            raise UserError(
                f"data.hf_dataset={name}: the Hugging Face `datasets` package is not installed; "
                "pip install 'trmoe[hf]', or download the Parquet files and set data.path"
            ) from None
        self.name, self.subset, self.revision, self.split = name, subset, revision, split
        self.text_field = text_field
        first = next(iter(self._open()), None)
        if first is None:
            raise UserError(f"data.hf_dataset={name}: split {split!r} is empty")
        if text_field not in first:
            raise UserError(
                f"data.hf_dataset={name}: no field {text_field!r} (data.text_field); "
                f"allowed: {', '.join(first)}"
            )
        self.info = {
            "kind": self.kind,
            "dataset": name,
            "subset": subset,
            "revision": revision,
            "split": split,
        }
        self.info["text_field"] = text_field
        self.fingerprint = hashlib.sha256(f"{name}:{subset}:{revision}:{split}".encode()).hexdigest()

    def _open(self):
        import datasets

        try:
            return datasets.load_dataset(
                self.name, self.subset, revision=self.revision, split=self.split, streaming=True
            )
        except Exception as exc:  # the library raises many kinds; all mean "cannot open it here"
            raise UserError(
                f"data.hf_dataset={self.name}: cannot open it ({type(exc).__name__}: {first_line(exc)}); "
                "offline? download the Parquet files and set data.path"
            ) from None

    def file_name(self, index: int) -> str:
        return self.name

    def documents(self, start: Cursor = Cursor()) -> Iterator[Doc]:
        stream = self._open()
        if start.row:
            stream = stream.skip(start.row)
        try:
            for row, example in enumerate(stream, start=start.row):
                text = example.get(self.text_field)
                if text:
                    yield 0, 0, row, text
        except UserError:
            raise
        except Exception as exc:
            raise UserError(
                f"data.hf_dataset={self.name}: streaming failed ({type(exc).__name__}: {first_line(exc)})"
            ) from None


def _chunks(docs: Iterator[Doc]) -> Iterator[list[Doc]]:
    chunk: list[Doc] = []
    size = 0
    for doc in docs:
        chunk.append(doc)
        size += len(doc[3])
        if len(chunk) >= CHUNK_DOCS or size >= CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def split_stream_tokens(
    source, want_eval: bool, max_tokens: int, eval_fraction: float, split_seed: int
) -> tuple[np.ndarray, int]:
    """The first `max_tokens` tokens of the train (want_eval=False) or held-out stream, read from the start in
    this process (one pass, no wrap-around); fewer if the source ends. Returns (ids int64, documents)."""
    pieces, total, documents = [], 0, 0
    for chunk in _chunks(source.documents()):
        which = "eval" if want_eval else "train"
        is_eval, _, lengths, ids = encode_documents([d[3] for d in chunk], eval_fraction, split_seed, which)
        ends = np.cumsum(lengths)
        for i in np.flatnonzero(is_eval == want_eval):
            pieces.append(ids[ends[i] - lengths[i] : ends[i]])
            total += int(lengths[i])
            documents += 1
            if total >= max_tokens:
                return np.concatenate(pieces)[:max_tokens].astype(np.int64), documents
    return (np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(0, np.int64)), documents


class _Producer(threading.Thread):
    """Background thread: reads documents from a start position, tokenizes them (in worker processes when
    workers > 0) and queues (position, ids) of the train documents in order, pass after pass."""

    def __init__(self, source, start: Cursor, eval_fraction: float, split_seed: int, workers: int):
        super().__init__(daemon=True, name="trmoe-data-stream")
        self.source, self.start_at = source, start
        self.eval_fraction, self.split_seed, self.workers = eval_fraction, split_seed, workers
        self.out: queue.Queue = queue.Queue(maxsize=QUEUE_DOCS)
        self.stop_event = threading.Event()
        self.pool = None

    def _put(self, item) -> bool:
        while not self.stop_event.is_set():
            try:
                self.out.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def run(self) -> None:
        try:
            self.pool = make_pool(self.workers)
            start = self.start_at
            while True:
                full_pass = (start.file, start.row_group, start.row) == (0, 0, 0)
                produced = False
                tasks = (
                    (
                        [d[:3] for d in chunk],
                        ([d[3] for d in chunk], self.eval_fraction, self.split_seed, "train"),
                    )
                    for chunk in _chunks(self.source.documents(start))
                )
                in_flight = 2 * max(self.workers, 1) + 2
                for coords, (is_eval, _, lengths, ids) in ordered_map(
                    self.pool, encode_documents, tasks, in_flight
                ):
                    ends = np.cumsum(lengths)
                    for i in np.flatnonzero(~is_eval):
                        produced = True
                        if not self._put(
                            (Cursor(start.epoch, *coords[i]), ids[ends[i] - lengths[i] : ends[i]])
                        ):
                            return
                if full_pass and not produced:
                    raise UserError(
                        f"data stream {self.source.info.get('path') or self.source.info.get('dataset')}: "
                        "holds no training documents (all empty or held out; lower data.eval_fraction)"
                    )
                start = Cursor(epoch=start.epoch + 1)  # the end of the data: the next pass starts over
        except BaseException as exc:  # handed to the consumer, which raises it in the training loop
            self._put(exc)
        finally:
            if self.pool is not None:
                self.pool.close()

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=10)


class StreamWindows:
    """The training windows of a streamed source. `batch(first, count)` returns samples first..first+count-1
    (int64 [count, seq_len] inputs and targets); reading forward skips windows cheaply (other ranks' samples),
    reading backwards restarts from the last loaded cursor (or the beginning)."""

    def __init__(self, source, seq_len: int, eval_fraction: float, split_seed: int, workers: int):
        self.source, self.seq_len = source, int(seq_len)
        self.eval_fraction, self.split_seed, self.workers = eval_fraction, split_seed, int(workers)
        self.num_windows = None  # unbounded: the stream wraps around to a new pass at its end
        self._origin: tuple[int, Cursor] = (0, Cursor())
        self._producer: _Producer | None = None
        self._reset(*self._origin)

    # ----------------------------------------------------------------------------------- position / cursor

    def _reset(self, sample: int, cursor: Cursor) -> None:
        self.close()
        self._next_sample = sample
        self._start = cursor
        self._segments: collections.deque = collections.deque()  # (Cursor of the document, ids)
        self._offset = cursor.offset  # into _segments[0]
        self._available = 0  # tokens from the window start to the end of the loaded segments

    def cursor(self) -> Cursor:
        """Position of the next window's first token."""
        if not self._segments:
            return self._start
        doc = self._segments[0][0]
        return Cursor(doc.epoch, doc.file, doc.row_group, doc.row, self._offset)

    def state_dict(self) -> dict[str, Any]:
        cursor = self.cursor()
        return {
            "next_sample": self._next_sample,
            "cursor": {**asdict(cursor), "file_name": self.source.file_name(cursor.file)},
            "source_fingerprint": self.source.fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            c = state["cursor"]
            cursor = Cursor(
                int(c["epoch"]), int(c["file"]), int(c["row_group"]), int(c["row"]), int(c["offset"])
            )
            sample, fingerprint, file_name = (
                int(state["next_sample"]),
                state["source_fingerprint"],
                c["file_name"],
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"data cursor: malformed stream state ({exc!r})") from None
        if fingerprint != self.source.fingerprint:
            raise UserError(
                "data cursor: the stream's source files differ from the checkpoint's (names, sizes or row "
                "groups changed); resume needs the same data"
            )
        if file_name != self.source.file_name(cursor.file):
            raise UserError(
                f"data cursor: file {cursor.file} is {self.source.file_name(cursor.file)}, not {file_name}"
            )
        self._origin = (sample, cursor)
        self._reset(sample, cursor)

    # ----------------------------------------------------------------------------------------------- reading

    def _pull(self) -> None:
        if self._producer is None:
            self._producer = _Producer(
                self.source, self._start, self.eval_fraction, self.split_seed, self.workers
            )
            self._producer.start()
        item = self._producer.out.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        position, ids = item
        if (
            not self._segments
        ):  # the first document after a (re)start: the cursor names it, or a point before it
            start = self._start
            exact = (position.epoch, position.file, position.row_group, position.row) == (
                start.epoch,
                start.file,
                start.row_group,
                start.row,
            )
            if (not exact and self._offset) or self._offset > len(ids):
                raise UserError(
                    f"data cursor: {start} is not a position in a training document of this source"
                )
            self._available = len(ids) - self._offset
        else:
            self._available += len(ids)
        self._segments.append((position, ids))

    def _advance(self, tokens: int) -> None:
        """Move the window start forward by `tokens` tokens, dropping the documents left behind."""
        while self._available < tokens or not self._segments:
            self._pull()
        self._offset += tokens
        self._available -= tokens
        while self._offset >= len(self._segments[0][1]) and len(self._segments) > 1:
            self._offset -= len(self._segments.popleft()[1])

    def _window(self) -> np.ndarray:
        """The seq_len + 1 tokens from the window start (the start does not move)."""
        need = self.seq_len + 1
        while self._available < need:
            self._pull()
        parts, got, offset = [], 0, self._offset
        for _, ids in self._segments:
            part = ids[offset : offset + need - got]
            parts.append(part)
            got += len(part)
            offset = 0
            if got == need:
                break
        return np.concatenate(parts)

    def batch(self, first_sample: int, count: int):
        import torch

        first_sample, count = int(first_sample), int(count)
        if first_sample < 0 or count < 0:
            raise ValueError(f"first_sample and count must be >= 0, got {first_sample}, {count}")
        if first_sample < self._next_sample:
            self._reset(*(self._origin if self._origin[0] <= first_sample else (0, Cursor())))
        if first_sample > self._next_sample:
            self._advance((first_sample - self._next_sample) * self.seq_len)
            self._next_sample = first_sample
        windows = np.empty((count, self.seq_len + 1), dtype=np.int64)
        for row in range(count):
            windows[row] = self._window()
            self._advance(self.seq_len)
            self._next_sample += 1
        out = torch.from_numpy(windows)
        return out[:, :-1].contiguous(), out[:, 1:].contiguous()

    def close(self) -> None:
        if self._producer is not None:
            self._producer.stop()
            self._producer = None

    def __del__(self) -> None:  # a dropped reader must not leave its thread (and worker processes) running
        producer = getattr(self, "_producer", None)
        if producer is not None:
            producer.stop_event.set()
