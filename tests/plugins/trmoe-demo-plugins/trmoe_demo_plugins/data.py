"""data=demo_lines: every non-empty line of a local UTF-8 file (`data.path`) is a document, o200k-tokenized
and split into training and held-out documents by trmoe's own rule (a stable hash of each document).

`build` returns the run's DataPipeline; trmoe.data.build's helpers do the shared part (the corpus's
pipeline, the vocabulary check), so a source only says where its documents come from and what identifies
them (`info`: recorded in run_config.json and checked at resume).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from trmoe.data.variant import DataSourceVariant, fail
from trmoe.errors import UserError


@dataclass
class LinesOptions:
    lines_min_chars: int = 1  # demo_lines: shorter lines are skipped


def _documents(path: str, min_chars: int) -> list[tuple[str, str]]:
    file = Path(path).expanduser()
    if not file.is_file():
        raise UserError(f"data.path={path}: no such file; allowed: a UTF-8 text file, one document a line")
    lines = [line.strip() for line in file.read_text(encoding="utf-8").splitlines()]
    return [(str(i), line) for i, line in enumerate(lines) if len(line) >= min_chars]


def build(cfg, vocab_size: int, world_size: int = 1):
    from trmoe.data.build import corpus_pipeline, require_o200k_vocab
    from trmoe.data.corpus import build_corpus

    d = cfg.data
    require_o200k_vocab(cfg, vocab_size)
    docs = _documents(d.path, d.lines_min_chars)
    sha256 = hashlib.sha256(Path(d.path).expanduser().read_bytes()).hexdigest()
    info = {"source": "demo_lines", "path": d.path, "sha256": sha256, "min_chars": d.lines_min_chars}
    return corpus_pipeline(cfg, build_corpus(docs, d.eval_fraction, d.split_seed, f"lines:{d.path}", info))


def validate(d, where: str = "data") -> None:
    if not d.path:
        fail(f"{where}.path", d.path, "data=demo_lines needs a text file: data.path=lines.txt")
    if d.lines_min_chars < 1:
        fail(f"{where}.lines_min_chars", d.lines_min_chars, "must be >= 1")


VARIANT = DataSourceVariant(
    name="demo_lines",
    build=build,
    doc="every non-empty line of a local UTF-8 file (`data.path`) is a document",
    options=LinesOptions,
    validate=validate,
    exclusive=("path",),  # it reads data.path (a key other sources read too)
    example=("data.path=lines.txt",),
    split="document content hash",
    sample="window of a seeded permutation (or sequential)",
)
