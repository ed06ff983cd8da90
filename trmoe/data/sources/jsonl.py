"""data=jsonl: documents from local JSON Lines files (data.path: a file, a folder of *.jsonl files or a glob),
one JSON object per line, the text in its field data.text_field; tokenized in memory (tokenizer=) and split
by the content hash of each document, as data=text (or a held-out JSONL file, data.jsonl_eval_path)."""

from __future__ import annotations

import glob
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trmoe.data.variant import DataSourceVariant, fail
from trmoe.errors import UserError

if TYPE_CHECKING:
    from trmoe.config.schema import Config
    from trmoe.data.corpus import Corpus
    from trmoe.data.pipeline import DataPipeline
    from trmoe.data.tokenizer import Tokenizer


@dataclass
class JsonlOptions:
    jsonl_eval_path: str | None = None  # jsonl: held-out JSONL file, folder or glob; None = by document hash


def jsonl_files(spec: str, key: str) -> list[Path]:
    """The JSON Lines files of `spec`: one file, every *.jsonl below a folder, or a glob's files; sorted."""
    if any(ch in spec for ch in "*?["):
        files = sorted(Path(os.path.abspath(p)) for p in glob.glob(os.path.expanduser(spec), recursive=True))
        files = [p for p in files if p.is_file()]
        if not files:
            raise UserError(f"{key}={spec}: the glob matches no files")
        return files
    path = Path(spec).expanduser().resolve()
    if not path.exists():
        raise UserError(f"{key}={spec}: no such file or directory")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.jsonl") if p.is_file())
        if not files:
            raise UserError(f"{key}={spec}: the directory holds no .jsonl files")
        return files
    return [path]


def documents(spec: str, text_field: str, key: str) -> tuple[list[tuple[str, str]], dict]:
    """(key, text) of every document of `spec`'s files in path order, and the files' paths and sha256s
    (apart: a file's place may change between a run's attempts, its content may not)."""
    from trmoe.data.prepare import jsonl_documents

    docs: list[tuple[str, str]] = []
    files = []
    for path in jsonl_files(spec, key):
        for text, _ in jsonl_documents(path, text_field, "data.text_field"):
            docs.append((str(len(docs)), text))
        files.append((str(path), hashlib.sha256(path.read_bytes()).hexdigest()))
    if not docs:
        raise UserError(f"{key}={spec}: holds no documents (no line with a non-empty {text_field!r})")
    return docs, {"paths": [p for p, _ in files], "sha256": [h for _, h in files]}


def load(d: Any, tok: Tokenizer | None = None) -> Corpus:
    """The corpus of data=jsonl's files, tokenized with `tok` (None: o200k_base)."""
    from trmoe.data.corpus import build_corpus
    from trmoe.data.tokenizer import load_tokenizer

    tok = tok if tok is not None else load_tokenizer()
    docs, files = documents(d.path, d.text_field, "data.path")
    info = {"source": "jsonl", "path": d.path, "files": files, "text_field": d.text_field}
    if d.jsonl_eval_path is None:
        return build_corpus(docs, d.eval_fraction, d.split_seed, f"jsonl:{d.path}", info, tok)
    held, held_files = documents(d.jsonl_eval_path, d.text_field, "data.jsonl_eval_path")
    return _separate(docs, held, f"jsonl:{d.path}", {**info, "eval_files": held_files}, tok)


def _separate(
    train: list[tuple[str, str]], held: list[tuple[str, str]], name: str, info: dict, tok: Tokenizer
) -> Corpus:
    """A corpus of two given splits (data.jsonl_eval_path): every document of the held-out files is
    held out, every one of data.path trains."""
    from trmoe.data.corpus import Corpus, _make_split

    content = hashlib.sha256()
    for part, docs in (("train", train), ("eval", held)):
        for key, text in docs:
            content.update(f"{part}{len(key)}:{key}{len(text)}:{text}".encode())
    a, b = _make_split([t for _, t in train], tok), _make_split([t for _, t in held], tok)
    info = {
        **info,
        "name": name,
        "documents_sha256": content.hexdigest(),
        "tokenizer": tok.name,
        "tokenizer_sha256": tok.sha256,
        "eos_id": tok.eos_id,
        "split": {"rule": "separate files: data.path trains, data.jsonl_eval_path is held out"},
        "train": {"documents": a.documents, "tokens": int(a.tokens.size), "bytes": a.bytes},
        "eval": {"documents": b.documents, "tokens": int(b.tokens.size), "bytes": b.bytes},
    }
    return Corpus(name=name, train=a, eval=b, info=info)


def build(cfg: Config, vocab_size: int, world_size: int = 1) -> DataPipeline:
    from trmoe.data.build import corpus_pipeline, require_text_vocab

    tok = require_text_vocab(cfg, vocab_size)
    return corpus_pipeline(cfg, load(cfg.data, tok), tok)


def validate(d: Any, where: str = "data") -> None:
    if not d.path:
        allowed = "data=jsonl needs a JSON Lines file, folder or glob: data.path=docs.jsonl"
        fail(f"{where}.path", d.path, allowed)


VARIANT = DataSourceVariant(
    "jsonl", build=build, options=JsonlOptions, validate=validate, exclusive=("path", "jsonl_eval_path"),
    doc="local JSON Lines files (`data.path`: a file, folder or glob), the text in `data.text_field`",
    mixture_keys=("path", "text_field"), inherit=("text_field",), example=("data.path=docs.jsonl",),
    split="document content hash (or `data.jsonl_eval_path`)",
    sample="window of a seeded permutation (or sequential)",
)  # fmt: skip
