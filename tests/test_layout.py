"""The shape of trmoe/train/ (docs/architecture.md): the run-lifecycle modules do not import the training
internals, the loop reads in one screen, and a long module says why at its top. And the two maps of the
package stay true: docs/architecture.md's module index and tests/README.md's table of where a module's
tests are."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "trmoe" / "train"

# What decides and records a run (and the report that reads it) ...
RUN_LIFECYCLE = (
    "trmoe.run.rundir",
    "trmoe.run.identity",
    "trmoe.run.launch",
    "trmoe.run.checkpoint",
    "trmoe.run.find",
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


def _module_files() -> dict[str, set[str]]:
    """trmoe/'s folders (as `trmoe/run/`) -> the module names in each, without `__init__` (a package is its
    folder) and without the Hydra config tree (trmoe.conf is conf/, not source)."""
    out: dict[str, set[str]] = {}
    for path in (ROOT / "trmoe").rglob("*.py"):
        folder = path.parent.relative_to(ROOT).as_posix() + "/"
        if folder.startswith("trmoe/conf/"):
            continue
        names = out.setdefault(folder, set())
        if path.stem != "__init__":
            names.add(path.stem)
    return out


def _architecture_index() -> dict[str, set[str]]:
    """docs/architecture.md's "Module index": folder -> the names it lists (a line that starts with
    whitespace continues the folder above)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"## Module index\n.*?```\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md has no Module index block"
    out: dict[str, set[str]] = {}
    folder = None
    for line in block.group(1).splitlines():
        words = line.split()
        if not words:
            continue
        if not line[0].isspace():
            folder, words = words[0], words[1:]
            assert folder not in out, f"{folder} is listed twice"
            out[folder] = set()
        assert folder is not None, line
        out[folder].update(words)
    return out


def test_architecture_names_every_module():
    """docs/architecture.md's module index lists every module file of trmoe, and nothing that is not one: a
    folder of variants may be listed as `*` (every module in it)."""
    files, index = _module_files(), _architecture_index()
    assert sorted(index) == sorted(files), "folders of trmoe/ vs the index"
    for folder, names in index.items():
        if names == {"*"}:
            continue
        missing, stale = sorted(files[folder] - names), sorted(names - files[folder])
        assert not missing and not stale, f"{folder}: not in the index {missing}; no such module {stale}"


def _readme_table() -> list[tuple[str, str]]:
    """tests/README.md's "Where a module's tests are": (first cell, second cell) of each row."""
    text = (ROOT / "tests" / "README.md").read_text()
    section = text.split("## Where a module's tests are", 1)[1].split("\n## ", 1)[0]
    rows = [line.split(" | ", 1) for line in section.splitlines() if line.startswith("| ")]
    return [(a[2:], b) for a, b in rows[1:]]  # past the header (its rule starts "|-")


def _named_modules(cell: str) -> list[str]:
    """The trmoe paths a first cell names: backticked names outside parentheses; `pkg/mod` sets the package
    that a bare name after it belongs to."""
    while re.search(r"\([^()]*\)", cell):
        cell = re.sub(r"\([^()]*\)", "", cell)
    out, package = [], ""
    for name in re.findall(r"`([^`]+)`", cell):
        if "/" in name.rstrip("/"):
            package = name.rsplit("/", 1)[0] + "/"
            out.append(name)
        elif name.endswith("/") or not package:
            package = ""
            out.append(name)
        else:
            out.append(package + name)
    return out


def test_the_readme_table_of_tests_is_true():
    """Every module the table names exists (a module file or a package folder under trmoe/), every package
    and top-level module of trmoe appears in it, every test file it names exists, and every test file is
    named."""
    trmoe = ROOT / "trmoe"
    named: list[str] = []
    tests_named: set[str] = set()
    for first, second in _readme_table():
        named += _named_modules(first)
        tests_named.update(re.findall(r"`(test_\w+\.py)`", second))
    missing = [n for n in named if not ((trmoe / f"{n}.py").is_file() or (trmoe / n.rstrip("/")).is_dir())]
    assert missing == [], f"tests/README.md names modules trmoe does not have: {missing}"
    packages = {p.name for p in trmoe.iterdir() if (p / "__init__.py").is_file() and p.name != "conf"}
    top = {p.stem for p in trmoe.glob("*.py") if p.stem != "__init__"}
    appears = {n.split("/")[0] for n in named}
    assert sorted((packages | top) - appears) == [], "packages or modules without a row in tests/README.md"
    files = {p.name for p in (ROOT / "tests").glob("test_*.py")}
    assert sorted(tests_named - files) == [], "tests/README.md names test files that do not exist"
    assert sorted(files - tests_named) == [], "test files that tests/README.md does not name"
