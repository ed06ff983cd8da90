"""python -m trmoe.bench <name> [options]: ffn, dispatch, loss, step, data."""

from __future__ import annotations

import importlib
import sys

BENCHES = ("ffn", "dispatch", "loss", "step", "data")


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in BENCHES:
        print(f"usage: python -m trmoe.bench {{{','.join(BENCHES)}}} [options]", file=sys.stderr)
        sys.exit(2)
    module = importlib.import_module(f"trmoe.bench.{sys.argv[1]}")
    module.main(sys.argv[2:])


if __name__ == "__main__":
    main()
