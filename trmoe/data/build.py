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
from trmoe.data.tokenizer import Tokenizer, load_tokenizer
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
    tokenizer: Tokenizer | None = None,
) -> DataPipeline:
    """What every builder returns: the training source, the first batches of the held-out source (the same
    at every evaluation) and of the training split (`fixed`, for eval_train_loss), what those two figures are
    computed on (`streams`: training split, held out), and the data's identity as (name, value) pairs
    (checked when a data cursor is loaded; the names let a mismatch say what differs). `text`: whether the
    ids are text of `tokenizer` (None: o200k), so that the held-out bytes (bpb) are counted; the info
    records the tokens and bytes scored, unless None (ids that are no text at all: nothing recorded)."""
    eval_set = eval_batches(held_out, t.micro_batch, t.eval_batches)
    table = tokenizer.byte_lengths() if tokenizer is not None else None
    eval_bytes = scored_bytes(eval_set, table) if text else None
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


def run_tokenizer(cfg: Config) -> Tokenizer:
    """The tokenizer the run reads text with (tokenizer.*), its file checked against tokenizer.sha256 when
    that is set (the launch filled it in; a recorded config keeps it): a file changed since is refused."""
    t = cfg.tokenizer
    tok = load_tokenizer(t.name, t.path)
    if t.sha256 is not None and tok.sha256 != t.sha256:
        raise UserError(
            f"tokenizer file {tok.path}: sha256 {tok.sha256[:16]}... differs from tokenizer.sha256 "
            f"{t.sha256[:16]}... (the file changed since the run recorded it); allowed: the run's own file"
        )
    return tok


def require_text_vocab(cfg: Config, vocab_size: int) -> Tokenizer:
    """The run's tokenizer, once model.vocab_size is checked to hold its ids."""
    tok = run_tokenizer(cfg)
    if vocab_size < tok.n_vocab:
        raise UserError(
            f"config error: model.vocab_size={vocab_size}: data={cfg.data.source.value} uses "
            f"{tok.name} token ids up to {tok.n_vocab - 1}; allowed: >= {tok.n_vocab} (or data=random)"
        )
    return tok


def require_o200k_vocab(cfg: Config, vocab_size: int) -> Tokenizer:
    """For a source that tokenizes with o200k_base only (a plug-in that builds its corpus without passing a
    tokenizer, data=fineweb): refuses tokenizer=bpe, then checks the vocabulary."""
    if getattr(cfg.tokenizer.name, "value", cfg.tokenizer.name) != "o200k":
        raise UserError(
            f"config error: tokenizer={cfg.tokenizer.name.value}: data={cfg.data.source.value} tokenizes "
            "with o200k_base only; allowed: tokenizer=o200k, or prepare the text into shards with "
            "`python -m trmoe.data.prepare --tokenizer bpe` and train on data=tokens"
        )
    return require_text_vocab(cfg, vocab_size)


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


def corpus_pipeline(cfg: Config, corpus: Corpus, tokenizer: Tokenizer | None = None) -> DataPipeline:
    """The pipeline of an in-memory corpus (data=embedded, text, jsonl): windows of its training split in
    data.order, the first windows of its held-out documents (tokenized with `tokenizer`; None = o200k)."""
    tok = tokenizer if tokenizer is not None else load_tokenizer()
    d, t = cfg.data, cfg.trainer
    train = WindowSampler(
        corpus.train.tokens, t.seq_len, d.order.value, seed=t.seed, name=f"{corpus.name} train"
    )
    held_out = WindowSampler(corpus.eval.tokens, t.seq_len, "sequential", name=f"{corpus.name} eval")
    train_fixed = WindowSampler(corpus.train.tokens, t.seq_len, "sequential", name=f"{corpus.name} train")
    info = {
        **corpus.info,
        "tokenizer": tok.name,
        "tokenizer_sha256": tok.sha256,
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
        t,
        train,
        held_out,
        info,
        fixed=train_fixed,
        text=True,
        streams=streams,
        identity=identity,
        tokenizer=tok,
    )
