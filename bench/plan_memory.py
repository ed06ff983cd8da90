"""The planner's memory estimate (`python -m trmoe.plan`) against the measured peak of real training steps.

Each argument is one config (space-separated overrides). For each, the real train loop
(trmoe.train.loop.train) runs a few steps in this process on the GPU, single process, and
torch.cuda.max_memory_allocated() is compared with the plan's total and its activations:

    python bench/plan_memory.py "model=100m trainer.micro_batch=8 trainer.seq_len=1024" \
        "model=1b trainer.micro_batch=4 trainer.seq_len=2048 trainer.activation_checkpointing=true"

Prints one JSON line per config (and appends it to $OUT/plan_memory.jsonl when OUT is set). The results
measured on an H200 are in docs/distributed.md ("Planning a large run").
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import open_dict

from trmoe.plan.build import compose_run_config, make_plan
from trmoe.train.loop import train

BASE = [
    "hardware=cuda",
    "data=random",
    "trainer.steps=3",
    "trainer.eval_every=0",
    "trainer.eval_batches=1",
    "checkpoint.every_steps=0",
    "run.progress=log",
]


def measure(overrides: list[str]) -> dict:
    plan = make_plan(overrides)
    raw = compose_run_config(overrides)
    with open_dict(raw):
        del raw["hydra"]
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        train(raw, Path(d) / "run")
    peak = torch.cuda.max_memory_allocated() if cuda else None
    items = {it["what"]: it["bytes"] for it in plan["memory"]["items"]}
    estimate = plan["memory"]["total_bytes"]
    return {
        "overrides": overrides,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "strategy": plan["memory"]["strategy"],
        "estimate_gib": estimate / 2**30,
        "measured_peak_gib": None if peak is None else peak / 2**30,
        "measured_over_estimate": None if peak is None else peak / estimate,
        "estimate_items_gib": {k: v / 2**30 for k, v in items.items()},
        "seconds": time.perf_counter() - start,
    }


def main(argv: list[str]) -> None:
    out = os.environ.get("OUT")
    for arg in argv:
        row = measure([*BASE, *arg.split()])
        line = json.dumps(row)
        print(line, flush=True)
        if out:
            with open(Path(out) / "plan_memory.jsonl", "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
