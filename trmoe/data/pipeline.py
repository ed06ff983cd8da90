"""The data component the train loop sees: train batches by global sample index and a fixed eval set."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from trmoe.config.schema import Config, DataSource
from trmoe.data.corpus import load_corpus
from trmoe.data.sampler import RandomTokens, WindowSampler, eval_batches
from trmoe.data.tokenizer import TOKENIZER_NAME, load_o200k, tokenizer_fingerprint
from trmoe.errors import UserError

Batch = tuple[torch.Tensor, torch.Tensor]


class Source(Protocol):
    def batch(self, first_sample: int, count: int) -> Batch: ...


@dataclass
class DataPipeline:
    train: Source  # sample g of the global training order, for any g (exact resume)
    eval_set: list[Batch]  # the same held-out batches at every evaluation
    info: dict  # recorded in run_config.json


def build_data(cfg: Config, vocab_size: int) -> DataPipeline:
    d, t = cfg.data, cfg.trainer
    if d.source == DataSource.random:
        # Independent streams for train and eval: a different seed for each.
        train = RandomTokens(vocab_size, t.seq_len, seed=t.seed)
        held_out = RandomTokens(vocab_size, t.seq_len, seed=t.seed + 1_000_003)
        info = {"source": "random", "vocab_size": vocab_size, "train": "uniform ids", "eval": "uniform ids"}
        return DataPipeline(train, eval_batches(held_out, t.micro_batch, t.eval_batches), info)

    n_vocab = load_o200k().n_vocab
    if vocab_size < n_vocab:
        raise UserError(
            f"config error: model.vocab_size={vocab_size}: data={d.source.value} uses {TOKENIZER_NAME} "
            f"token ids up to {n_vocab - 1}; allowed: >= {n_vocab} (or data=random)"
        )
    corpus = load_corpus(
        d.source.value,
        text_path=d.text_path,
        separator=d.separator,
        eval_fraction=d.eval_fraction,
        split_seed=d.split_seed,
    )
    train = WindowSampler(
        corpus.train.tokens, t.seq_len, d.order.value, seed=t.seed, name=f"{corpus.name} train"
    )
    held_out = WindowSampler(corpus.eval.tokens, t.seq_len, "sequential", name=f"{corpus.name} eval")
    eval_set = eval_batches(held_out, t.micro_batch, t.eval_batches)
    info = {
        **corpus.info,
        "tokenizer": TOKENIZER_NAME,
        "tokenizer_sha256": tokenizer_fingerprint(),
        "order": d.order.value,
        "train_windows": train.num_windows,
        "eval_windows": held_out.num_windows,
        "eval_tokens_scored": sum(int(x.numel()) for x, _ in eval_set),
        "eval_stream": "held-out documents (disjoint from training documents)",
    }
    return DataPipeline(train, eval_set, info)
