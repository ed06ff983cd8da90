"""From a run's config to its DataPipeline (trmoe.data.pipeline): `build_data`, the one entry point, hands
the config to the builder of the selected `data.source` (trmoe.data.variant's SOURCES: the modules of
trmoe/data/sources and plug-ins), and the helpers the builders share (the pipeline they return, the checks of
a vocabulary and of one batch, a corpus's pipeline), with the batch sizes the config implies.

The only module of trmoe/data that imports the config (docs/architecture.md: the one upward arrow of the
package layers); the source modules take the Config as an argument and name its type only for the checker.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from trmoe.config import derived
from trmoe.config.schema import Config, TrainerConfig
from trmoe.data.corpus import Corpus
from trmoe.data.evalsets import describe_streams, scored_bytes, scored_tokens
from trmoe.data.pipeline import DataPipeline, PinnedSource, Source
from trmoe.data.sampler import WindowSampler, eval_batches
from trmoe.data.tokenizer import TOKENIZER_NAME, load_o200k, tokenizer_fingerprint
from trmoe.data.variant import SOURCES
from trmoe.errors import UserError


def digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def pipeline(
    t: TrainerConfig,
    train: Source,
    held_out: Source,
    info: dict,
    *,
    fixed: Source,
    text: bool | None,
    streams: tuple[str, str],
    identity: list[tuple[str, Any]],
) -> DataPipeline:
    """What every builder returns: the training source, the first batches of the held-out source (the same
    at every evaluation) and of the training split (`fixed`, for eval_train_loss), what those two figures are
    computed on (`streams`: training split, held out), and the data's identity as (name, value) pairs
    (checked when a data cursor is loaded; the names let a mismatch say what differs). `text`: whether the
    ids are o200k text, so that the held-out bytes (bpb) are counted; the info records the tokens and bytes
    scored, unless None (ids that are no text at all: nothing recorded)."""
    eval_set = eval_batches(held_out, t.micro_batch, t.eval_batches)
    eval_bytes = scored_bytes(eval_set) if text else None
    if text is not None:
        info = {**info, "eval_tokens_scored": scored_tokens(eval_set), "eval_bytes_scored": eval_bytes}
    return DataPipeline(
        train,
        eval_set,
        info,
        eval_train_set=eval_batches(fixed, t.micro_batch, t.eval_batches),
        eval_bytes=eval_bytes,
        streams=describe_streams(*streams),
        fingerprint=digest([value for _, value in identity]),  # the values only: what older checkpoints hold
        identity=dict(identity),
    )


def require_o200k_vocab(cfg: Config, vocab_size: int) -> None:
    n_vocab = load_o200k().n_vocab
    if vocab_size < n_vocab:
        raise UserError(
            f"config error: model.vocab_size={vocab_size}: data={cfg.data.source.value} uses "
            f"{TOKENIZER_NAME} "
            f"token ids up to {n_vocab - 1}; allowed: >= {n_vocab} (or data=random)"
        )


def check_one_batch(windows: int, cfg: Config, what: str) -> None:
    t = cfg.trainer
    need = derived.rank_batch_samples(t)
    if windows < need:
        raise UserError(
            f"{what}: holds {windows} window(s) of seq_len+1 = {t.seq_len + 1} tokens, fewer than one batch "
            f"(trainer.micro_batch x trainer.grad_accum = {need}); use more data or a smaller batch"
        )


def build_data(
    cfg: Config, vocab_size: int, device: torch.device | None = None, world_size: int = 1
) -> DataPipeline:
    """Build and check every data input of a run (all UserErrors happen here, before anything is written)."""
    data = SOURCES.get(cfg.data.source).build(cfg, vocab_size, world_size)
    data.info["metric_streams"] = data.streams
    if device is not None and device.type == "cuda" and cfg.data.pin_memory:
        data.train = PinnedSource(data.train)
    return data


def corpus_pipeline(cfg: Config, corpus: Corpus) -> DataPipeline:
    """The pipeline of an in-memory corpus (data=embedded, text, jsonl): windows of its training split in
    data.order, the first windows of its held-out documents."""
    d, t = cfg.data, cfg.trainer
    train = WindowSampler(
        corpus.train.tokens, t.seq_len, d.order.value, seed=t.seed, name=f"{corpus.name} train"
    )
    held_out = WindowSampler(corpus.eval.tokens, t.seq_len, "sequential", name=f"{corpus.name} eval")
    train_fixed = WindowSampler(corpus.train.tokens, t.seq_len, "sequential", name=f"{corpus.name} train")
    info = {
        **corpus.info,
        "tokenizer": TOKENIZER_NAME,
        "tokenizer_sha256": tokenizer_fingerprint(),
        "order": d.order.value,
        "train_windows": train.num_windows,
        "eval_windows": held_out.num_windows,
        "eval_stream": "held-out documents (disjoint from training documents)",
    }
    streams = (
        f"the first windows of the {corpus.name} training split in document order (not held out)",
        f"the first windows of the {corpus.name} held-out documents (disjoint from training documents)",
    )
    # the content, not the location: a text file may move between the attempts of a run
    identity = [
        ("source", corpus.info["source"]),
        ("documents sha256", corpus.info.get("documents_sha256")),
        ("split", corpus.info["split"]),
    ]
    return pipeline(
        t, train, held_out, info, fixed=train_fixed, text=True, streams=streams, identity=identity
    )
