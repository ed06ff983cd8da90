"""data=random: uniform random token ids (smoke tests only: nothing to learn)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trmoe.data.variant import DataSourceVariant

if TYPE_CHECKING:
    from trmoe.config.schema import Config
    from trmoe.data.pipeline import DataPipeline


def build(cfg: Config, vocab_size: int, world_size: int = 1) -> DataPipeline:
    from trmoe.data.build import pipeline
    from trmoe.data.sampler import RandomTokens

    t = cfg.trainer
    # Independent streams for train and eval: a different seed for each.
    train = RandomTokens(vocab_size, t.seq_len, seed=t.seed)
    held_out = RandomTokens(vocab_size, t.seq_len, seed=t.seed + 1_000_003)
    info = {"source": "random", "vocab_size": vocab_size, "train": "uniform ids", "eval": "uniform ids"}
    streams = (
        "training samples 0.. of the random stream (the first steps' batches)",
        "an independent random stream (seed + 1000003); bpb is NaN: random ids encode no text",
    )
    identity = [
        ("source", "random"),
        ("model.vocab_size", vocab_size),
        ("trainer.seq_len", t.seq_len),
        ("trainer.seed", t.seed),
    ]
    return pipeline(t, train, held_out, info, fixed=train, text=None, streams=streams, identity=identity)


VARIANT = DataSourceVariant(
    "random", build=build, order=1, doc="uniform random ids (smoke tests; nothing to learn)",
    split="independent seeds", sample="a pure function of (seed, g)",
)  # fmt: skip
