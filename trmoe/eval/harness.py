"""`trmoe-lm-eval --model trmoe --model_args run=<dir>,step=<n> --tasks arc_easy ...`

lm-evaluation-harness's own command line (every option of `lm_eval`; also `python -m trmoe.eval.harness`)
with trmoe's model class registered as `trmoe` beside every model the harness knows (`--model hf
--model_args pretrained=<export dir>` reads an export). The harness has no plugin hook for models: this module
imports trmoe.eval.lm first, which loads the harness's own models before adding trmoe's (the harness fills
its registry only while it is empty)."""

from __future__ import annotations

import sys

import trmoe.eval  # noqa: F401  (offline)
import trmoe.eval.lm  # noqa: F401  (registers --model trmoe)


def main(argv: list[str] | None = None) -> int:
    """The harness's command line; a bad run, step or device in --model_args is one line, as the other
    tools. The harness parses sys.argv itself: an argv given here stands in for it during the call."""
    from trmoe.cli import run

    return run(_evaluate, argv)


def _evaluate(argv: list[str]) -> None:
    from lm_eval.__main__ import cli_evaluate

    saved = sys.argv
    sys.argv = [saved[0] if saved else "trmoe.eval.harness", *argv]
    try:
        cli_evaluate()
    finally:
        sys.argv = saved


if __name__ == "__main__":
    sys.exit(main())
