"""`python -m trmoe.eval run=<run dir> tasks=[arc_easy,hellaswag] [step=N] [limit=N] [include_path=DIR] ...`

Hydra-composed (trmoe.config.schema.EvalToolConfig; every option as key=value): runs lm-evaluation-harness
with trmoe's model class on a run's checkpoint and writes the harness's figures to <run>/eval/<step>.json
(never over an existing file). Bad input (unknown task, a task whose data is not available offline, a run
without a checkpoint): one line, exit code 2.
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
    if out.exists():
        raise UserError(f"out={out}: exists (nothing is overwritten); allowed: a new file (out=...)")
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
    try:  # a disk that filled during the evaluation
        out.parent.mkdir(parents=True, exist_ok=True)
        write_file(out, json_text(record, indent=2, default=str) + "\n", fsync=False)
    except OSError as e:
        raise UserError(f"out={out}: cannot write ({e.strerror or e})") from None
    for task, figures in record["results"].items():
        shown = {k: v for k, v in figures.items() if isinstance(v, float)}
        print(f"{task}: " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(shown.items())))
    print(f"trmoe: results written to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
