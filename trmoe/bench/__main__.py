"""python -m trmoe.bench <name> [options]: ffn, dispatch, loss, step, data.

Bad input (an unknown benchmark or option, a value out of range, an unknown config key) is one line on
stderr and exit code 2, before any benchmark work starts and before anything is recorded.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from trmoe.bench.common import Parser, run_cli

BENCHES = ("ffn", "dispatch", "loss", "step", "data")


def _bench(argv: list[str]) -> None:
    parser = Parser(prog="python -m trmoe.bench", description=__doc__)
    parser.add_argument("bench", nargs="?", choices=BENCHES)
    parser.add_argument("options", nargs=argparse.REMAINDER, help="the benchmark's options (<name> --help)")
    args = parser.parse_args(argv)
    if args.bench is None:
        parser.error(f"name a benchmark; allowed: {', '.join(BENCHES)}")
    importlib.import_module(f"trmoe.bench.{args.bench}").main(args.options)


def main(argv: list[str] | None = None) -> int:
    return run_cli(_bench, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
