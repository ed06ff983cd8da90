"""The wheel must carry every subpackage and the Hydra config tree."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed_for_the_wheel():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "trmoe").rglob("__init__.py")}
    assert found <= listed, f"add to pyproject.toml [tool.setuptools] packages: {sorted(found - listed)}"
    assert setuptools["package-dir"]["trmoe.conf"] == "conf" and (ROOT / "conf" / "__init__.py").is_file()


def test_packaged_config_tree_is_the_conf_folder():
    import trmoe.conf

    assert Path(trmoe.conf.__file__).resolve().parent == ROOT / "conf"
    assert (ROOT / "conf" / "config.yaml").is_file()


def test_version_comes_from_the_package_metadata():
    from importlib.metadata import version

    import trmoe

    assert (
        trmoe.__version__
        == version("trmoe")
        == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    )


@pytest.mark.subprocess
def test_provenance_names_trmoes_checkout_only(tmp_path, monkeypatch):
    """The commit recorded is this checkout's; a trmoe that lies inside another git repository (a venv in the
    user's project) records none: that repository's commit says nothing about trmoe's code."""
    import subprocess

    import trmoe
    from trmoe.runtime import env

    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    record = env.git_commit()
    assert record["version"] == trmoe.__version__
    assert record["commit"] == head.stdout.strip() and isinstance(record["dirty"], bool)

    user_repo = tmp_path / "project"
    installed = user_repo / ".venv" / "lib" / "python3.11" / "site-packages" / "trmoe"
    installed.mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(user_repo)], check=True)
    monkeypatch.setattr(trmoe, "__file__", str(installed / "__init__.py"))
    assert env.source_checkout() is None
    assert env.git_commit() == {"version": trmoe.__version__, "commit": None, "dirty": None}


def test_every_tool_has_a_console_script():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    scripts = project["scripts"]
    tools = {p.parent.name for p in (ROOT / "trmoe").glob("*/__main__.py")} | {"prepare"}
    # top-level tools: match, convert
    tools |= {p.stem for p in (ROOT / "trmoe").glob("*.py") if "\ndef main(" in p.read_text()}
    assert {f"trmoe-{tool}" for tool in tools} <= set(scripts), sorted(scripts)
    import importlib

    for target in scripts.values():  # each names a callable main
        module, _, func = target.partition(":")
        assert callable(getattr(importlib.import_module(module), func)), target


def test_license_is_an_spdx_string_with_its_file():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    assert project["requires-python"] == ">=3.11"  # the floor CI tests (tomllib above)
