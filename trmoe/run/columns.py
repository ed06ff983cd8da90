"""metrics.csv's columns, as the components that produce them declare them.

A *producer* (`MetricProducer`) is a component that gives each metrics row some columns: it declares them
(`columns_declared()`: a `MetricColumn` each, with its unit, its tracker scalar, whether the report plots it
and a one-line meaning; per run, so a family such as `acc/<task>` lists this run's members) and returns
their values at a log step (`row(step, row)`). The Trainer (trmoe.train.trainer) keeps the list of its
producers; everything else that knows a column reads it from there:

- metrics.csv's header is `header(declared)`: columns that have a `slot` in slot order (the columns of
  earlier trmoe versions: their positions are frozen, for the tools that read the file by position), then
  the others in the order the producers declare them;
- the trackers name each column's scalar by its `section` (trmoe.run.trackers);
- run_config.json records the declarations (`metrics_declared`), and the report reads a run's units and
  the columns to plot from there (trmoe.report.runs), so a run is reported with the knowledge of the code
  that wrote it;
- docs/training.md's table of columns is `table(declared)` (tests/test_metric_columns.py).

Adding a per-step metric is adding a `MetricColumn` to its producer's declarations and the value to its
`row` (docs/architecture.md, Extension points). Torch-free: the report and the run records read it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class MetricColumn:
    name: str  # the metrics.csv column
    unit: str  # what its values count ("nats/token", "tokens/s", "1" for a ratio or a plain number)
    section: str  # the trackers' scalar name (TensorBoard and W&B group by its first part): "train/loss"
    meaning: str  # one line: docs/training.md's table, the report's figure title
    plot: bool = False  # the report draws it against tokens, one colour per arm
    slot: int | None = None  # its place in metrics.csv (None: after the slotted columns, as declared)

    def member(self, key: str) -> MetricColumn:
        """The column `<name>/<key>` of a per-run family (a source's held-out loss, a task's accuracy)."""
        return dataclasses.replace(
            self, name=f"{self.name}/{key}", section=f"{self.section}/{key}", slot=None
        )

    def record(self) -> dict[str, Any]:
        """What run_config.json keeps of it (`metrics_declared`)."""
        return {
            "name": self.name,
            "unit": self.unit,
            "section": self.section,
            "plot": self.plot,
            "meaning": self.meaning,
        }

    @classmethod
    def from_record(cls, entry: Mapping[str, Any]) -> MetricColumn:
        return cls(
            name=str(entry["name"]),
            unit=str(entry.get("unit", "")),
            section=str(entry.get("section", f"other/{entry['name']}")),
            meaning=str(entry.get("meaning", "")),
            plot=bool(entry.get("plot", False)),
        )


class MetricProducer(Protocol):
    """A component that gives each metrics row columns (see the module's docstring)."""

    def columns_declared(self) -> tuple[MetricColumn, ...]: ...

    def row(self, step: int, row: Mapping[str, Any]) -> dict[str, Any]:
        """Its columns' values at log step `step` (a column left out is nan); `row` holds what the producers
        before it gave (read only)."""
        ...


class Declared:
    """A producer whose component is off in this run (expert telemetry without telemetry.moe): its columns
    stay in metrics.csv, as nan."""

    def __init__(self, columns: Iterable[MetricColumn]):
        self.columns = tuple(columns)

    def columns_declared(self) -> tuple[MetricColumn, ...]:
        return self.columns

    def row(self, step: int, row: Mapping[str, Any]) -> dict[str, Any]:
        return {}


def declared(producers: Iterable[MetricProducer]) -> tuple[MetricColumn, ...]:
    """The producers' columns in metrics.csv's order: slotted ones by slot, then the rest as declared. A
    name declared twice is a bug (ValueError)."""
    columns = [c for p in producers for c in p.columns_declared()]
    names = [c.name for c in columns]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"metrics columns declared twice: {twice}")
    return tuple(sorted(columns, key=lambda c: (c.slot is None, c.slot or 0)))


def header(columns: Iterable[MetricColumn]) -> tuple[str, ...]:
    return tuple(c.name for c in columns)


def sections(columns: Iterable[MetricColumn]) -> dict[str, str]:
    """metrics.csv column -> tracker scalar name."""
    return {c.name: c.section for c in columns}


def table(columns: Iterable[MetricColumn]) -> str:
    """docs/training.md's table of metrics.csv columns (a family's members as `<name>/<key>`)."""
    lines = ["| metrics.csv | unit | tracker | report plots | meaning |", "|---|---|---|---|---|"]
    for c in columns:
        plot = "yes" if c.plot else ""
        lines.append(f"| `{c.name}` | {c.unit} | `{c.section}` | {plot} | {c.meaning} |")
    return "\n".join(lines) + "\n"
