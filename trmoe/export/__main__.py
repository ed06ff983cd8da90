"""`python -m trmoe.export <run | checkpoint> --out DIR [--step N] [--format hf|safetensors]`

Writes a trained model as a Hugging Face directory (format hf: loads with transformers'
AutoModelForCausalLM / AutoTokenizer, trust_remote_code=True, offline) or as plain safetensors weights with
config.json (format safetensors). Needs the `hf` extra (transformers, safetensors). Bad input (no such run or
step, an --out that is a file or not empty): one line, exit code 2, nothing written.
"""

from __future__ import annotations

import sys
from pathlib import Path

from trmoe.cli import Parser, run
from trmoe.errors import UserError


def main(argv: list[str] | None = None) -> int:
    return run(_main, argv)


def _main(argv: list[str]) -> int:
    parser = Parser(prog="python -m trmoe.export", description=__doc__.split("\n\n")[1])
    parser.add_argument("run", type=Path, help="run directory, its checkpoints/ directory or one checkpoint")
    parser.add_argument("--out", type=Path, required=True, help="a new or empty directory")
    parser.add_argument(
        "--step", type=int, default=None, help="checkpoint step (default: the newest complete)"
    )
    parser.add_argument("--format", default="hf", choices=["hf", "safetensors"])
    args = parser.parse_args(argv)
    for module in ("safetensors", "transformers") if args.format == "hf" else ("safetensors",):
        try:
            __import__(module)
        except ImportError:
            raise UserError(
                f"--format {args.format}: needs {module}; install: pip install 'trmoe[hf]'"
            ) from None
    from trmoe.export import check_out, export
    from trmoe.load import load_model

    check_out(args.out, args.format)  # before the (slow) load

    out = export(load_model(args.run, args.step, device="cpu", dtype="fp32"), args.out, args.format)
    print(f"trmoe: exported to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
