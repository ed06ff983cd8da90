"""python -m trmoe.bench <name> [options]: ffn, dispatch, loss, step, data, decode, coordcheck,
lrtransfer.

Results are appended to bench/results.jsonl, or to $TRMOE_RESULTS. Bad input (an unknown benchmark or
option, a value out of range, an unknown config key, a results path that is a directory or lies under a
file) is one line on stderr and exit code 2, before any benchmark work starts and before anything is
recorded.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from trmoe.bench.common import Parser, results_path
from trmoe.cli import run
from trmoe.errors import UserError, require_writable

BENCHES = ("ffn", "dispatch", "loss", "step", "data", "decode", "coordcheck", "lrtransfer")


def check_results_path() -> Path:
    """The results file `record` appends to (bench/results.jsonl or $TRMOE_RESULTS), checked before any
    benchmark runs: a measurement must not be lost to a path it cannot be written to."""
    path = results_path()
    name = f"TRMOE_RESULTS={path}" if "TRMOE_RESULTS" in os.environ else f"results file {path}"
    allowed = "allowed: a writable file path, e.g. TRMOE_RESULTS=results.jsonl"
    if path.is_dir():
        raise UserError(f"bench: {name} is a directory; {allowed}")
    require_writable(path, f"bench: {name}", allowed)
    return path


def _bench(argv: list[str]) -> None:
    parser = Parser(prog="python -m trmoe.bench", description=__doc__)
    parser.add_argument("bench", nargs="?", choices=BENCHES)
    parser.add_argument("options", nargs=argparse.REMAINDER, help="the benchmark's options (<name> --help)")
    args = parser.parse_args(argv)
    if args.bench is None:
        parser.error(f"name a benchmark; allowed: {', '.join(BENCHES)}")
    check_results_path()
    importlib.import_module(f"trmoe.bench.{args.bench}").main(args.options)


def main(argv: list[str] | None = None) -> int:
    return run(_bench, argv)


if __name__ == "__main__":
    sys.exit(main())
