"""`trmoe-lm-eval --model trmoe --model_args run=<dir>,step=<n> --tasks arc_easy ...`

lm-evaluation-harness's own command line (every option of `lm_eval`; also `python -m trmoe.eval.harness`)
with trmoe's model class registered as `trmoe` beside every model the harness knows (`--model hf
--model_args pretrained=<export dir>` reads an export). The harness has no plugin hook for models: this module
imports trmoe.eval.lm first, which loads the harness's own models before adding trmoe's (the harness fills
its registry only while it is empty). Two differences from `lm_eval` itself, both for speed: the index of
the harness's own task YAMLs is kept on disk between runs (trmoe.eval.task_index), and `--model trmoe`'s run
and step are checked before anything is indexed."""

from __future__ import annotations

import sys

import trmoe.eval  # noqa: F401  (offline)
import trmoe.eval.lm  # noqa: F401  (registers --model trmoe)
from trmoe.errors import UserError


def main(argv: list[str] | None = None) -> int:
    """The harness's command line; a bad run, step or device in --model_args is one line, as the other
    tools. The harness parses sys.argv itself: an argv given here stands in for it during the call."""
    from trmoe.cli import run

    return run(_evaluate, argv)


def _evaluate(argv: list[str]) -> None:
    import lm_eval.tasks
    from lm_eval.__main__ import cli_evaluate

    from trmoe.eval.task_index import CachedTaskManager

    saved, harness_manager = sys.argv, lm_eval.tasks.TaskManager
    sys.argv = [saved[0] if saved else "trmoe.eval.harness", *argv]
    # the harness builds its TaskManager from this name when it runs: the one that keeps its index on disk
    lm_eval.tasks.TaskManager = CachedTaskManager
    try:
        _check_trmoe_checkpoint()
        cli_evaluate()
    except Exception as e:
        offline = next((c for c in _chain(e) if isinstance(c, ConnectionError)), None)
        if offline is None:  # anything else is the harness's or a bug's: its traceback
            raise
        # datasets' offline refusal (the hub is off: trmoe.eval), which the harness lets out as a traceback
        first = next(iter(str(offline).splitlines()), type(offline).__name__)[:200]
        tasks = _argument(argv, "--tasks") or "?"
        raise UserError(
            f"lm-eval: --tasks {tasks}: a task's data is not available offline ({type(offline).__name__}: "
            f"{first}); allowed: tasks whose data is in the datasets cache, or local task YAMLs "
            "(--include_path)"
        ) from None
    finally:
        sys.argv, lm_eval.tasks.TaskManager = saved, harness_manager


def _chain(e: BaseException | None):
    """The exception and those it was raised from or while handling."""
    while e is not None:
        yield e
        e = e.__cause__ or e.__context__


def _argument(argv: list[str], flag: str) -> str | None:
    """The value of `flag` (`--tasks a,b` or `--tasks=a,b`) in the harness's argv."""
    for i, word in enumerate(argv):
        if word == flag and i + 1 < len(argv):
            return argv[i + 1]
        if word.startswith(f"{flag}="):
            return word.split("=", 1)[1]
    return None


def _check_trmoe_checkpoint() -> None:
    """`--model trmoe`: the run and step of --model_args name a checkpoint, or one line, before the harness
    indexes its ~15,000 task YAMLs (seconds) ahead of building the model. Parsed by the harness's own parser
    (which reads sys.argv), so what is checked is what the harness will pass to the model."""
    from lm_eval._cli import HarnessCLI

    from trmoe.eval.lm import checkpoint_args
    from trmoe.run.find import find_checkpoint

    args = HarnessCLI().parse_args()
    model_args = getattr(args, "model_args", None)
    if getattr(args, "model", None) == "trmoe" and isinstance(model_args, dict):
        find_checkpoint(*checkpoint_args(model_args.get("run"), model_args.get("step")))


if __name__ == "__main__":
    sys.exit(main())
