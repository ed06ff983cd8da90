"""data=mixture: a weighted blend of several sources (data.sources), each built by its own builder, with
per-source evaluation (docs/data.md, Mixtures)."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from trmoe.data.variant import SOURCES, DataSourceVariant, all_mixture_keys, fail
from trmoe.errors import UserError

if TYPE_CHECKING:
    from trmoe.config.schema import Config, MixtureSourceConfig
    from trmoe.data.mixture import Weights
    from trmoe.data.pipeline import DataPipeline

SOURCE_NAME = re.compile(r"[A-Za-z0-9_-]+")


@dataclass
class MixtureOptions:
    sources: dict[str, MixtureSourceConfig] = field(default_factory=dict)  # data=mixture: name -> source
    mixture_ramp_start: int | None = None  # mixture: weights leave `weight` after this optimizer step...
    mixture_ramp_end: int | None = None  # ... and reach `weight_final` at this one (linear; absolute steps)


def part_data(d: Any, src: Any) -> Any:
    """The data.* of one mixture source as if it were alone: its kind and its keys
    (data.sources.<name>.*); a key it leaves unset is the kind's default for it (fineweb: order
    sequential), else data.<key> (text_field, order; the per-source keys are null there)."""
    variant = SOURCES.get(src.source)
    keys = {}
    for key in all_mixture_keys():
        value = getattr(src, key)
        if value is None:
            value = variant.defaults.get(key, getattr(d, key))
        current = getattr(d, key)
        if isinstance(current, Enum) and value is not None:
            value = type(current)(getattr(value, "value", value))
        keys[key] = value
    return dataclasses.replace(
        d, source=src.source, sources={}, mixture_ramp_start=None, mixture_ramp_end=None, **keys
    )


def source_config(cfg: Config, src: MixtureSourceConfig) -> Config:
    """The single-source config of one mixture source: data.* with the source's keys."""
    return dataclasses.replace(cfg, data=part_data(cfg.data, src))


def validate(d: Any, where: str = "data") -> None:
    """The sources, their weights and the weight ramp (docs/data.md, Mixtures)."""
    per_source = [k for k in all_mixture_keys() if not any(k in v.inherit for _, v in SOURCES.items())]
    for key in per_source:
        if getattr(d, key) is not None:
            fail(f"data.{key}", getattr(d, key), "data=mixture: set it per source, data.sources.<name>.*")
    if not d.sources:
        fail(
            "data.sources",
            "{}",
            "data=mixture needs at least one source: '+data.sources.<name>={source: text, text_path: f.txt, "
            "weight: 1}'",
        )
    kinds = [n for n, v in SOURCES.items() if v.mixture_keys is not None and not v.composite]
    for name, s in d.sources.items():
        key = f"data.sources.{name}"
        if not SOURCE_NAME.fullmatch(name):
            fail(key, name, "a source name is letters, digits, '_' and '-' (it names metrics.csv columns)")
        kind = getattr(s.source, "value", s.source)
        if kind not in kinds:
            fail(f"{key}.source", kind, f"allowed: {', '.join(kinds)}")
        variant = SOURCES.get(kind)
        for option in all_mixture_keys():
            if getattr(s, option) is not None and option not in variant.mixture_keys:
                fail(f"{key}.{option}", getattr(s, option), f"not used by source {kind}")
        if variant.validate is not None:
            variant.validate(part_data(d, s), key)
        for option in ("weight", "weight_final"):
            value = getattr(s, option)
            if value is not None and not (math.isfinite(value) and value >= 0):
                fail(f"{key}.{option}", value, "must be a finite number >= 0")
    if not sum(s.weight for s in d.sources.values()) > 0:
        fail("data.sources.*.weight", 0, "at least one source needs a weight > 0")
    finals = [s.weight_final for s in d.sources.values()]
    ramped = any(f is not None for f in finals)
    if (
        ramped
        and not sum(s.weight if f is None else f for s, f in zip(d.sources.values(), finals, strict=True)) > 0
    ):
        fail("data.sources.*.weight_final", 0, "at least one source needs a final weight > 0")
    start, end = d.mixture_ramp_start, d.mixture_ramp_end
    if ramped != (start is not None and end is not None) or (start is None) != (end is None):
        fail(
            "data.mixture_ramp_start",
            start,
            "a weight schedule needs data.sources.<name>.weight_final and both data.mixture_ramp_start and "
            "data.mixture_ramp_end (optimizer steps); without one, none of them",
        )
    if start is not None and not 0 <= start < end:
        fail("data.mixture_ramp_end", end, f"must be > data.mixture_ramp_start={start} >= 0")


def mixture_weights(cfg: Config) -> Weights:
    from trmoe.data.mixture import Weights

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
    from trmoe.data.mixture import MixtureSchedule

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


def build(cfg: Config, vocab_size: int, world_size: int = 1) -> DataPipeline:
    """Build every source with its own builder (build_data: the registry's), check they agree, and blend
    them."""
    import logging

    from trmoe.config.derived import global_batch_samples
    from trmoe.data.build import build_data, digest
    from trmoe.data.evalsets import describe_streams, scored_tokens
    from trmoe.data.mixture import MixtureSchedule, MixtureWindows
    from trmoe.data.pipeline import DataPipeline

    log = logging.getLogger("trmoe")
    samples_per_step = global_batch_samples(cfg.trainer, world_size)
    names = list(cfg.data.sources)
    parts = {}
    try:
        for name in names:
            try:
                parts[name] = build_data(source_config(cfg, cfg.data.sources[name]), vocab_size)
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
        fingerprint=digest(
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
        identity={  # what the fingerprint is made of, by name, so a mismatch at resume says what differs
            "data.sources (in order)": names,
            **{f"data.sources.{n}.weight (normalised)": w for n, w in zip(names, weights.start, strict=True)},
            **{f"data.sources.{n}.weight_final": w for n, w in zip(names, weights.final, strict=True)},
            "data.mixture_ramp_start": weights.ramp_start,
            "data.mixture_ramp_end": weights.ramp_end,
            "samples per step": samples_per_step,
            **{f"data.sources.{n}: {k}": v for n in names for k, v in parts[n].identity.items()},
        },
    )
    return data


VARIANT = DataSourceVariant(
    "mixture", build=build, options=MixtureOptions, validate=validate, exclusive=("sources",), order=5,
    doc="a weighted blend of several of the above (`data.sources`), per-source evaluation",
    split="each source's own", sample="per-step quotas of each source's own order", composite=True,
    example=("+data.sources={a: {source: embedded, weight: 1}, b: {source: text, text_path: t, weight: 2}}",),
)  # fmt: skip
