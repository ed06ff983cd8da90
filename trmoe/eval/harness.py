"""`python -m trmoe.eval.harness --model trmoe --model_args run=<dir>,step=<n> --tasks arc_easy ...`

lm-evaluation-harness's own command line (every option of `lm_eval`) with trmoe's model class registered as
`trmoe` (the harness has no plugin hook for models: this module imports trmoe.eval.lm first)."""

from __future__ import annotations

import sys

import trmoe.eval  # noqa: F401  (offline)
import trmoe.eval.lm  # noqa: F401  (registers --model trmoe)


def main() -> int:
    from lm_eval.__main__ import cli_evaluate

    from trmoe.errors import UserError

    try:
        cli_evaluate()
    except UserError as e:  # a bad run, step or device in --model_args: one line, as the other tools
        print(f"trmoe: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
