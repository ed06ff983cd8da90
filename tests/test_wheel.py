"""A new user's install: the sdist and wheel built from a clean checkout (LICENSE in both), installed into a
fresh venv, and every tool run from an unrelated directory that is itself a git repository (the user's): it
trains, logs to TensorBoard and MLflow, sweeps with Optuna, reports, and records the installed version with
no commit (the user's repository is not trmoe's code). The fresh venv sees this venv's dependencies (a .pth
line), so nothing is downloaded but the build backend."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from presets import TINY_RUN

import trmoe

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def _run(cmd: list, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HYDRA_FULL_ERROR")}
    out = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, f"{cmd}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.mark.subprocess
def test_the_wheel_of_a_clean_checkout_trains_sweeps_reports_and_logs(tmp_path):
    clone = tmp_path / "clone"
    _run(["git", "clone", "-q", "--no-hardlinks", ROOT, clone], tmp_path)
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, clone], tmp_path)
    (sdist,) = dist.glob("trmoe-*.tar.gz")
    (wheel,) = dist.glob("trmoe-*.whl")
    with tarfile.open(sdist) as tar:
        assert any(n.endswith("/LICENSE") for n in tar.getnames())
    with zipfile.ZipFile(wheel) as whl:
        names = whl.namelist()
        assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
        assert "trmoe/conf/config.yaml" in names and "trmoe/conf/logger/mlflow.yaml" in names
        metadata = whl.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        assert "License-Expression: Apache-2.0" in metadata

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv], tmp_path)
    (purelib,) = venv.glob("lib/python*/site-packages")
    (purelib / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")  # this venv's dependencies
    _run([venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel], tmp_path)

    user = tmp_path / "user_project"  # the user's own git repository
    user.mkdir()
    _run(["git", "init", "-q"], user)
    where = _run(
        [venv / "bin" / "python", "-c", "import trmoe; print(trmoe.__file__, trmoe.__version__)"], user
    )
    assert where.stdout.split() == [str(purelib / "trmoe" / "__init__.py"), trmoe.__version__]

    tiny = [*TINY_RUN, "hardware=cpu", "hardware.threads=1", "trainer.steps=3"]
    _run([venv / "bin" / "trmoe-train", *tiny, "run.name=w", "logger=[tensorboard,mlflow]"], user)
    run_dir = user / "runs" / "w"
    record = json.loads((run_dir / "run_config.json").read_text())
    assert record["git"] == {"version": trmoe.__version__, "commit": None, "dirty": None}
    assert list(run_dir.glob("events.out.tfevents.*"))  # straight in the run directory: `--logdir runs`
    assert (user / "runs" / "mlflow.db").stat().st_size > 0  # MLflow's local database beside the runs

    search = [o for o in tiny if not o.startswith("optimizer.")]
    _run(
        [venv / "bin" / "trmoe-train", "hparams_search=lr_warmup", "hydra.sweeper.n_trials=2"] + search, user
    )
    (sweep,) = (user / "multirun").glob("*/*")
    assert "2 trials (2 finished) of the Optuna study" in (sweep / "report.md").read_text()

    report = _run([venv / "bin" / "trmoe-report", run_dir, "--no-plots"], user)
    assert "report written to" in report.stdout + report.stderr
    for tool in ("trmoe-plan", "trmoe-match", "trmoe-bench", "trmoe-prepare", "trmoe-convert"):
        assert "usage:" in _run([venv / "bin" / tool, "--help"], user).stdout
