from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from omegaconf import DictConfig

import trmoe.config.schema  # noqa: F401  (registers the schemas)

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def compose_config(*overrides: str) -> DictConfig:
    """Real Hydra composition of the packaged config tree, as the app does it."""
    with initialize_config_module(version_base="1.3", config_module="trmoe.conf"):
        return compose("config", overrides=list(overrides))


def run_cli(args: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m trmoe.train ...` in a fresh process, from `cwd`."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [sys.executable, "-m", "trmoe.train", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def compose_cfg():
    return compose_config
