"""`python -m trmoe.eval run=<run dir> tasks=[arc_easy,hellaswag] [step=N] [limit=N] [include_path=DIR] ...`

Hydra-composed (trmoe.config.schema.EvalToolConfig; every option as key=value): runs lm-evaluation-harness
with trmoe's model class on a run's checkpoint and writes the harness's figures to <run>/eval/<step>.json
(a later evaluation of the same checkpoint adds its tasks to that file; nothing in it is overwritten). Bad
input (unknown task, a task whose data is not available offline, a run without a checkpoint): one line, exit
code 2.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from trmoe.cli import run
from trmoe.durable import json_text, write_file
from trmoe.errors import UserError, require_writable
from trmoe.run.rundir import RunDir


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize
    from omegaconf import OmegaConf

    import trmoe.config.schema  # noqa: F401  (registers eval_tool)
    from trmoe.config.resolve import compose_error
    from trmoe.config.schema import EvalToolConfig
    from trmoe.config.validate import validate_eval_tool

    if any(a in ("-h", "--help") for a in overrides):
        from trmoe.cli import keys_help

        keys = keys_help(EvalToolConfig)
        print(f"{__doc__.strip()}\n\nKeys (key=value; default, then what it is):\n{keys}")
        raise SystemExit(0)
    for word in overrides:  # Hydra's "str is not a ListConfig" for a list key given one bare name
        key, equals, value = word.partition("=")
        if key in ("tasks", "+tasks") and equals and value and not value.startswith("["):
            raise UserError(f"eval: config error: {word}: tasks is a list; write tasks=[{value}]")
    try:
        with initialize(version_base="1.3", config_path=None):
            cfg = hydra_compose("eval_tool", overrides=list(overrides))
        tool: EvalToolConfig = OmegaConf.to_object(cfg)
    except Exception as e:
        raise UserError(f"eval: {compose_error(e)}") from None
    validate_eval_tool(tool)
    return tool


def _check_device(device: str) -> None:
    """A device asked for by name must be there (never a silent fall-back to the CPU)."""
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device={device}: CUDA is not available here; allowed: auto, cpu")
    if device == "mps" and not torch.backends.mps.is_available():
        raise UserError("device=mps: MPS is not available here; allowed: auto, cpu")


def main(argv: list[str] | None = None) -> int:
    return run(_main, argv)


def _main(argv: list[str]) -> int:
    tool = compose(argv)
    _check_device(tool.device)
    from trmoe.eval import load_tasks, run_tasks
    from trmoe.eval.lm import TRMoELM
    from trmoe.run.find import find_checkpoint

    info = find_checkpoint(tool.run, tool.step)
    out = Path(tool.out) if tool.out else RunDir(info.path.parent.parent).eval_result(info.step)
    earlier = _earlier_record(out, tool, info) if out.exists() else None
    # before the tasks run: a read-only run directory is one line, not a traceback after the evaluation
    require_writable(out, f"out={out}", "allowed: a writable place for the results (out=FILE)")
    load_tasks(list(tool.tasks), tool.include_path)  # before the model: a bad task fails at once
    lm = TRMoELM(run=str(info.path), device=tool.device, dtype=tool.dtype, batch_size=tool.batch_size)
    start = time.perf_counter()
    results = run_tasks(
        lm,
        list(tool.tasks),
        include_path=tool.include_path,
        limit=tool.limit,
        num_fewshot=tool.num_fewshot,
    )
    record = {
        "run": str(Path(tool.run).resolve()),
        "step": info.step,
        "checkpoint": str(info.path.resolve()),
        "tasks": list(tool.tasks),
        "limit": tool.limit,
        "num_fewshot": tool.num_fewshot,  # None: each task's own default
        "seconds": round(time.perf_counter() - start, 3),
        "results": results["results"],
        "n-samples": results.get("n-samples"),
        "versions": results.get("versions"),
    }
    if earlier is not None:  # the tasks of an earlier evaluation of this checkpoint stay beside the new ones
        record = _merged(earlier, record)
    try:  # a disk that filled during the evaluation
        out.parent.mkdir(parents=True, exist_ok=True)
        write_file(out, json_text(record, indent=2, default=str) + "\n", fsync=False)
    except OSError as e:
        raise UserError(f"out={out}: cannot write ({e.strerror or e})") from None
    for task, figures in results["results"].items():
        shown = {k: v for k, v in figures.items() if isinstance(v, float)}
        print(f"{task}: " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(shown.items())))
    print(f"trmoe: results written to {out}", file=sys.stderr)
    return 0


def _earlier_record(out: Path, tool, info) -> dict:
    """The record already at `out`, which this evaluation adds its tasks to: one of the same checkpoint, made
    with the same limit and num_fewshot (else its figures and the new ones would not compare), none of whose
    tasks is asked again (nothing is overwritten). Anything else is one line naming what to change."""
    import json

    fix = "allowed: another file (out=FILE)"
    try:
        earlier = json.loads(out.read_text())
        recorded = list(earlier["tasks"])
        # the run's own eval/<step>.json names its checkpoint by the step (the run may have moved since)
        same = earlier["step"] == info.step
        if tool.out:
            same = same and earlier["checkpoint"] == str(info.path.resolve())
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(
            f"out={out}: exists and is not an evaluation record (nothing is overwritten); {fix}"
        ) from None
    if not same:
        raise UserError(f"out={out}: holds another checkpoint's evaluation (nothing is overwritten); {fix}")
    for key in ("limit", "num_fewshot"):
        if earlier.get(key) != getattr(tool, key):
            was = earlier.get(key)
            raise UserError(
                f"{key}={getattr(tool, key)}: {out} holds {', '.join(recorded)} with {key}={was}, whose "
                f"figures would not compare with these; allowed: {key}={was}, or out=FILE"
            )
    again = [task for task in tool.tasks if task in recorded]
    if again:
        raise UserError(
            f"tasks: {', '.join(again)}: already in {out} (nothing is overwritten); allowed: the other "
            "tasks, or out=FILE"
        )
    return earlier


def _merged(earlier: dict, new: dict) -> dict:
    """One record of both evaluations: the earlier tasks first; per-task entries side by side."""
    merged = {**new, "tasks": [*earlier["tasks"], *new["tasks"]]}
    merged["seconds"] = round(earlier.get("seconds", 0) + new["seconds"], 3)
    for key in ("results", "n-samples", "versions"):
        merged[key] = {**(earlier.get(key) or {}), **(new.get(key) or {})}
    return merged


if __name__ == "__main__":
    sys.exit(main())
