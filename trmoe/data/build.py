"""The data sources' builders: from a run's config to its DataPipeline (trmoe.data.pipeline), one builder per
`data.source` (random, a corpus, token shards, fineweb, a mixture of these), each checking its input before
anything is written (every UserError of the data happens here). The batch sizes the config implies are
trmoe.config.derived's, as everywhere else.

Over 400 lines on purpose: each builder is the whole story of one source (its config keys, its checks, what
run_config.json records of it); they share the helpers at the top. The only module of trmoe/data that reads
the config (docs/architecture.md: the one upward arrow of the package layers).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trmoe.config import derived
from trmoe.config.schema import Config, DataSource, MixtureSourceConfig, TrainerConfig
from trmoe.data.corpus import SPLIT_RULE, load_corpus
from trmoe.data.evalsets import describe_streams, scored_bytes, scored_tokens
from trmoe.data.mixture import MixtureSchedule, MixtureWindows, Weights
from trmoe.data.pipeline import Batch, DataPipeline, PinnedSource, ShardWindows, Source
from trmoe.data.sampler import RandomTokens, WindowSampler, eval_batches
from trmoe.data.shards import INDEX_NAME, TokenShard, open_shard
from trmoe.data.tokenizer import EOS_ID, TOKENIZER_NAME, load_o200k, tokenizer_fingerprint
from trmoe.errors import UserError

log = logging.getLogger("trmoe")


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


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
    source = cfg.data.source
    if source == DataSource.mixture:
        data = build_mixture(cfg, vocab_size, derived.global_batch_samples(cfg.trainer, world_size))
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


def _build_fineweb(cfg: Config, vocab_size: int) -> DataPipeline:
    from trmoe.data.fineweb import HubSource, ParquetSource, StreamWindows, split_stream_tokens  # pyarrow

    d, t = cfg.data, cfg.trainer
    _require_o200k_vocab(cfg, vocab_size)
    if d.path:
        source = ParquetSource(d.path, d.text_field)
        where = f"data.path={d.path}"
    else:
        source = HubSource(d.hf_dataset, d.hf_subset, d.hf_revision, d.hf_split, d.text_field)
        where = f"data.hf_dataset={d.hf_dataset}"
    held_out_tokens, eval_docs = split_stream_tokens(
        source, True, derived.eval_tokens(t) + 1, d.eval_fraction, d.split_seed
    )
    if held_out_tokens.size < t.seq_len + 1:
        raise UserError(
            f"{where}: the held-out documents hold {held_out_tokens.size} token(s), fewer than one window of "
            f"seq_len+1 = {t.seq_len + 1}; raise data.eval_fraction or add documents"
        )
    train_windows = max(derived.eval_windows(t), derived.rank_batch_samples(t))
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


def source_config(cfg: Config, name: str, src: MixtureSourceConfig) -> Config:
    """The single-source config of one mixture source: data.* with the source's keys."""
    d = cfg.data
    order = src.order or (d.order if src.source != DataSource.fineweb else type(d.order).sequential)
    data = dataclasses.replace(
        d,
        source=src.source,
        text_path=src.text_path,
        separator=src.separator,
        path=src.path,
        eval_path=src.eval_path,
        text_field=src.text_field or d.text_field,
        order=order,
        sources={},
        mixture_ramp_start=None,
        mixture_ramp_end=None,
    )
    return dataclasses.replace(cfg, data=data)


def mixture_weights(cfg: Config) -> Weights:
    sources = list(cfg.data.sources.values())
    return Weights(
        start=tuple(float(s.weight) for s in sources),
        final=tuple(float(s.weight if s.weight_final is None else s.weight_final) for s in sources),
        ramp_start=cfg.data.mixture_ramp_start,
        ramp_end=cfg.data.mixture_ramp_end,
    )


def plan_mixture(cfg: Config, samples_per_step: int, windows: dict[str, int | None]) -> dict[str, Any]:
    """Samples, tokens and epochs of each source over trainer.steps (what run_config.json and the planner
    show). `windows`: each source's training windows (None: a stream, whose length is not known up front)."""
    names = list(cfg.data.sources)
    schedule = MixtureSchedule(mixture_weights(cfg), samples_per_step, cfg.trainer.seed)
    counts = schedule.counts(cfg.trainer.steps)
    out = {}
    for name, n in zip(names, counts, strict=True):
        w = windows.get(name)
        out[name] = {
            "samples": n,
            "tokens": n * cfg.trainer.seq_len,
            "share": n / max(1, sum(counts)),
            "windows": w,
            "epochs": None if not w else n / w,
        }
    return out


def build_mixture(cfg: Config, vocab_size: int, samples_per_step: int):
    """Build every source with its own builder, check they agree, and blend them."""
    names = list(cfg.data.sources)
    parts = {}
    try:
        for name in names:
            try:
                parts[name] = build_data(source_config(cfg, name, cfg.data.sources[name]), vocab_size)
            except UserError as exc:
                raise UserError(f"data.sources.{name}: {exc}") from None
        first = names[0]
        for name in names[1:]:
            a, b = parts[first].info.get("tokenizer"), parts[name].info.get("tokenizer")
            if a != b:
                raise UserError(
                    f"data.sources.{name}: tokenizer {b!r} differs from data.sources.{first}'s {a!r}; every "
                    "source of a mixture must use one tokenizer"
                )
    except BaseException:
        for part in parts.values():
            part.close()
        raise
    weights = mixture_weights(cfg)
    schedule = MixtureSchedule(weights, samples_per_step, cfg.trainer.seed)
    train = MixtureWindows(names, [parts[n].train for n in names], schedule)
    eval_set = [b for n in names for b in parts[n].eval_set]
    eval_bytes = [parts[n].eval_bytes for n in names]
    windows = {n: getattr(parts[n].train, "num_windows", None) for n in names}
    plan = plan_mixture(cfg, samples_per_step, windows)
    for name, p in plan.items():
        if p["epochs"] is not None and p["epochs"] > 1:
            log.info(
                "data: source %s is read %.2f times over %d steps (it wraps around: a new epoch)",
                name,
                p["epochs"],
                cfg.trainer.steps,
            )
    info = {
        "source": "mixture",
        "tokenizer": parts[names[0]].info.get("tokenizer"),
        "tokenizer_sha256": parts[names[0]].info.get("tokenizer_sha256"),
        "samples_per_step": samples_per_step,
        "weights": dict(zip(names, weights.start, strict=True)),
        "weights_final": dict(zip(names, weights.final, strict=True)),
        "ramp": [weights.ramp_start, weights.ramp_end],
        "rule": "per-step quotas: largest-remainder rounding of the cumulative ideal counts; slots shuffled "
        "by PCG64([seed, 0x6d6978, step]); each source read in its own order, wrapping around",
        "sources": {n: parts[n].info for n in names},
        "plan": plan,  # samples, tokens and epochs of each source over trainer.steps (volatile)
        "eval_tokens_scored": scored_tokens(eval_set),
        "eval_bytes_scored": None if None in eval_bytes else sum(eval_bytes),
    }
    streams = describe_streams(
        "each source's fixed training-split windows, concatenated (equal windows per source)",
        "each source's fixed held-out windows, concatenated (equal windows per source, whatever the weights)",
    )
    data = DataPipeline(
        train,
        eval_set,
        info,
        eval_train_set=[b for n in names for b in parts[n].eval_train_set],
        eval_bytes=info["eval_bytes_scored"],
        streams=streams,
        fingerprint=_digest(
            [[n, parts[n].fingerprint] for n in names]
            + [
                list(weights.start),
                list(weights.final),
                weights.ramp_start,
                weights.ramp_end,
                samples_per_step,
            ]
        ),
        sources=parts,
    )
    return data
