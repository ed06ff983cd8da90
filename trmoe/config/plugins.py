"""The plug-ins a run selects: which of its variants (optimizer, data sources, route tables) come from a
user's installed distribution rather than from trmoe (trmoe/registry.py, docs/extending.md).

Recorded as `derived.plugins` in run_config.json and every checkpoint's meta (section -> name -> distribution,
version, entry point), so the training view compares them: a resume refuses when a selected plug-in's
distribution or version changed (a plug-in's code is part of what is trained), unless
`trainer.force_resume=true`. Its entry point may move (volatile). A run that selects no plug-in records
nothing here, as before the registries.
"""

from __future__ import annotations

from typing import Any

from trmoe.config.schema import Config
from trmoe.config.validate import selected_variants


def selected_plugins(cfg: Config) -> dict[str, dict[str, dict[str, Any]]]:
    """section (optimizer, data, routing) -> variant name -> its origin's record, for every selected variant
    that is a plug-in."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for registry, name in selected_variants(cfg):
        origin = registry.origin(name)
        if origin.plugin:
            # keyed by the config section (routing, not routing.strategy: a record's keys hold no dots)
            out.setdefault(registry.axis.split(".")[0], {})[name] = origin.record()
    return out
