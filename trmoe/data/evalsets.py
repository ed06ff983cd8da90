"""The fixed evaluation streams and the byte counts that turn a loss into bits per byte.

Four figures, kept apart (docs/data.md): `train_loss` on the training batches of the logging window;
`eval_train_loss` on a fixed stream of the training split (repeatable, not held out); `eval_loss` on fixed
held-out batches; `eval_bpb` = the held-out loss summed over the scored tokens / ln 2 / the UTF-8 bytes
of the text those tokens encode, which compares across tokenizers.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from trmoe.data.tokenizer import o200k_byte_lengths

Batch = tuple[torch.Tensor, torch.Tensor]

STREAMS = {
    "train_loss": (
        "the training batches of the logging window (every step since the previous row): mean pure "
        "cross-entropy over their tokens, not the logged step's own batch unless trainer.log_every=1"
    ),
    "eval_train_loss": "{train_fixed}",
    "eval_loss": "{held_out}",
    "eval_bpb": "{held_out}; summed cross-entropy / ln 2 / UTF-8 bytes of the scored target tokens",
}


def scored_bytes(batches: list[Batch], table: np.ndarray | None = None) -> int:
    """UTF-8 bytes of the text the target tokens of `batches` encode (`table`: bytes per id of the run's
    tokenizer; None = o200k's). Windows of one stream do not overlap in their targets, so this is the byte
    length of the scored text, exactly: a character split across tokens counts once, in pieces."""
    table = o200k_byte_lengths() if table is None else table
    return int(sum(int(table[y.reshape(-1).numpy()].sum()) for _, y in batches))


def scored_tokens(batches: list[Batch]) -> int:
    return int(sum(int(y.numel()) for _, y in batches))


def bits_per_byte(mean_loss: float, tokens: int, text_bytes: int | None) -> float:
    """Mean cross-entropy (nats per token) over `tokens` scored tokens -> bits per UTF-8 byte."""
    if not text_bytes or math.isnan(mean_loss):
        return math.nan
    return mean_loss * tokens / math.log(2) / text_bytes


def describe_streams(train_fixed: str, held_out: str) -> dict[str, str]:
    """The run_config.json entry that names the stream behind each metrics.csv figure."""
    return {k: v.format(train_fixed=train_fixed, held_out=held_out) for k, v in STREAMS.items()}
