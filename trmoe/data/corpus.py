"""Documents -> train/eval token arrays.

Documents are assigned to a split by a stable rule on their own text (a seeded sha256), never by their
position in a file or token stream, so reordering or appending documents never moves a document across splits.
Each split is the concatenation of its documents' tokens (o200k_base, or the run's tokenizer=bpe) with EOS
after every document.
"""

from __future__ import annotations

import functools
import hashlib
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trmoe.data.tokenizer import Tokenizer, load_tokenizer
from trmoe.errors import UserError

SOURCES = ("embedded", "text")
_BUCKETS = 1_000_000
SPLIT_RULE = "eval iff int(sha256(f'{split_seed}:{text}')) % 1000000 < eval_fraction * 1000000"

# A line break followed by one or more empty / whitespace-only lines (each ending in a line break; a \r is
# whitespace like any other, so CRLF and doubled "\r\r\n" endings split as `prepare` splits them: a line
# is blank when it strips to nothing). The pieces are stripped, which takes the \r before a break too.
_BLANK_LINES = re.compile(r"\n(?:[^\S\n]*\n)+")


@dataclass
class Split:
    tokens: np.ndarray  # 1-D int32 token ids, documents joined with EOS after each document (read-only)
    documents: int  # number of documents
    bytes: int  # total UTF-8 bytes of the documents' text


@dataclass
class Corpus:
    name: str  # "embedded", "text:<abs path>", "random"
    train: Split
    eval: Split
    info: dict  # JSON-serialisable description for run records


def embedded_documents() -> list[tuple[str, str]]:
    """(key, text) pairs of a real English corpus shipped with every CPython: the help topics in
    `pydoc_data.topics.topics` (dict topic-name -> text), in sorted key order."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # pragma: no cover - part of the standard library
        raise UserError(
            "data.source=embedded: this Python lacks the standard module pydoc_data.topics; "
            "use data.source=text with data.text_path"
        ) from None
    return [(key, topics[key]) for key in sorted(topics)]


def text_file_documents(path: str | Path, separator: str | None = None) -> list[tuple[str, str]]:
    """Documents of a local UTF-8 file: split on `separator` if given, else on blank lines (one or more
    empty/whitespace-only lines); strip each; drop empty ones; key = f"{index}"."""
    path = Path(path)
    if separator is not None and separator == "":
        raise UserError(
            f"data.separator for {path}: must be a non-empty string (or unset to split on blank lines)"
        )
    if not path.exists():
        raise UserError(f"text file {path}: no such file")
    if not path.is_file():
        raise UserError(f"text file {path}: not a regular file")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise UserError(f"text file {path}: cannot read ({exc.strerror or exc})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(
            f"text file {path}: not valid UTF-8 (byte 0x{raw[exc.start]:02x} at byte offset {exc.start}: "
            f"{exc.reason})"
        ) from None
    text = text.removeprefix("\ufeff")
    pieces = text.split(separator) if separator is not None else _BLANK_LINES.split(text)
    stripped = [piece.strip() for piece in pieces]
    documents = [(str(index), doc) for index, doc in enumerate(d for d in stripped if d)]
    if not documents:
        how = f"separator {separator!r}" if separator is not None else "blank lines"
        raise UserError(f"text file {path}: contains no documents (empty or whitespace only; split on {how})")
    return documents


def _document_hash(text: str, split_seed: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{split_seed}:{text}".encode()).digest(), "big")


def is_eval_document(key: str, text: str, eval_fraction: float, split_seed: int) -> bool:
    """Stable rule on the document itself: sha256(f"{split_seed}:{text}") read as an integer,
    mod 1_000_000 < eval_fraction * 1_000_000. Never depends on position in a token stream."""
    return _document_hash(text, split_seed) % _BUCKETS < eval_fraction * _BUCKETS


def _tokenize(texts: list[str], tok: Tokenizer) -> np.ndarray:
    encoded = tok.encode_ordinary_batch(texts) if texts else []
    flat: list[int] = []
    for ids in encoded:
        flat.extend(ids)
        flat.append(tok.eos_id)
    tokens = np.asarray(flat, dtype=np.int32)
    tokens.flags.writeable = False
    return tokens


def _make_split(texts: list[str], tok: Tokenizer) -> Split:
    return Split(
        tokens=_tokenize(texts, tok),
        documents=len(texts),
        bytes=sum(len(t.encode("utf-8")) for t in texts),
    )


def _check_fraction(eval_fraction: float) -> None:
    if not isinstance(eval_fraction, (int, float)) or isinstance(eval_fraction, bool):
        raise UserError(f"data.eval_fraction: must be a number in (0, 1), got {eval_fraction!r}")
    if not 0.0 < float(eval_fraction) < 1.0:
        raise UserError(f"data.eval_fraction: must be in (0, 1) (exclusive), got {eval_fraction!r}")


def build_corpus(
    documents: Sequence[tuple[str, str]],
    eval_fraction: float,
    split_seed: int,
    name: str,
    info: dict,
    tokenizer: Tokenizer | None = None,
) -> Corpus:
    """Split documents by `is_eval_document`, tokenize each split (documents in order, EOS after each) and
    return the Corpus. If the rule leaves one split empty, the document text with the smallest hash moves over
    (all copies of it), which is recorded in `info["split"]["moved"]`. `tokenizer`: None = o200k_base."""
    _check_fraction(eval_fraction)
    tok = tokenizer if tokenizer is not None else load_tokenizer()
    documents = list(documents)
    if len(documents) < 2:
        raise UserError(
            f"corpus {name}: has {len(documents)} document(s); need at least 2 (one for train, one for eval)"
        )
    hashes = [_document_hash(text, split_seed) for _, text in documents]
    is_eval = [h % _BUCKETS < eval_fraction * _BUCKETS for h in hashes]
    moved = None
    if all(is_eval) or not any(is_eval):
        to_eval = not any(is_eval)  # eval is empty: move a train document to eval, else the reverse
        smallest = min(hashes)
        moved_keys = [key for (key, _), h in zip(documents, hashes, strict=True) if h == smallest]
        is_eval = [to_eval if h == smallest else e for h, e in zip(hashes, is_eval, strict=True)]
        moved = {
            "to": "eval" if to_eval else "train",
            "keys": moved_keys,
            "reason": f"the split rule left the {'eval' if to_eval else 'train'} split empty; moved the "
            "document with the smallest sha256",
        }
        if all(is_eval) or not any(is_eval):
            raise UserError(
                f"corpus {name}: all {len(documents)} documents have identical text; cannot form both "
                "a train and an eval split"
            )
    train_texts = [text for (_, text), e in zip(documents, is_eval, strict=True) if not e]
    eval_texts = [text for (_, text), e in zip(documents, is_eval, strict=True) if e]
    train, evaluation = _make_split(train_texts, tok), _make_split(eval_texts, tok)
    for split_name, split in (("train", train), ("eval", evaluation)):
        if split.tokens.size < 2:
            raise UserError(
                f"corpus {name}: the {split_name} split has {split.tokens.size} token(s); need at least 2"
            )
    content = hashlib.sha256()
    for key, text in documents:
        content.update(f"{len(key)}:{key}{len(text)}:{text}".encode())
    full_info = dict(info)
    full_info.update(
        {
            "name": name,
            "documents_sha256": content.hexdigest(),
            "tokenizer": tok.name,
            "tokenizer_sha256": tok.sha256,
            "eos_id": tok.eos_id,
            "split": {
                "rule": SPLIT_RULE,
                "eval_fraction": float(eval_fraction),
                "split_seed": int(split_seed),
                "moved": moved,
            },
            "train": {"documents": train.documents, "tokens": int(train.tokens.size), "bytes": train.bytes},
            "eval": {
                "documents": evaluation.documents,
                "tokens": int(evaluation.tokens.size),
                "bytes": evaluation.bytes,
            },
        }
    )
    return Corpus(name=name, train=train, eval=evaluation, info=full_info)


@functools.lru_cache(maxsize=8)
def _embedded_corpus(eval_fraction: float, split_seed: int, tok: Tokenizer) -> Corpus:
    info = {
        "source": "embedded",
        "path": None,
        "origin": "pydoc_data.topics.topics (CPython help topics), sorted by key",
        "python_version": sys.version.split()[0],
    }
    return build_corpus(embedded_documents(), eval_fraction, split_seed, "embedded", info, tok)


def load_corpus(
    source: str,
    *,
    text_path: str | None = None,
    separator: str | None = None,
    eval_fraction: float = 0.1,
    split_seed: int = 0,
    tokenizer: Tokenizer | None = None,
) -> Corpus:
    """Load and tokenize a corpus (with `tokenizer`; None = o200k_base). source "embedded" (CPython help
    topics; cached in-process, so the returned Corpus and its read-only arrays are shared and must not be
    mutated) or "text" (`text_path`, resolved against the current working directory)."""
    _check_fraction(eval_fraction)
    if source == "embedded":
        # (the tokenizer objects are cached per file version: one key per tokenizer file's content)
        return _embedded_corpus(float(eval_fraction), int(split_seed), tokenizer or load_tokenizer())
    if source == "text":
        if not text_path:
            raise UserError("data.text_path: required when data.source=text (path to a UTF-8 text file)")
        path = Path(text_path).expanduser().resolve()
        documents = text_file_documents(path, separator)
        info = {
            "source": "text",
            "path": str(path),
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "separator": separator if separator is not None else "blank lines",
        }
        return build_corpus(documents, eval_fraction, split_seed, f"text:{path}", info, tokenizer)
    raise UserError(f"data.source: must be one of {', '.join(SOURCES)}, got {source!r}")
