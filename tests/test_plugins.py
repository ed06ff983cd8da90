"""Plug-ins from a user's own package (docs/extending.md): tests/plugins/trmoe-demo-plugins (its own
pyproject.toml with the three entry-point groups) is installed by pip into a folder on sys.path, and the
real train app, in fresh processes, trains with its optimizer, data source and route table, resumes
bit-exactly after a SIGKILL, records the plug-ins' distribution and version, and refuses to resume when the
version changed. tests/plugins/trmoe-broken-plugins holds one broken plug-in of each kind: selecting one is
one line naming it and exit 2; a run that does not select it never hears of it."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import DRIVER, assert_same_run, child_env, metrics_rows, python
from presets import DATA_FAST

pytestmark = pytest.mark.subprocess

PLUGINS = Path(__file__).with_name("plugins")
DEMO = "trmoe-demo-plugins"


def _install(sources: list[Path], target: Path) -> dict[str, str]:
    """pip-install the distributions at `sources` into `target` (built from copies: nothing is written into
    the repository); the environment of a process that has them on its path."""
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "--target", str(target), *map(str, sources)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return child_env(PYTHONPATH=str(target))


def _copy(name: str, where: Path, version: str | None = None) -> Path:
    copy = shutil.copytree(PLUGINS / name, where / name)
    if version is not None:
        toml = copy / "pyproject.toml"
        toml.write_text(toml.read_text().replace('version = "0.1.0"', f'version = "{version}"'))
    return copy


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, dict[str, str]]:
    """Environments: `v1` has the demo plug-ins 0.1.0 and the broken ones installed; `v2` the demo 0.2.0."""
    root = tmp_path_factory.mktemp("plugins")
    sources = [_copy(DEMO, root / "src1"), _copy("trmoe-broken-plugins", root / "src1")]
    return {
        "v1": _install(sources, root / "site1"),
        "v2": _install([_copy(DEMO, root / "src2", version="0.2.0")], root / "site2"),
    }


def _lines(where: Path) -> Path:
    text = "\n".join(f"line {i}: the {w} sat on a mat of {v}" for i, (w, v) in enumerate(
        [("cat", "wool"), ("dog", "reeds"), ("fox", "moss"), ("owl", "felt")] * 12))  # fmt: skip
    path = where / "lines.txt"
    path.write_text(text + "\n")
    return path


def _run(env: dict[str, str], cwd: Path, fault: str, *overrides: str) -> subprocess.CompletedProcess:
    """The train app with one fault (resume_driver.py) in a fresh interpreter: the plug-ins are found at
    its start, from its path."""
    return python(DRIVER, fault, *overrides, cwd=cwd, env=env)


def test_each_plugin_kind_trains_resumes_bit_exactly_and_is_recorded(installed, tmp_path):
    base = [
        *DATA_FAST,
        "optimizer=demo_signum",
        "optimizer.lr=1e-3",
        "data=demo_lines",
        f"data.path={_lines(tmp_path)}",
        "routing=demo_stride",
        "trainer.steps=4",
        "trainer.log_every=1",
        "trainer.eval_every=2",
        "checkpoint.every_steps=2",
    ]
    whole = _run(installed["v1"], tmp_path, "none", *base, "run.name=whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    rows = metrics_rows(tmp_path / "runs" / "whole")
    assert [r["step"] for r in rows] == ["0", "1", "2", "3", "4"]
    assert all(math.isfinite(float(r["train_loss"])) for r in rows[1:])
    record = json.loads((tmp_path / "runs" / "whole" / "run_config.json").read_text())
    recorded = {
        axis: {name: (origin["dist"], origin["version"]) for name, origin in picked.items()}
        for axis, picked in record["derived"]["plugins"].items()
    }
    demo = (DEMO, "0.1.0")
    assert recorded == {
        "optimizer": {"demo_signum": demo},
        "data": {"demo_lines": demo},
        "routing": {"demo_stride": demo},
    }
    assert record["derived"]["plugins"]["optimizer"]["demo_signum"]["entry_point"] == (
        "trmoe_demo_plugins.optimizer:VARIANT"
    )
    assert record["config"]["optimizer"]["signum_momentum"] == 0.9  # the plug-in's option, with its default

    killed = _run(installed["v1"], tmp_path, "step:2:after", *base, "run.name=resumed")
    assert killed.returncode == -9, killed.stderr[-3000:]
    # the plug-in was upgraded between the attempts: its code is part of what is trained
    upgraded = _run(installed["v2"], tmp_path, "none", *base, "run.name=resumed")
    assert upgraded.returncode == 2, upgraded.stderr[-3000:]
    for key in ("optimizer.demo_signum", "data.demo_lines", "routing.demo_stride"):  # the diff names each
        assert f"derived.plugins.{key}.version" in upgraded.stderr, upgraded.stderr
    assert "0.2.0" in upgraded.stderr and "Traceback" not in upgraded.stderr
    resumed = _run(installed["v1"], tmp_path, "none", *base, "run.name=resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed at step 2" in (tmp_path / "runs" / "resumed" / "train.log").read_text()
    assert_same_run(tmp_path / "runs" / "resumed", tmp_path / "runs" / "whole")


@pytest.mark.parametrize(
    ("selection", "fault"),
    [
        ("optimizer=broken_import", "ModuleNotFoundError: No module named 'trmoe_dependency_that_is_not_"),
        ("optimizer=bad_options", "options must be a dataclass"),
        ("optimizer=bad_types", "its options cannot be config keys"),
        ("routing=not_a_table", "must be a trmoe.model.routing.Strategy"),
        ("data=no_builder", "its build is not callable"),
        ("optimizer=demo_signum optimizer.signum_momentum=1.5", "signum_momentum=1.5: must be in [0, 1)"),
        ("optimizer=demo_signum optimizer.signum_momentun=0.5", "did you mean signum_momentum?"),
    ],
)  # fmt: skip
def test_a_broken_plugin_or_a_bad_option_is_one_line(installed, tmp_path, selection, fault):
    proc = python("-m", "trmoe.train", *selection.split(), cwd=tmp_path, env=installed["v1"])
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and fault in lines[0], proc.stderr
    if selection.split("=")[1] in ("broken_import", "bad_options", "bad_types", "not_a_table", "no_builder"):
        assert "plug-in" in lines[0] and "trmoe-broken-plugins 0.0.1" in lines[0], lines[0]
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_broken_plugins_leave_other_runs_and_the_builtins_alone(installed, tmp_path):
    """With every broken plug-in installed, a run that selects none of them trains; the plug-in that takes a
    built-in's name (`lion`) is refused and the built-in stays what `optimizer=lion` selects."""
    code = (
        "from trmoe.config.optimizers import OPTIMIZERS\n"
        "print(OPTIMIZERS.origin('lion').plugin, 'name is taken' in OPTIMIZERS.broken['lion'])\n"
    )
    proc = python("-c", code, cwd=tmp_path, env=installed["v1"])
    assert proc.stdout.split() == ["False", "True"], proc.stderr
    run = python(DRIVER, "none", *DATA_FAST, "data=random", "model.vocab_size=256", "trainer.steps=2",
                 "optimizer=lion", "run.name=plain", cwd=tmp_path, env=installed["v1"])  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    record = json.loads((tmp_path / "runs" / "plain" / "run_config.json").read_text())
    assert "plugins" not in record["derived"]  # built-ins only: nothing recorded, as before plug-ins existed


def test_docs_show_the_demo_package_as_it_is():
    """docs/extending.md shows every file of the demo plug-in package verbatim (this test trains it)."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "extending.md").read_text()
    root = PLUGINS / DEMO
    for name in (
        "pyproject.toml",
        *(f"trmoe_demo_plugins/{p.name}" for p in (root / "trmoe_demo_plugins").glob("*.py")),
    ):
        if name.endswith("__init__.py"):
            continue
        assert (root / name).read_text().rstrip() in doc, f"docs/extending.md: show {name} as it is"
