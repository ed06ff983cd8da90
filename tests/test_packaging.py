"""The wheel must carry every subpackage and the Hydra config tree."""

from __future__ import annotations

from pathlib import Path

import tomllib

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
