"""The classes whose instances give a metrics row its columns (`Trainer.producers`), for what lists the
columns without a run: docs/training.md's table and the tests of metrics.csv's header."""

from __future__ import annotations

from trmoe.run import columns
from trmoe.train import guards
from trmoe.train.objective import Objective
from trmoe.train.observe import meters
from trmoe.train.observe.downstream import Downstream
from trmoe.train.observe.evaluation import HeldOutLoss
from trmoe.train.observe.metrics import TrainingColumns
from trmoe.train.observe.telemetry import TelemetryObserver
from trmoe.train.scheduler import Scheduler

# the classes of `Trainer.producers`, for what lists their columns without a run (docs/training.md's table)
PRODUCERS = (TrainingColumns, Scheduler, Objective, TelemetryObserver, meters.EfficiencyMeter,
             guards.StepGuard, HeldOutLoss, Downstream)  # fmt: skip


def columns_documented() -> tuple[columns.MetricColumn, ...]:
    """Every built-in metrics column in metrics.csv's order, a per-run family by one member named for what
    varies (`acc/<task>`)."""
    return columns.declared(
        columns.Declared((*p.COLUMNS, *(f.member(f"<{p.MEMBER}>") for f in getattr(p, "FAMILIES", ()))))
        for p in PRODUCERS
    )
