"""Downstream accuracy during training (`downstream.tasks`): lm-evaluation-harness tasks scored through
trmoe's own harness model class (trmoe.eval.lm.TRMoELM, the one `python -m trmoe.eval` uses) on a fixed
subset (the first `downstream.limit` examples of each task), at `downstream.every` steps (default: the
held-out evaluation's cadence), as metrics.csv columns `acc/<task>` and `acc_norm/<task>`.

Evaluation does not change training: the harness reseeds Python's, numpy's and torch's global generators,
so their states are saved before and restored after it; the model goes back to train mode. Every rank runs
the same requests (an FSDP model's forwards are collective); rank 0 writes the row.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time

import numpy as np
import torch

from trmoe.config.schema import Config, TrainerConfig
from trmoe.errors import UserError
from trmoe.run.cadence import NEVER, Cadence
from trmoe.run.columns import MetricColumn

log = logging.getLogger("trmoe")

METRICS = ("acc", "acc_norm")  # the harness's multiple-choice accuracies (higher is better)


@contextlib.contextmanager
def _rng_untouched(device: torch.device):
    """Python's, numpy's and torch's global generators (the CPU one and `device`'s) as they were before."""
    py, np_state = random.getstate(), np.random.get_state()
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(np_state)


def downstream_cadence(t: TrainerConfig, every: int | None) -> Cadence:
    """Steps 0, every `downstream.every` (None: trainer.eval_every) and the last."""
    return Cadence(t.eval_every if every is None else every, at=(0, t.steps))


class Downstream:
    """Constructed once, before anything is written (so an unknown task, a task whose data is not on this
    machine, or a missing lm-eval is one line, exit 2); `names` are its metrics.csv columns, `due(step)`
    says whether `columns(step)` evaluates at that step. A metrics producer (trmoe.run.columns)."""

    COLUMNS: tuple[MetricColumn, ...] = ()
    # its metrics.csv columns, one of each per task: acc/<task>, acc_norm/<task>
    FAMILIES = (
        MetricColumn("acc", "accuracy", "downstream/acc", "downstream accuracy (higher is better)", True),
        MetricColumn(
            "acc_norm",
            "accuracy",
            "downstream/acc_norm",
            "downstream length-normalised accuracy (higher is better)",
            plot=True,
        ),
    )
    MEMBER = "task"

    def __init__(self, cfg: Config):
        ds = cfg.downstream
        self._tokenizer = cfg.tokenizer
        self.tasks = list(ds.tasks)
        self.limit, self.include_path, self.batch_size = ds.limit, ds.include_path, ds.batch_size
        self.cadence = downstream_cadence(cfg.trainer, ds.every) if self.tasks else NEVER
        self.names: tuple[str, ...] = ()
        self._metrics: dict[str, list[str]] = {}
        self._model = None
        if not self.tasks:
            return
        from trmoe.eval import load_tasks

        _, loaded = load_tasks(self.tasks, self.include_path)
        for task in self.tasks:
            leaves = list(loaded[task]["tasks"].values())
            have = [m for m in METRICS if all(m in leaf.higher_is_better() for leaf in leaves)]
            if not have:
                raise UserError(
                    f"config error: downstream.tasks: {task} reports neither acc nor acc_norm; allowed: "
                    "tasks scored by accuracy (multiple-choice tasks such as arc_easy, hellaswag, piqa)"
                )
            self._metrics[task] = have
        self.names = tuple(f"{m}/{task}" for task in self.tasks for m in self._metrics[task])

    def columns_declared(self) -> tuple[MetricColumn, ...]:
        family = {c.name: c for c in self.FAMILIES}
        return tuple(family[m].member(task) for task in self.tasks for m in self._metrics[task])

    def row(self, step: int, row) -> dict[str, float]:
        return self.columns(step)

    def attach(self, model, device: torch.device, amp_dtype) -> None:
        """The model to evaluate (the plain module: not a DDP or compiled wrapper) and its autocast."""
        if self.tasks:
            # no bar: training's log lines are the progress there, a bar would break them apart
            from trmoe.data.tokenizer import load_tokenizer
            from trmoe.eval.lm import TRMoELM

            tok = load_tokenizer(self._tokenizer.name, self._tokenizer.path)  # the run's (tokenizer.*)
            self._lm = TRMoELM(model=model, batch_size=self.batch_size, progress=False, tokenizer=tok)
            model.train()  # TRMoELM puts it in eval mode; columns() does, and restores, that itself
            self._model, self._device, self._amp_dtype = model, device, amp_dtype

    def due(self, step: int) -> bool:
        return self.cadence.due(step)

    def columns(self, step: int) -> dict[str, float]:
        """acc/<task> and acc_norm/<task> at `step` (nothing when it is not due): an evaluator
        (trmoe.train.observe.evaluation)."""
        if not self.due(step):
            return {}
        from trmoe.eval import run_tasks
        from trmoe.runtime import env

        model, start = self._model, time.perf_counter()
        was_training = model.training
        model.eval()
        try:
            with _rng_untouched(self._device), env.autocast(self._device, self._amp_dtype):
                results = run_tasks(
                    self._lm,
                    self.tasks,
                    include_path=self.include_path,
                    limit=self.limit,
                    bootstrap_iters=0,
                )["results"]
        finally:
            model.train(was_training)
        row = {
            f"{m}/{task}": float(results.get(task, {}).get(f"{m},none", float("nan")))
            for task in self.tasks
            for m in self._metrics[task]
        }
        log.info(
            "step %d | downstream %s (%.1f s)",
            step,
            ", ".join(f"{k} {v:.4f}" for k, v in row.items()),
            time.perf_counter() - start,
        )
        return row
