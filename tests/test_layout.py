"""The shape of trmoe/train/ (docs/architecture.md): the run-lifecycle modules do not import the training
internals, the loop reads in one screen, and a long module says why at its top."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

TRAIN = Path(__file__).resolve().parents[1] / "trmoe" / "train"

# What decides and records a run (and the report that reads it) ...
RUN_LIFECYCLE = (
    "trmoe.run.rundir",
    "trmoe.run.identity",
    "trmoe.run.launch",
    "trmoe.run.checkpoint",
    "trmoe.run.records",
    "trmoe.run.status",
    "trmoe.run.lock",
    "trmoe.run.storage",
    "trmoe.run.signals",
    "trmoe.run.cadence",
    "trmoe.report.runs",
    "trmoe.report.build",
)
# ... and what trains it.
TRAINING_INTERNALS = (
    "trmoe.train.objective",
    "trmoe.train.scheduler",
    "trmoe.train.prepare",
    "trmoe.optim.build",
    "trmoe.optim.schedule",
    "trmoe.train.trainer",
    "trmoe.train.observe.evaluation",
    "trmoe.train.observe.downstream",
    "trmoe.train.observe.output",
    "trmoe.train.guards",
    "trmoe.train.observe.metrics",
    "trmoe.loss.tied",
    "trmoe.model.transformer",
)


def test_run_lifecycle_modules_do_not_import_training_internals():
    """Imported alone, in a fresh interpreter: none of them pulls in a training internal."""
    code = (
        "import importlib, sys\n"
        f"for name in {RUN_LIFECYCLE!r}:\n"
        "    importlib.import_module(name)\n"
        f"print(sorted(m for m in {TRAINING_INTERNALS!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_the_loop_reads_in_one_screen():
    assert len((TRAIN / "loop.py").read_text().splitlines()) <= 60


def test_a_long_module_says_why_at_its_top():
    for path in sorted(TRAIN.parent.rglob("*.py")):
        text = path.read_text()
        if len(text.splitlines()) > 400:
            assert "Over 400 lines on purpose" in (ast.get_docstring(ast.parse(text)) or ""), path.name


def test_train_stays_under_its_budget():
    """trmoe/train/ (train/observe/ included) holds the training job, the Trainer and its observers, under
    3,500 lines: what belongs to another layer (the optimizers' schedules, the loss) lives there (#30)."""
    lines = sum(len(path.read_text().splitlines()) for path in TRAIN.rglob("*.py"))
    assert lines < 3500, f"trmoe/train/ has {lines} lines; move what belongs elsewhere (docs/architecture.md)"
