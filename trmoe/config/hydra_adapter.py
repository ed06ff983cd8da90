"""trmoe's one adapter onto Hydra's command line and sweep expansion; everything else uses Hydra's public API.

Public routes: the overrides grammar (`OverridesParser`, `Override`), and the basic sweeper's expansion
rebuilt on it (`expand_sweep`). One private import remains, and only here: Hydra's own argument parser
(`hydra._internal.utils.get_args_parser`). Hydra has no public way to parse its command line, and parsing it
with Hydra's own parser keeps every flag Hydra accepts (--multirun, --cfg, --config-dir, ...) accepted by
the pre-checks too; if Hydra moves it, this is the one line to change.
"""

from __future__ import annotations

import argparse
import itertools

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import HydraException


def args_parser() -> argparse.ArgumentParser:
    """Hydra's command-line parser (the app's flags and its overrides)."""
    from hydra._internal.utils import get_args_parser

    return get_args_parser()


def parse_overrides(lines: list[str]) -> list[Override]:
    """Hydra's overrides grammar; raises Hydra's parse errors."""
    return OverridesParser.create().parse_overrides(list(lines))


def expand_sweep(overrides: list[Override]) -> list[list[str]]:
    """Every job's override list, in the order Hydra's basic sweeper launches them: the product of each
    key's values, keys in the order they first appear (a key given again replaces its values)."""
    values: dict[str, list[str]] = {}
    for override in overrides:
        key = override.get_key_element()
        if not override.is_sweep_override():
            values[key] = [f"{key}={override.get_value_element_as_str()}"]
        elif override.is_discrete_sweep():
            values[key] = [f"{key}={value}" for value in override.sweep_string_iterator()]
        else:
            raise HydraException(f"the basic sweeper does not support sweep type: {override.value_type.name}")
    return [list(job) for job in itertools.product(*values.values())]
