"""The data component the train loop sees: train batches by global sample index, fixed evaluation sets, the
bits-per-byte denominator, and the data cursor for checkpoints.

Sample g of the training order is a pure function of g for every source but the streamed one (data=fineweb),
whose reader also keeps a cursor (`state_dict` / `load_state_dict`). Optimizer step s reads the global samples
[(s-1)·B, s·B), B = micro_batch·grad_accum·world_size; rank r reads the contiguous block starting at
(s-1)·B + r·micro_batch·grad_accum (`micro_batch_samples`). The samples a run reads therefore depend on the
global batch only: a resume, also with another number of ranks at the same global batch, reads exactly the
samples the uninterrupted run would have read.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from trmoe.config.schema import Config, DataSource, TrainerConfig
from trmoe.data.corpus import SPLIT_RULE, load_corpus
from trmoe.data.evalsets import bits_per_byte, describe_streams, scored_bytes, scored_tokens
from trmoe.data.sampler import RandomTokens, WindowSampler, eval_batches
from trmoe.data.shards import INDEX_NAME, TokenShard, open_shard
from trmoe.data.tokenizer import EOS_ID, TOKENIZER_NAME, load_o200k, tokenizer_fingerprint
from trmoe.errors import UserError

log = logging.getLogger("trmoe")

Batch = tuple[torch.Tensor, torch.Tensor]
STATE_VERSION = 1


class Source(Protocol):
    def batch(self, first_sample: int, count: int) -> Batch: ...


def global_batch_samples(t: TrainerConfig, world_size: int) -> int:
    """B, the global batch in samples (sequences) of one optimizer step: micro_batch x grad_accum x world."""
    return t.micro_batch * t.grad_accum * world_size


def global_batch_tokens(t: TrainerConfig, world_size: int) -> int:
    """tokens_per_step: micro_batch x seq_len x world x grad_accum (the loop, resume checks, the planner)."""
    return global_batch_samples(t, world_size) * t.seq_len


def micro_batch_samples(
    step: int, rank: int, world_size: int, micro_batch: int, grad_accum: int
) -> list[tuple[int, int]]:
    """(first global sample index, count) of each micro-batch that `rank` reads at optimizer step `step`
    (1-based)."""
    per_rank = micro_batch * grad_accum
    first = (step - 1) * per_rank * world_size + rank * per_rank
    return [(first + a * micro_batch, micro_batch) for a in range(grad_accum)]


@dataclass
class DataPipeline:
    train: Source  # sample g of the global training order, for any g (exact resume)
    eval_set: list[Batch]  # the same held-out batches at every evaluation
    info: dict  # recorded in run_config.json
    eval_train_set: list[Batch] = field(default_factory=list)  # fixed batches of the training split
    eval_bytes: int | None = None  # UTF-8 bytes of the text the held-out targets encode; None = no bpb
    streams: dict = field(default_factory=dict)  # metrics.csv figure -> the stream it is computed on
    fingerprint: str = ""  # identity of the data, checked when a data cursor is loaded
    sources: dict[str, DataPipeline] = field(default_factory=dict)  # data=mixture: each source's own data

    @property
    def metric_columns(self) -> list[str]:
        """The metrics.csv columns beyond records.METRIC_COLUMNS: held-out loss and bpb of each source."""
        return [f"eval_{kind}/{name}" for name in self.sources for kind in ("loss", "bpb")]

    def bpb(self, eval_loss: float) -> float:
        """Bits per UTF-8 byte of the held-out loss (NaN when the ids are not o200k text)."""
        return bits_per_byte(eval_loss, scored_tokens(self.eval_set), self.eval_bytes)

    def state_dict(self) -> dict[str, Any]:
        """The data position for a checkpoint (JSON-serialisable). Sources indexed by global sample need
        nothing beyond the step (samples read = step x global batch); the stream adds its cursor."""
        stream = self.train.state_dict() if hasattr(self.train, "state_dict") else None
        return {
            "version": STATE_VERSION,
            "source": self.info.get("source"),
            "fingerprint": self.fingerprint,
            "stream": stream,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise UserError(f"data cursor: unknown format; this trmoe reads version {STATE_VERSION}")
        if state.get("source") != self.info.get("source") or state.get("fingerprint") != self.fingerprint:
            raise UserError(
                f"data cursor: the checkpoint read {state.get('source')!r} ({state.get('fingerprint')}); "
                f"this run reads {self.info.get('source')!r} ({self.fingerprint}); resume needs the same data"
            )
        if state.get("stream") is not None:
            self.train.load_state_dict(state["stream"])

    def close(self) -> None:
        """Stop background readers (data=fineweb)."""
        if hasattr(self.train, "close"):
            self.train.close()


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


class ShardWindows(WindowSampler):
    """WindowSampler over a memory-mapped shard that refuses ids outside the model's vocab (a cheap
    vectorized check per batch: a shard whose index lies would otherwise crash inside the embedding)."""

    def __init__(
        self, tokens: np.ndarray, seq_len: int, order: str, seed: int, *, name: str, vocab_size: int
    ):
        super().__init__(tokens, seq_len, order, seed, name=name)
        self.vocab_size = vocab_size

    def batch(self, first_sample: int, count: int) -> Batch:
        inputs, targets = super().batch(first_sample, count)
        if count and int(torch.maximum(inputs.max(), targets.max())) >= self.vocab_size:
            raise UserError(
                f"{self.name}: holds a token id >= model.vocab_size={self.vocab_size} in samples "
                f"{first_sample}..{first_sample + count - 1}; run `python -m trmoe.data.prepare verify`"
            )
        return inputs, targets


class PinnedSource:
    """Batches copied into page-locked host memory, so `.to(cuda, non_blocking=True)` is asynchronous."""

    def __init__(self, inner: Source):
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def batch(self, first_sample: int, count: int) -> Batch:
        inputs, targets = self.inner.batch(first_sample, count)
        return inputs.pin_memory(), targets.pin_memory()


def _pipeline(
    t: TrainerConfig,
    train: Source,
    eval_set: list[Batch],
    info: dict,
    *,
    fixed: Source,
    eval_bytes: int | None,
    train_stream: str,
    eval_stream: str,
    identity: list,
) -> DataPipeline:
    """What every builder returns: the training source, the held-out batches, the fixed batches of the
    training split (`fixed`, for eval_train_loss), what each figure is computed on, and the data's identity
    (checked when a data cursor is loaded)."""
    return DataPipeline(
        train,
        eval_set,
        info,
        eval_train_set=eval_batches(fixed, t.micro_batch, t.eval_batches),
        eval_bytes=eval_bytes,
        streams=describe_streams(train_stream, eval_stream),
        fingerprint=_digest(identity),
    )


def _require_o200k_vocab(cfg: Config, vocab_size: int) -> None:
    n_vocab = load_o200k().n_vocab
    if vocab_size < n_vocab:
        raise UserError(
            f"config error: model.vocab_size={vocab_size}: data={cfg.data.source.value} uses "
            f"{TOKENIZER_NAME} "
            f"token ids up to {n_vocab - 1}; allowed: >= {n_vocab} (or data=random)"
        )


def _check_one_batch(windows: int, cfg: Config, what: str) -> None:
    t = cfg.trainer
    need = t.micro_batch * t.grad_accum
    if windows < need:
        raise UserError(
            f"{what}: holds {windows} window(s) of seq_len+1 = {t.seq_len + 1} tokens, fewer than one batch "
            f"(trainer.micro_batch x trainer.grad_accum = {need}); use more data or a smaller batch"
        )


def build_data(
    cfg: Config, vocab_size: int, device: torch.device | None = None, world_size: int = 1
) -> DataPipeline:
    """Build and check every data input of a run (all UserErrors happen here, before anything is written)."""
    source = cfg.data.source
    if source == DataSource.mixture:
        from trmoe.data.mixture import build_mixture

        data = build_mixture(cfg, vocab_size, global_batch_samples(cfg.trainer, world_size))
    elif source == DataSource.random:
        data = _build_random(cfg, vocab_size)
    elif source == DataSource.tokens:
        data = _build_tokens(cfg, vocab_size)
    elif source == DataSource.fineweb:
        data = _build_fineweb(cfg, vocab_size)
    else:
        data = _build_corpus(cfg, vocab_size)
    data.info["metric_streams"] = data.streams
    if device is not None and device.type == "cuda" and cfg.data.pin_memory:
        data.train = PinnedSource(data.train)
    return data


def _build_random(cfg: Config, vocab_size: int) -> DataPipeline:
    t = cfg.trainer
    # Independent streams for train and eval: a different seed for each.
    train = RandomTokens(vocab_size, t.seq_len, seed=t.seed)
    held_out = RandomTokens(vocab_size, t.seq_len, seed=t.seed + 1_000_003)
    info = {"source": "random", "vocab_size": vocab_size, "train": "uniform ids", "eval": "uniform ids"}
    return _pipeline(
        t,
        train,
        eval_batches(held_out, t.micro_batch, t.eval_batches),
        info,
        fixed=train,
        eval_bytes=None,
        train_stream="training samples 0.. of the random stream (the first steps' batches)",
        eval_stream="an independent random stream (seed + 1000003); bpb is NaN: random ids encode no text",
        identity=["random", vocab_size, t.seq_len, t.seed],
    )


def _build_corpus(cfg: Config, vocab_size: int) -> DataPipeline:
    d, t = cfg.data, cfg.trainer
    _require_o200k_vocab(cfg, vocab_size)
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
    train_fixed = WindowSampler(corpus.train.tokens, t.seq_len, "sequential", name=f"{corpus.name} train")
    eval_set = eval_batches(held_out, t.micro_batch, t.eval_batches)
    eval_bytes = scored_bytes(eval_set)
    info = {
        **corpus.info,
        "tokenizer": TOKENIZER_NAME,
        "tokenizer_sha256": tokenizer_fingerprint(),
        "order": d.order.value,
        "train_windows": train.num_windows,
        "eval_windows": held_out.num_windows,
        "eval_tokens_scored": scored_tokens(eval_set),
        "eval_bytes_scored": eval_bytes,
        "eval_stream": "held-out documents (disjoint from training documents)",
    }
    return _pipeline(
        t,
        train,
        eval_set,
        info,
        fixed=train_fixed,
        eval_bytes=eval_bytes,
        train_stream=f"the first windows of the {corpus.name} training split in document order "
        "(not held out)",
        eval_stream=f"the first windows of the {corpus.name} held-out documents "
        "(disjoint from training documents)",
        # the content, not the location: a text file may move between the attempts of a run
        identity=[corpus.info["source"], corpus.info.get("documents_sha256"), corpus.info["split"]],
    )


# ------------------------------------------------------------------------------------------------ data=tokens


def _check_shard_against_model(shard: TokenShard, vocab_size: int) -> bool:
    """Vocab and tokenizer of a shard vs the model; returns whether its ids are o200k text (bpb defined)."""
    index, where = shard.index, shard.directory / INDEX_NAME
    if index["vocab_size"] > vocab_size:
        raise UserError(
            f"token shard {where}: token ids up to {index['vocab_size'] - 1} "
            f"(vocab_size {index['vocab_size']}, "
            f"max id {index['max_token_id']}) do not fit model.vocab_size={vocab_size}; allowed: "
            f"model.vocab_size >= {index['vocab_size']}"
        )
    if index["tokenizer"] == TOKENIZER_NAME:
        # a converted legacy shard hashed its tokenizer another way: its label and vocab are what is known
        if index.get("converted_from") is None and index["tokenizer_sha256"] != tokenizer_fingerprint():
            raise UserError(
                f"token shard {where}: tokenizer {TOKENIZER_NAME} with rank-file sha256 "
                f"{index['tokenizer_sha256']}, but this trmoe's is {tokenizer_fingerprint()}; "
                "re-prepare the data"
            )
        return True
    return False


def _tail_split(shard: TokenShard, eval_fraction: float, seq_len: int) -> int:
    """Hold out the last documents of a single shard: the split point is the end (EOS) of the last document
    that ends before the final max(eval_fraction x N, seq_len + 1) tokens. Reads only back to that EOS."""
    tokens, eos = shard.tokens, shard.index["eos_id"]
    where = shard.directory / INDEX_NAME
    if eos is None:
        raise UserError(
            f"token shard {where}: has no eos_id, so its documents cannot be held out whole; "
            "set data.eval_path to a held-out shard"
        )
    n = tokens.shape[0]
    end = n - max(int(n * eval_fraction), seq_len + 1)
    chunk = 1 << 20
    while end > 0:
        start = max(0, end - chunk)
        hits = np.flatnonzero(np.asarray(tokens[start:end]) == eos)
        if hits.size:
            return start + int(hits[-1]) + 1  # train = tokens[:split] ends with EOS
        end = start
    raise UserError(
        f"token shard {where}: no document boundary (EOS) before its last "
        f"{max(int(n * eval_fraction), seq_len + 1)} "
        "tokens to hold out whole documents; set data.eval_path or lower data.eval_fraction"
    )


def _shard_dirs(cfg: Config) -> tuple[Path, Path | None]:
    d = cfg.data
    root = Path(d.path).expanduser().resolve()
    if (root / INDEX_NAME).exists():
        return root, Path(d.eval_path).expanduser().resolve() if d.eval_path else None
    if (root / "train").is_dir():
        return root / "train", Path(d.eval_path).expanduser().resolve() if d.eval_path else root / "eval"
    if not root.exists():
        raise UserError(f"data.path={d.path}: no such directory")
    raise UserError(
        f"data.path={d.path}: not a token shard or dataset (expected {root / INDEX_NAME}, or train/ and "
        "eval/ "
        "from `python -m trmoe.data.prepare`)"
    )


def _build_tokens(cfg: Config, vocab_size: int) -> DataPipeline:
    d, t = cfg.data, cfg.trainer
    train_dir, eval_dir = _shard_dirs(cfg)
    train_shard = open_shard(train_dir, verify=d.verify)
    if train_shard.index["partition"] != "train":
        raise UserError(
            f"token shard {train_dir / INDEX_NAME}: partition is {train_shard.index['partition']!r}; "
            "training on "
            "a held-out shard would mix eval into train"
        )
    is_text = _check_shard_against_model(train_shard, vocab_size)
    if d.verify:
        log.info("data: verified sha256 and token ids of %s", train_dir)
    name = f"token shard {train_dir}"
    if eval_dir is not None:
        eval_shard = open_shard(eval_dir, verify=d.verify)
        if eval_shard.index["partition"] != "eval":
            raise UserError(
                f"token shard {eval_dir / INDEX_NAME}: partition is {eval_shard.index['partition']!r}; "
                "the held-out shard must be an eval partition"
            )
        if eval_shard.index["sha256"] == train_shard.index["sha256"]:
            raise UserError(f"token shard {eval_dir}: is identical to the training shard {train_dir}")
        for key in ("tokenizer", "tokenizer_sha256"):
            if eval_shard.index[key] != train_shard.index[key]:
                raise UserError(
                    f"token shard {eval_dir / INDEX_NAME}: {key} {eval_shard.index[key]!r} differs from the "
                    f"training shard's {train_shard.index[key]!r}"
                )
        _check_shard_against_model(eval_shard, vocab_size)
        if d.verify:
            log.info("data: verified sha256 and token ids of %s", eval_dir)
        train_tokens, eval_tokens = train_shard.tokens, eval_shard.tokens
        eval_name = f"token shard {eval_dir}"
        split = {
            "rule": "separate shards",
            "train": train_shard.fingerprint(),
            "eval": eval_shard.fingerprint(),
        }
    else:
        cut = _tail_split(train_shard, d.eval_fraction, t.seq_len)
        train_tokens, eval_tokens = train_shard.tokens[:cut], train_shard.tokens[cut:]
        eval_name = f"{name} (tail)"
        split = {
            "rule": "held-out tail: the documents after token index split_token (an EOS boundary)",
            "eval_fraction": d.eval_fraction,
            "split_token": cut,
            "train": train_shard.fingerprint(),
            "eval": None,
        }
    train = ShardWindows(train_tokens, t.seq_len, d.order.value, t.seed, name=name, vocab_size=vocab_size)
    _check_one_batch(train.num_windows, cfg, name)
    held_out = ShardWindows(eval_tokens, t.seq_len, "sequential", 0, name=eval_name, vocab_size=vocab_size)
    train_fixed = ShardWindows(train_tokens, t.seq_len, "sequential", 0, name=name, vocab_size=vocab_size)
    eval_set = eval_batches(held_out, t.micro_batch, t.eval_batches)
    eval_bytes = scored_bytes(eval_set) if is_text else None
    if not is_text:
        log.info(
            "data: tokenizer %r is not %s text: eval_bpb is NaN",
            train_shard.index["tokenizer"],
            TOKENIZER_NAME,
        )
    info = {
        "source": "tokens",
        "shards": split,
        "tokenizer": train_shard.index["tokenizer"],
        "tokenizer_sha256": train_shard.index["tokenizer_sha256"],
        "order": d.order.value,
        "train_windows": train.num_windows,
        "eval_windows": held_out.num_windows,
        "eval_tokens_scored": scored_tokens(eval_set),
        "eval_bytes_scored": eval_bytes,
    }
    return _pipeline(
        t,
        train,
        eval_set,
        info,
        fixed=train_fixed,
        eval_bytes=eval_bytes,
        train_stream=f"the first windows of {name} in file order (training data, not held out)",
        eval_stream=f"the first windows of {eval_name} (held-out documents)",
        identity=[
            split["train"]["sha256"],
            split["eval"] and split["eval"]["sha256"],
            split.get("split_token"),
        ],
    )


# ----------------------------------------------------------------------------------------------- data=fineweb


def _build_fineweb(cfg: Config, vocab_size: int) -> DataPipeline:
    from trmoe.data.fineweb import HubSource, ParquetSource, StreamWindows, split_stream_tokens

    d, t = cfg.data, cfg.trainer
    _require_o200k_vocab(cfg, vocab_size)
    if d.path:
        source = ParquetSource(d.path, d.text_field)
        where = f"data.path={d.path}"
    else:
        source = HubSource(d.hf_dataset, d.hf_subset, d.hf_revision, d.hf_split, d.text_field)
        where = f"data.hf_dataset={d.hf_dataset}"
    eval_windows = t.eval_batches * t.micro_batch
    held_out_tokens, eval_docs = split_stream_tokens(
        source, True, eval_windows * t.seq_len + 1, d.eval_fraction, d.split_seed
    )
    if held_out_tokens.size < t.seq_len + 1:
        raise UserError(
            f"{where}: the held-out documents hold {held_out_tokens.size} token(s), fewer than one window of "
            f"seq_len+1 = {t.seq_len + 1}; raise data.eval_fraction or add documents"
        )
    train_windows = max(eval_windows, t.micro_batch * t.grad_accum)
    train_head, _ = split_stream_tokens(
        source, False, train_windows * t.seq_len + 1, d.eval_fraction, d.split_seed
    )
    _check_one_batch(max(0, (train_head.size - 1) // t.seq_len), cfg, f"{where} (training documents)")
    train_fixed = WindowSampler(train_head, t.seq_len, "sequential", name=f"{where} train")
    held_out = WindowSampler(held_out_tokens, t.seq_len, "sequential", name=f"{where} eval")
    eval_set = eval_batches(held_out, t.micro_batch, t.eval_batches)
    eval_bytes = scored_bytes(eval_set)
    train = StreamWindows(source, t.seq_len, d.eval_fraction, d.split_seed, d.workers)
    info = {
        "source": "fineweb",
        "stream": {**source.info, "fingerprint": source.fingerprint},
        "split": {"rule": SPLIT_RULE, "eval_fraction": d.eval_fraction, "split_seed": d.split_seed},
        "tokenizer": TOKENIZER_NAME,
        "tokenizer_sha256": tokenizer_fingerprint(),
        "eos_id": EOS_ID,
        "order": "source order (files sorted by path, row groups, rows); wraps around at the end",
        "eval_documents_read": eval_docs,
        "eval_tokens_scored": scored_tokens(eval_set),
        "eval_bytes_scored": eval_bytes,
    }
    return _pipeline(
        t,
        train,
        eval_set,
        info,
        fixed=train_fixed,
        eval_bytes=eval_bytes,
        train_stream=f"the first windows of the training documents of {where} "
        "(training samples 0.., not held out)",
        eval_stream=f"the first windows of the held-out documents of {where} "
        "(content-hash rule, disjoint from training)",
        identity=[source.fingerprint, d.eval_fraction, d.split_seed, d.text_field],
    )
