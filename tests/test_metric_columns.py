"""metrics.csv's columns come from the producers' declarations (trmoe.run.columns): the header, its order
(frozen for the columns of earlier versions: users' tools read the file), the trackers' names, the record in
run_config.json and docs/training.md's table."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from helpers import compose_config
from presets import FAST_CPU

from trmoe.run import columns, trackers
from trmoe.run.columns import MetricColumn
from trmoe.train.producers import PRODUCERS, columns_documented

ROOT = Path(__file__).resolve().parents[1]

# metrics.csv's header of every run without per-run families, as trmoe wrote it before the declarations:
# frozen, for the tools that read metrics.csv
FROZEN_HEADER = (
    "step,tokens,train_loss,train_ppl,train_objective,eval_train_loss,eval_loss,eval_ppl,eval_bpb,lr,lr_expert,"
    "lr_shared,grad_norm,tok_s,elapsed_s,mfu,peak_mem_gib,shared_gate,routed_gate,expert_imbalance,expert_dead,"
    "shared_rms,routed_rms,grad_norm_shared,grad_norm_routed,primary_weight,diversity_lambda,diversity,"
    "router_aux,router_z,skipped_steps,loss_spikes"
)


def test_the_builtin_header_is_the_frozen_one():
    fixed = [c.name for c in columns_documented() if "/" not in c.name]
    assert ",".join(fixed) == FROZEN_HEADER
    assert [c.name for c in columns_documented() if "/" in c.name] == [
        "route_bias_spread/<layer>", "route_load_imbalance/<layer>",
        "eval_loss/<source>", "eval_bpb/<source>", "acc/<task>", "acc_norm/<task>",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "extra",
    [[], ["telemetry.moe=true", "routing=learned"], ["optimizer=muon_tr", "guard.spike_factor=3"]],
    ids=["default", "telemetry-learned", "muon-guard"],
)
def test_a_run_writes_the_producers_header(tmp_path, extra):
    from trmoe.train.loop import train

    steps = ["trainer.steps=2", "trainer.log_every=1", "trainer.eval_every=2", "checkpoint.enabled=false"]
    train(compose_config(*FAST_CPU, *steps, *extra), tmp_path / "r")
    with open(tmp_path / "r" / "metrics.csv", newline="") as f:
        header = next(csv.reader(f))
    assert ",".join(header) == FROZEN_HEADER
    record = json.loads((tmp_path / "r" / "run_config.json").read_text())
    assert record["metrics_columns"] == header
    declared = [MetricColumn.from_record(e) for e in record["metrics_declared"]]
    assert [c.name for c in declared] == header
    assert columns.sections(declared)["train_loss"] == "train/loss"


def test_families_follow_the_fixed_columns_in_producer_order():
    class Fake:
        def __init__(self, *cols):
            self.cols = cols

        def columns_declared(self):
            return self.cols

        def row(self, step, row):
            return {}

    loss = MetricColumn("eval_loss", "nats/token", "eval/loss", "held-out loss", slot=6)
    acc = MetricColumn("acc", "accuracy", "downstream/acc", "accuracy", plot=True)
    new = MetricColumn("new_metric", "1", "train/new", "a new column")
    out = columns.declared(
        [
            Fake(MetricColumn("step", "step", "step", "s", slot=0), new),
            Fake(loss, loss.member("a")),
            Fake(acc.member("t")),
        ]
    )
    assert columns.header(out) == ("step", "eval_loss", "new_metric", "eval_loss/a", "acc/t")
    assert out[-1].section == "downstream/acc/t" and out[-1].plot
    with pytest.raises(ValueError, match="twice"):
        columns.declared([Fake(loss), Fake(loss)])


def test_tracker_names_come_from_the_declarations():
    sections = columns.sections(columns_documented())
    assert trackers.tracker_name("train_loss", sections) == "train/loss"
    assert trackers.tracker_name("tok_s", sections) == "throughput/tok_s"
    assert trackers.tracker_name("eval_loss/help", sections) == "eval/loss/help"
    assert trackers.tracker_name("acc_norm/piqa", sections) == "downstream/acc_norm/piqa"
    assert trackers.tracker_name("gone", sections) == "other/gone"


def test_every_producer_declares_its_columns():
    for producer in PRODUCERS:
        assert hasattr(producer, "COLUMNS") and callable(producer.row), producer


def test_docs_table_is_generated_from_the_declarations():
    text = (ROOT / "docs" / "training.md").read_text()
    assert columns.table(columns_documented()) in text, (
        "docs/training.md: paste columns.table(columns_documented())"
    )


def test_runs_before_the_declarations_are_reported_with_the_units_their_columns_have():
    """The report's frozen table of the columns written before run_config.json recorded metrics_declared
    (trmoe.report.runs.BEFORE_DECLARATIONS) agrees with the producers' declarations of those columns."""
    from trmoe.report.runs import undeclared

    before = {*FROZEN_HEADER.split(","), "acc", "acc_norm"}
    for column in columns_documented():
        if column.name.split("/")[0] in before:
            old = undeclared(column.name)
            assert (old.unit, old.plot) == (column.unit, column.plot), column.name
