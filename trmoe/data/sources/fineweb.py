"""data=fineweb: documents streamed from local Parquet (data.path) or the HF hub, tokenized live."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trmoe.data.variant import DataSourceVariant, fail
from trmoe.errors import UserError

if TYPE_CHECKING:
    from trmoe.config.schema import Config
    from trmoe.data.pipeline import DataPipeline


@dataclass
class FinewebOptions:
    hf_dataset: str | None = None  # fineweb without data.path: HF hub dataset name (needs the `hf` extra)
    hf_subset: str | None = None  # fineweb: hub dataset config/subset, e.g. sample-10BT
    hf_revision: str | None = None  # fineweb: hub revision (commit) to pin the data
    hf_split: str = "train"  # fineweb: hub split to stream


def build(cfg: Config, vocab_size: int, world_size: int = 1) -> DataPipeline:
    from trmoe.config import derived
    from trmoe.data.build import check_one_batch, pipeline, require_o200k_vocab
    from trmoe.data.corpus import SPLIT_RULE
    from trmoe.data.fineweb import HubSource, ParquetSource, StreamWindows, split_stream_tokens  # pyarrow
    from trmoe.data.sampler import WindowSampler
    from trmoe.data.tokenizer import EOS_ID, TOKENIZER_NAME, tokenizer_fingerprint

    d, t = cfg.data, cfg.trainer
    require_o200k_vocab(cfg, vocab_size)
    if d.path:
        source = ParquetSource(d.path, d.text_field)
        where = f"data.path={d.path}"
    else:
        source = HubSource(d.hf_dataset, d.hf_subset, d.hf_revision, d.hf_split, d.text_field)
        where = f"data.hf_dataset={d.hf_dataset}"
    eval_windows = derived.eval_windows(t)
    held_out_tokens, eval_docs = split_stream_tokens(
        source, True, derived.eval_tokens(t) + 1, d.eval_fraction, d.split_seed
    )
    if held_out_tokens.size < t.seq_len + 1:
        raise UserError(
            f"{where}: the held-out documents hold {held_out_tokens.size} token(s), fewer than one window of "
            f"seq_len+1 = {t.seq_len + 1}; raise data.eval_fraction or add documents"
        )
    train_windows = max(eval_windows, derived.rank_batch_samples(t))
    train_head, _ = split_stream_tokens(
        source, False, train_windows * t.seq_len + 1, d.eval_fraction, d.split_seed
    )
    check_one_batch(max(0, (train_head.size - 1) // t.seq_len), cfg, f"{where} (training documents)")
    train_fixed = WindowSampler(train_head, t.seq_len, "sequential", name=f"{where} train")
    held_out = WindowSampler(held_out_tokens, t.seq_len, "sequential", name=f"{where} eval")
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
    }
    streams = (
        f"the first windows of the training documents of {where} (training samples 0.., not held out)",
        f"the first windows of the held-out documents of {where} (content-hash rule, disjoint from training)",
    )
    identity = [
        ("stream", source.fingerprint),
        ("data.eval_fraction", d.eval_fraction),
        ("data.split_seed", d.split_seed),
        ("data.text_field", d.text_field),
    ]
    return pipeline(
        t, train, held_out, info, fixed=train_fixed, text=True, streams=streams, identity=identity
    )


def validate(d: Any, where: str = "data") -> None:
    if where != "data":  # a mixture source: a Parquet path (the hub keys are data.*'s)
        if not d.path:
            fail(f"{where}.path", None, f"a fineweb source needs {where}.path")
        if d.order.value != "sequential":
            fail(f"{where}.order", d.order.value, "a fineweb source streams documents in order: sequential")
        return
    if not d.path and not d.hf_dataset:
        fail(
            "data.path",
            d.path,
            "data=fineweb needs data.path=<Parquet file, dir or glob> or data.hf_dataset=<hub name>",
        )
    if d.path and d.hf_dataset:
        fail("data.hf_dataset", d.hf_dataset, "set data.path (Parquet) or data.hf_dataset, not both")
    if d.order.value != "sequential":
        fail("data.order", d.order.value, "data=fineweb streams documents in source order: sequential")


VARIANT = DataSourceVariant(
    "fineweb", build=build, options=FinewebOptions, validate=validate, exclusive=("path",), order=4,
    doc="documents streamed from local Parquet files or the Hugging Face hub, tokenized on the fly",
    mixture_keys=("path", "text_field", "order"), inherit=("text_field",), defaults={"order": "sequential"},
    split="document content hash", sample="window g of the training stream",
    example=("data.path=fineweb-edu/sample/10BT",),
)  # fmt: skip
