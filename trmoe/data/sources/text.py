"""data=text: a local UTF-8 file, documents separated by blank lines or data.separator."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trmoe.data.variant import DataSourceVariant, fail

if TYPE_CHECKING:
    from trmoe.config.schema import Config
    from trmoe.data.pipeline import DataPipeline


@dataclass
class TextOptions:
    text_path: str | None = None  # data=text: UTF-8 file, resolved against the launch directory
    separator: str | None = None  # data=text: document separator; None = one or more blank lines


def build(cfg: Config, vocab_size: int, world_size: int = 1) -> DataPipeline:
    from trmoe.data.build import corpus_pipeline, require_text_vocab
    from trmoe.data.corpus import load_corpus

    d = cfg.data
    tok = require_text_vocab(cfg, vocab_size)
    corpus = load_corpus(
        "text",
        text_path=d.text_path,
        separator=d.separator,
        eval_fraction=d.eval_fraction,
        split_seed=d.split_seed,
        tokenizer=tok,
    )
    return corpus_pipeline(cfg, corpus, tok)


def validate(d: Any, where: str = "data") -> None:
    if not d.text_path:
        if where == "data":
            allowed = "data=text needs a UTF-8 file: data.text_path=/path/to/corpus.txt"
            fail("data.text_path", d.text_path, allowed)
        fail(f"{where}.text_path", None, "a text source needs a UTF-8 file")
    if d.separator == "":
        fail(f"{where}.separator", "''", "must be a non-empty string, or null for blank lines")


VARIANT = DataSourceVariant(
    "text", build=build, options=TextOptions, validate=validate, exclusive=("text_path",), order=2,
    doc="a local UTF-8 file, documents separated by blank lines or `data.separator`",
    mixture_keys=("text_path", "separator"), example=("data.text_path=corpus.txt",),
    split="document content hash", sample="window of a seeded permutation (or sequential)",
)  # fmt: skip
