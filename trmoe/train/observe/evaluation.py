"""Evaluators: components that measure the model and return metrics columns.

An evaluator is a metrics producer (trmoe.run.columns: `columns_declared()`, `row(step, row)`) with its own
cadence, `due(step)` (a trmoe.run.cadence.Cadence): its `row` is empty at the steps it is not due at.
`Trainer.evaluators` are among the Trainer's producers; a step at which any evaluator is due writes a row.
`HeldOutLoss` is the one every run has (with a data mixture, each source's loss too);
`trmoe.train.observe.downstream.Downstream` (lm-eval tasks) is the other.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from trmoe.config.schema import Config, TrainerConfig
from trmoe.data.evalsets import scored_tokens
from trmoe.data.pipeline import Batch, DataPipeline
from trmoe.loss.tied import chunked_tied_ce
from trmoe.model.transformer import TRMoETransformer
from trmoe.run.cadence import Cadence
from trmoe.run.columns import MetricColumn
from trmoe.runtime import env
from trmoe.train.observe.metrics import ppl


class Evaluator(Protocol):
    def due(self, step: int) -> bool: ...

    def columns_declared(self) -> tuple[MetricColumn, ...]: ...

    def row(self, step: int, row) -> dict[str, float]: ...


def held_out_cadence(t: TrainerConfig) -> Cadence:
    """The held-out evaluation's steps: 0, every trainer.eval_every and the last."""
    return Cadence(t.eval_every, at=(0, t.steps))


@torch.no_grad()
def evaluate(model: TRMoETransformer, batches: list[Batch], cfg: Config, device, amp_dtype) -> float:
    """Mean pure cross-entropy over the fixed held-out batches (always the exact chunked path)."""
    model.eval()
    ce = torch.zeros((), dtype=env.sum_dtype(device), device=device)
    tokens = torch.zeros((), dtype=torch.int64, device=device)
    for inputs, targets in batches:
        inputs, targets = inputs.to(device), targets.to(device)
        with env.autocast(device, amp_dtype):
            hidden = model(inputs, targets=targets) if model.needs_targets else model(inputs)
        sums = chunked_tied_ce(hidden, model.head_weight, targets, chunk_tokens=cfg.loss.chunk_tokens)
        ce += sums.ce.to(ce.dtype)
        tokens += sums.tokens
    model.train()
    return (ce / tokens).item()


class HeldOutLoss:
    """The loss columns, at step 0, every trainer.eval_every steps and the last: held-out loss (and ppl, bits
    per byte) and the loss on a fixed stream of the training split; run_config.json["data"]["metric_streams"]
    names each stream. A mixture adds each source's held-out loss and bpb (`eval_loss/<source>`...); its
    held-out set is theirs together, so the overall loss is their token-weighted mean (each batch is scored
    once)."""

    COLUMNS = (
        MetricColumn("eval_train_loss", "nats/token", "eval/train_loss", slot=5, meaning=(
            "pure cross-entropy on fixed batches of the TRAINING split (repeatable, not held out)")),
        MetricColumn("eval_loss", "nats/token", "eval/loss", plot=True, slot=6, meaning=(
            "pure cross-entropy on the fixed held-out batches")),
        MetricColumn("eval_ppl", "1", "eval/ppl", "exp(eval_loss)", slot=7),
        MetricColumn("eval_bpb", "bits/byte", "eval/bpb", slot=8, meaning=(
            "held-out bits per UTF-8 byte: summed CE / ln 2 / bytes of the scored text (nan: no text)")),
    )  # fmt: skip
    # data=mixture: each source's eval_loss/<source> and eval_bpb/<source> (not plotted: the sum's is)
    FAMILIES = tuple(
        dataclasses.replace(c, plot=False) for c in COLUMNS if c.name in ("eval_loss", "eval_bpb")
    )
    MEMBER = "source"

    def __init__(
        self,
        model: TRMoETransformer,
        data: DataPipeline,
        cfg: Config,
        device: torch.device,
        amp_dtype: torch.dtype | None,
    ):
        self.model, self.data, self.cfg, self.device, self.amp_dtype = model, data, cfg, device, amp_dtype
        self.cadence = held_out_cadence(cfg.trainer)
        sources = [family.member(name) for name in data.sources for family in self.FAMILIES]
        self.declared = (*self.COLUMNS, *sources)

    def columns_declared(self) -> tuple[MetricColumn, ...]:
        return self.declared

    def row(self, step: int, row) -> dict[str, float]:
        return self.columns(step)

    def due(self, step: int) -> bool:
        return self.cadence.due(step)

    def _loss(self, batches: list[Batch]) -> float:
        return evaluate(self.model, batches, self.cfg, self.device, self.amp_dtype)

    def columns(self, step: int) -> dict[str, float]:
        if not self.due(step):
            return {}
        data, per_source = self.data, {}
        for name, part in data.sources.items():
            loss = self._loss(part.eval_set)
            per_source[f"eval_loss/{name}"], per_source[f"eval_bpb/{name}"] = loss, part.bpb(loss)
        if data.sources:
            tokens = {name: scored_tokens(part.eval_set) for name, part in data.sources.items()}
            eval_loss = sum(per_source[f"eval_loss/{n}"] * k for n, k in tokens.items()) / sum(
                tokens.values()
            )
        else:
            eval_loss = self._loss(data.eval_set)
        eval_train_loss = self._loss(data.eval_train_set)
        return {
            "eval_train_loss": eval_train_loss,
            "eval_loss": eval_loss,
            "eval_ppl": ppl(eval_loss),
            "eval_bpb": data.bpb(eval_loss),
            **per_source,
        }
