"""data=embedded: the English help texts every CPython ships (pydoc_data), tokenized in memory (tokenizer)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trmoe.data.variant import DataSourceVariant

if TYPE_CHECKING:
    from trmoe.config.schema import Config
    from trmoe.data.pipeline import DataPipeline


def build(cfg: Config, vocab_size: int, world_size: int = 1) -> DataPipeline:
    from trmoe.data.build import corpus_pipeline, require_text_vocab
    from trmoe.data.corpus import load_corpus

    d = cfg.data
    tok = require_text_vocab(cfg, vocab_size)
    corpus = load_corpus("embedded", eval_fraction=d.eval_fraction, split_seed=d.split_seed, tokenizer=tok)
    return corpus_pipeline(cfg, corpus, tok)


VARIANT = DataSourceVariant(
    "embedded", build=build, mixture_keys=(), order=0,
    doc="CPython's help texts (`pydoc_data`), tokenized in memory (`tokenizer=`)",
    split="document content hash", sample="window of a seeded permutation (or sequential)",
)  # fmt: skip
