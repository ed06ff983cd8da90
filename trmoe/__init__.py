"""trmoe: pretraining and parameter-matched ablations of TR-Hash MoE language models."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("trmoe")
except PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "0+unknown"
