"""What one data source declares (`DataSourceVariant`), and the registry of the sources (`SOURCES`).

A source is one module of `trmoe.data.sources` that defines `VARIANT = DataSourceVariant(...)`, or a plug-in
declared in the entry-point group `trmoe.data_sources` (docs/extending.md). The registry feeds the schema
(`data.source`'s values, `data.*`'s keys, `data.sources.<name>.*`'s keys), the validation, `build_data` and
the docs. The config layer reads it without loading torch: this module and every source module import at
module level only the standard library and torch-free trmoe modules (tests/test_imports.py checks it); a
builder imports what it needs inside its function.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trmoe.errors import UserError
from trmoe.registry import Registry, check_options, options_table


@dataclass(frozen=True)
class DataSourceVariant:
    """One `data.source`. `build(cfg, vocab_size, world_size)` returns the run's DataPipeline (every
    UserError of the data before anything is written); `validate(cfg.data)` raises the source's own
    cross-field errors (`fail` below: one line naming the key); `options` holds the keys only this source
    reads (`data.<key>`, flat), with defaults and a trailing `# meaning` comment each."""

    name: str  # the value of data.source
    build: Callable[..., Any]  # (cfg, vocab_size, world_size) -> DataPipeline
    doc: str  # one line: what it reads (the docs table of docs/data.md, --help)
    options: type | None = None  # a dataclass of its own data.* keys, or None
    # (data, where) -> None: its own cross-field rules; `where` is "data", or "data.sources.<name>" when it
    # checks one source of a mixture (the keys named in its errors)
    validate: Callable[[Any, str], None] | None = None
    # data.sources.<name>.<key> keys it reads as a mixture source (data.* keys), or None: not a mixture
    # source; a key it leaves unset is `defaults[key]`, else data.<key>
    mixture_keys: tuple[str, ...] | None = None
    inherit: tuple[str, ...] = ()  # mixture keys whose data.<key> is the fallback (text_field, order)
    defaults: dict[str, Any] = dataclasses.field(default_factory=dict)  # mixture keys' own fallbacks
    split: str = ""  # its train / held-out split rule, for the docs table
    sample: str = ""  # what training sample g is, for the docs table
    # data.* keys it reads that are refused (set: not null, not empty) while a source that does not list
    # them is selected: a path the chosen source never reads would silently train on other data
    exclusive: tuple[str, ...] = ()
    composite: bool = False  # built from other sources (data.sources): the planner shows each part's share
    counts: Callable[[Any], str | None] | None = None  # (cfg.data) -> the token_counts.npy it ships, if any
    order: int = 100  # place in listings (built-ins: today's order; plug-ins after)
    # the overrides beside `data=<name>` that make a complete selection (its required keys, example values):
    # the docs show it, and tests compose and validate every source with it
    example: tuple[str, ...] = ()


def _check(variant: Any) -> None:
    if not isinstance(variant, DataSourceVariant):
        raise TypeError(f"not a trmoe.data.variant.DataSourceVariant: {type(variant).__name__}")
    if not callable(variant.build):
        raise TypeError("its build is not callable")
    if variant.validate is not None and not callable(variant.validate):
        raise TypeError("its validate is not callable")
    check_options(variant.options)


SOURCES: Registry[DataSourceVariant] = Registry(
    "data", group="trmoe.data_sources", package="trmoe.data.sources", check=_check
)


def fail(key: str, value: object, allowed: str) -> None:
    """A config error, one line: `config error: data.<key>=<value>: <what is allowed>`."""
    raise UserError(f"config error: {key}={value}: {allowed}")


def check_exclusive(d: Any) -> None:
    """A key of another source's `exclusive` set while `d.source` does not read it: one line naming the key
    and the sources that read it."""
    selected = SOURCES.get(d.source)
    for key in dict.fromkeys(k for _, v in SOURCES.items() for k in v.exclusive):
        value = getattr(d, key, None)
        if value is None or value == "" or value == {} or key in selected.exclusive:
            continue
        readers = ", ".join(f"data={n}" for n, v in SOURCES.items() if key in v.exclusive)
        shown = sorted(value) if isinstance(value, dict) else value
        fail(f"data.{key}", shown, f"only used by {readers} (data.source: {selected.name})")


def all_mixture_keys() -> tuple[str, ...]:
    """Every data.sources.<name>.<key> a source reads, in registry order."""
    keys = (k for _, v in SOURCES.items() if v.mixture_keys for k in v.mixture_keys)
    return tuple(dict.fromkeys(keys))


def source_table() -> str:
    """docs/data.md's tables of the single sources and of the sources' own options, from their declarations
    (a test keeps it in step)."""
    rows = [
        "| option | what | train / held-out split | sample g of the training order |",
        "|---|---|---|---|",
    ]
    for name, v in SOURCES.items():
        if not v.composite and not SOURCES.origin(name).plugin:
            rows.append(f"| `{name}` | {v.doc} | {v.split} | {v.sample} |")
    return "\n".join(rows) + "\n\n" + options_table(SOURCES, "data")
