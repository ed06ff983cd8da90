"""trmoe: pretraining and parameter-matched ablations of TR-Hash MoE language models."""

from __future__ import annotations

import functools


@functools.cache
def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trmoe")
    except PackageNotFoundError:  # a source tree on sys.path that was never installed
        return "0+unknown"


def __getattr__(name: str) -> str:
    # `trmoe.__version__` is looked up on first use: importing the package stays nearly free, which keeps the
    # window before an entry point installs its Ctrl-C handler short (and every child process lighter).
    if name == "__version__":
        return _version()
    raise AttributeError(f"module 'trmoe' has no attribute {name!r}")
