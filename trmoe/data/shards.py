"""Token shards: a directory holding `tokens.bin` (flat little-endian token ids) and `tokens.idx.json`.

The format is specified in docs/data.md; shards of the runner trmoe replaces (format
"complexity-token-shard-v1": the same tokens.bin, another index) are read too. A shard is read by memory
map (no copy into RAM; opening it costs the same for 1 MB and 100 GB), written as hidden `.*.partial` files
that are renamed only when complete (index last; trmoe.durable), and checked on load: format and version,
dtype, byte size = num_tokens x itemsize, token ids against the vocab; `verify_shard` also re-hashes the file
and rescans the ids.

Content identity without data.verify (`sample_sha256`): a tokens.bin of at most SAMPLE_WHOLE bytes is hashed
whole at every open and must match its index's sha256; a larger one is identified by the sha256 of
SAMPLE_BLOCKS blocks of SAMPLE_BLOCK bytes at evenly spaced offsets (the first and the last included), which
a run records and a resume compares. Reading SAMPLE_BLOCKS x SAMPLE_BLOCK = 16 MiB costs a fraction of a
second at any size; an edit of a large shard outside those blocks is caught by data.verify=true only.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trmoe.data.identity import file_sha256
from trmoe.durable import AtomicFile, json_text, partial_path, write_file
from trmoe.errors import UserError

# the training split's token frequencies, by the dataset's train/ and eval/ (trmoe.data.prepare writes it)
TOKEN_COUNTS_NAME = "token_counts.npy"

FORMAT = "trmoe-token-shard"
VERSION = 1
LEGACY_FORMAT = "complexity-token-shard-v1"  # the previous runner's index over the same tokens.bin layout
BIN_NAME = "tokens.bin"
INDEX_NAME = "tokens.idx.json"
PARTITIONS = ("train", "eval")
DTYPES = {"<u2": 65_536, "<u4": 2**32}  # dtype -> ids it can hold (exclusive upper bound)
_READ_CHUNK = 1 << 24  # bytes per read when hashing / scanning a tokens.bin
SAMPLE_WHOLE = 1 << 25  # tokens.bin up to 32 MiB: hashed whole at open, checked against the index
SAMPLE_BLOCKS, SAMPLE_BLOCK = 256, 1 << 16  # a larger one: 256 blocks of 64 KiB (16 MiB) identify it

# Index fields every shard must have, and their JSON types.
REQUIRED_FIELDS: dict[str, type | tuple[type, ...]] = {
    "format": str,
    "version": int,
    "bin": str,
    "dtype": str,
    "num_tokens": int,
    "max_token_id": int,
    "vocab_size": int,
    "eos_id": (int, type(None)),
    "tokenizer": str,
    "tokenizer_sha256": (str, type(None)),
    "sha256": str,
    "partition": str,
    "documents": int,
    "text_bytes": int,
    "source": dict,
}


# The legacy index's fields and their types; the rest of a trmoe index is derived (`_from_legacy`).
_LEGACY_FIELDS: dict[str, type] = {
    "bin": str,
    "dtype": str,
    "num_tokens": int,
    "max_token_id": int,
    "vocab_size": int,
    "tokenizer": str,
    "sha256": str,
}
_LEGACY_SOURCE = ("source_repo", "source_revision", "source_subset", "source_files", "eval_document_rule")


def dtype_for_vocab(vocab_size: int) -> str:
    """uint16 when every id < vocab_size fits (vocab_size <= 65,536), else uint32."""
    if vocab_size < 1 or vocab_size > DTYPES["<u4"]:
        raise ValueError(f"vocab_size must be in [1, 2**32], got {vocab_size}")
    return "<u2" if vocab_size <= DTYPES["<u2"] else "<u4"


@dataclass
class TokenShard:
    directory: Path  # resolved shard directory
    index: dict[str, Any]  # the parsed tokens.idx.json
    tokens: np.ndarray  # read-only np.memmap over tokens.bin, shape [num_tokens]
    verified: bool  # True when verify_shard re-hashed the file in this process
    sample_sha256: str = ""  # the content identity read at open (sample_sha256)

    @property
    def bin_path(self) -> Path:
        return self.directory / self.index["bin"]

    def fingerprint(self) -> dict[str, Any]:
        """What run records store about the shard: enough to tell whether a resume reads the same data."""
        keys = (
            "sha256",
            "num_tokens",
            "dtype",
            "vocab_size",
            "max_token_id",
            "tokenizer",
            "tokenizer_sha256",
        )
        fp: dict[str, Any] = {"path": str(self.directory), **{k: self.index[k] for k in keys}}
        fp["sample_sha256"] = self.sample_sha256  # what was read at open: an edit in place changes it
        fp.update(partition=self.index["partition"], documents=self.index["documents"])
        fp.update(text_bytes=self.index["text_bytes"])
        if "converted_from" in self.index:  # a legacy shard: what its own index said of its origin
            fp.update(converted_from=self.index["converted_from"], source=self.index["source"])
        return fp


def _fail(path: Path, problem: str) -> UserError:
    return UserError(f"token shard {path}: {problem}")


def read_index(directory: str | Path) -> dict[str, Any]:
    """Parse and check tokens.idx.json (not the bin file). Every problem is a UserError naming the file."""
    directory = Path(directory)
    if not directory.exists():
        raise _fail(directory, "no such directory")
    if not directory.is_dir():
        raise _fail(directory, f"not a directory (a shard is a directory with {BIN_NAME} and {INDEX_NAME})")
    path = directory / INDEX_NAME
    if not path.is_file():
        raise _fail(path, "missing (not a token shard, or preparation did not finish)")
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise _fail(path, f"cannot read ({exc})") from None
    except json.JSONDecodeError as exc:
        raise _fail(
            path, f"malformed JSON ({exc.msg.removesuffix(' at')} at line {exc.lineno} column {exc.colno})"
        ) from None
    if not isinstance(index, dict):
        raise _fail(path, "malformed: the top level must be a JSON object")
    if index.get("format") == LEGACY_FORMAT:
        index = _from_legacy(index, path)
    if index.get("format") != FORMAT:
        raise _fail(path, f"format is {index.get('format')!r}; allowed: {FORMAT!r}, {LEGACY_FORMAT!r}")
    if index.get("version") != VERSION:
        raise _fail(path, f"version is {index.get('version')!r}; this trmoe reads version {VERSION}")
    for key, kind in REQUIRED_FIELDS.items():
        if key not in index:
            raise _fail(path, f"field {key!r} is missing")
        value = index[key]
        wants_int = kind is int or (isinstance(kind, tuple) and int in kind)
        if not isinstance(value, kind) or (isinstance(value, bool) and wants_int):
            raise _fail(path, f"field {key!r} has the wrong type ({type(value).__name__})")
    if index["dtype"] not in DTYPES:
        raise _fail(path, f"dtype is {index['dtype']!r}; allowed: {', '.join(DTYPES)}")
    if index["vocab_size"] > DTYPES[index["dtype"]]:
        raise _fail(path, f"dtype {index['dtype']} cannot hold ids of vocab_size {index['vocab_size']}")
    if index["partition"] not in PARTITIONS:
        raise _fail(path, f"partition is {index['partition']!r}; allowed: {', '.join(PARTITIONS)}")
    if os.sep in index["bin"] or "/" in index["bin"] or index["bin"] in ("", ".", ".."):
        raise _fail(path, f"bin must be a file name inside the shard directory, got {index['bin']!r}")
    for key in ("num_tokens", "documents", "text_bytes"):
        if index[key] < 0:
            raise _fail(path, f"field {key!r} is negative ({index[key]})")
    if index["num_tokens"] == 0:
        raise _fail(path, "holds no tokens (num_tokens is 0)")
    if not 0 <= index["max_token_id"] < index["vocab_size"]:
        raise _fail(
            path, f"max_token_id {index['max_token_id']} is outside the vocab [0, {index['vocab_size']})"
        )
    return index


def _from_legacy(legacy: dict[str, Any], path: Path) -> dict[str, Any]:
    """A trmoe index for a shard the previous runner wrote: its fields, EOS from `eos_token_id`, partition
    `train` unless it names one, text bytes 0 (unknown; bits per byte come from the decoded held-out
    batches anyway, for an o200k_base shard), and its tokenizer hash kept
    in `source` only: it hashed a tokenizer directory, not the rank file trmoe checks (`converted_from`
    tells the reader not to compare it)."""
    for key, kind in _LEGACY_FIELDS.items():
        if not isinstance(legacy.get(key), kind) or isinstance(legacy.get(key), bool):
            raise _fail(path, f"{LEGACY_FORMAT} index: field {key!r} is missing or not a {kind.__name__}")
    eos, documents = legacy.get("eos_token_id"), legacy.get("documents", 0)
    source = {k: legacy[k] for k in _LEGACY_SOURCE if k in legacy}
    if "tokenizer_sha256" in legacy:
        source["tokenizer_dir_sha256"] = legacy["tokenizer_sha256"]
    return {
        **{key: legacy[key] for key in _LEGACY_FIELDS},
        "format": FORMAT,
        "version": VERSION,
        "converted_from": LEGACY_FORMAT,
        "eos_id": eos if isinstance(eos, int) and not isinstance(eos, bool) else None,
        "tokenizer_sha256": None,
        "partition": legacy.get("partition", "train"),
        "documents": documents if isinstance(documents, int) and eos is not None else 0,
        "text_bytes": 0,
        "source": source,
    }


def open_shard(directory: str | Path, *, verify: bool = False) -> TokenShard:
    """Open a shard by memory map after checking its index and byte size; with verify=True also re-hash
    tokens.bin and rescan its ids (reads the whole file once, in chunks: no RSS growth)."""
    directory = Path(directory).expanduser().resolve()
    index = read_index(directory)
    bin_path = directory / index["bin"]
    if not bin_path.is_file():
        raise _fail(bin_path, "missing (the index names it, but there is no such file)")
    itemsize = np.dtype(index["dtype"]).itemsize
    expected = index["num_tokens"] * itemsize
    actual = bin_path.stat().st_size
    if actual != expected:
        what = "truncated" if actual < expected else "longer than the index says"
        raise _fail(
            bin_path,
            f"{what}: {actual:,} bytes, expected num_tokens x itemsize = {index['num_tokens']:,} x "
            f"{itemsize} "
            f"= {expected:,} (dtype {index['dtype']}); re-run the prepare tool",
        )
    if verify:
        verify_shard(directory, index=index)
    sample = sample_sha256(bin_path, actual)
    if actual <= SAMPLE_WHOLE and sample != index["sha256"]:
        raise _fail(
            bin_path,
            f"its sha256 {sample[:16]}... does not match the index's {index['sha256'][:16]}...: the tokens "
            "changed after the shard was written (edited in place?); re-run the prepare tool",
        )
    tokens = np.memmap(bin_path, dtype=np.dtype(index["dtype"]), mode="r", shape=(index["num_tokens"],))
    return TokenShard(directory=directory, index=index, tokens=tokens, verified=verify, sample_sha256=sample)


def sample_sha256(path: Path, size: int) -> str:
    """The shard's content identity (module docstring): sha256 of the whole file up to SAMPLE_WHOLE bytes,
    else of SAMPLE_BLOCKS blocks of SAMPLE_BLOCK bytes at offsets i x (size - SAMPLE_BLOCK) / (SAMPLE_BLOCKS
    - 1)."""
    if size <= SAMPLE_WHOLE:
        return file_sha256(path)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for i in range(SAMPLE_BLOCKS):
            f.seek(i * (size - SAMPLE_BLOCK) // (SAMPLE_BLOCKS - 1))
            digest.update(f.read(SAMPLE_BLOCK))
    return digest.hexdigest()


def scan_bin(path: Path, dtype: str, eos_id: int | None) -> dict[str, Any]:
    """sha256, max id and EOS count of a tokens.bin, read in fixed-size chunks."""
    digest = hashlib.sha256()
    max_id, eos_count, num_tokens = -1, 0, 0
    itemsize = np.dtype(dtype).itemsize
    buffer = bytearray(_READ_CHUNK - _READ_CHUNK % itemsize)
    view = memoryview(buffer)
    with open(path, "rb") as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
            ids = np.frombuffer(buffer, dtype=dtype, count=n // itemsize)
            if ids.size:
                max_id = max(max_id, int(ids.max()))
                num_tokens += int(ids.size)
                if eos_id is not None:
                    eos_count += int(np.count_nonzero(ids == eos_id))
    return {
        "sha256": digest.hexdigest(),
        "max_token_id": max_id,
        "eos_count": eos_count,
        "num_tokens": num_tokens,
    }


def verify_shard(directory: str | Path, *, index: dict[str, Any] | None = None) -> dict[str, Any]:
    """Full check of a shard against its index: size, sha256, max id < vocab, documents = EOS count.
    Returns the scan; raises UserError naming the file on any mismatch."""
    directory = Path(directory).expanduser().resolve()
    index = index if index is not None else read_index(directory)
    bin_path = directory / index["bin"]
    if not bin_path.is_file():
        raise _fail(bin_path, "missing (the index names it, but there is no such file)")
    scan = scan_bin(bin_path, index["dtype"], index["eos_id"])
    if (
        scan["num_tokens"] != index["num_tokens"]
        or bin_path.stat().st_size % np.dtype(index["dtype"]).itemsize
    ):
        raise _fail(bin_path, f"holds {scan['num_tokens']:,} tokens, the index says {index['num_tokens']:,}")
    if scan["sha256"] != index["sha256"]:
        raise _fail(
            bin_path, f"sha256 {scan['sha256']} does not match the index ({index['sha256']}): corrupted"
        )
    if scan["max_token_id"] >= index["vocab_size"]:
        raise _fail(bin_path, f"holds token id {scan['max_token_id']} >= vocab_size {index['vocab_size']}")
    if scan["max_token_id"] != index["max_token_id"]:
        raise _fail(
            bin_path, f"max token id is {scan['max_token_id']}, the index says {index['max_token_id']}"
        )
    if index["eos_id"] is not None and index["documents"] and scan["eos_count"] != index["documents"]:
        raise _fail(
            bin_path,
            f"holds {scan['eos_count']} EOS tokens but the index counts {index['documents']} documents",
        )
    return scan


class ShardWriter:
    """Streams token ids to `<dir>/.tokens.bin.partial`; `close()` renames it to tokens.bin, then writes the
    index the same way (last, so a directory with tokens.idx.json always holds a complete shard)."""

    def __init__(
        self,
        directory: str | Path,
        *,
        vocab_size: int,
        tokenizer: str,
        tokenizer_sha256: str | None,
        partition: str,
        eos_id: int | None,
        source: dict[str, Any],
    ):
        if partition not in PARTITIONS:
            raise ValueError(f"partition must be one of {PARTITIONS}, got {partition!r}")
        self.directory = Path(directory)
        self.dtype = dtype_for_vocab(int(vocab_size))
        self.meta = {
            "vocab_size": int(vocab_size),
            "tokenizer": tokenizer,
            "tokenizer_sha256": tokenizer_sha256,
            "partition": partition,
            "eos_id": eos_id,
            "source": source,
        }
        self.directory.mkdir(parents=True, exist_ok=True)
        self._bin = AtomicFile(self.directory / BIN_NAME)
        self._sha = hashlib.sha256()
        self.num_tokens = 0
        self.max_token_id = -1
        self.documents = 0
        self.text_bytes = 0

    def append(self, ids: np.ndarray, documents: int = 0, text_bytes: int = 0) -> None:
        """Append ids (any integer dtype, each in [0, vocab_size)) and count the documents/bytes they hold."""
        ids = np.asarray(ids)
        if ids.size:
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.meta["vocab_size"]:
                raise ValueError(f"token ids must be in [0, {self.meta['vocab_size']}), got [{lo}, {hi}]")
            data = ids.astype(self.dtype, copy=False).tobytes()
            self._bin.file.write(data)
            self._sha.update(data)
            self.num_tokens += int(ids.size)
            self.max_token_id = max(self.max_token_id, hi)
        self.documents += int(documents)
        self.text_bytes += int(text_bytes)

    def close(self) -> dict[str, Any]:
        """Finish the shard; returns its index."""
        self._bin.commit()
        index = {
            "format": FORMAT,
            "version": VERSION,
            "bin": BIN_NAME,
            "dtype": self.dtype,
            "num_tokens": self.num_tokens,
            "max_token_id": self.max_token_id,
            "sha256": self._sha.hexdigest(),
            "documents": self.documents,
            "text_bytes": self.text_bytes,
            **self.meta,
        }
        write_file(self.directory / INDEX_NAME, json_text(index, indent=2, sort_keys=True) + "\n")
        return index

    def abort(self) -> None:
        """Remove the partial files (and the directory if it is then empty)."""
        self._bin.discard()
        partial_path(self.directory / INDEX_NAME).unlink(missing_ok=True)  # a killed run's
        try:
            self.directory.rmdir()
        except OSError:
            pass


def write_shard(directory: str | Path, tokens: np.ndarray, **meta: Any) -> dict[str, Any]:
    """Write a whole shard from an in-memory array (tests, small tools). `meta` as for ShardWriter, plus
    optional `documents` and `text_bytes`."""
    documents, text_bytes = meta.pop("documents", 0), meta.pop("text_bytes", 0)
    writer = ShardWriter(directory, **meta)
    try:
        writer.append(np.asarray(tokens), documents=documents, text_bytes=text_bytes)
    except BaseException:
        writer.abort()
        raise
    return writer.close()
