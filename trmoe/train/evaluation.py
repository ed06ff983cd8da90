"""Evaluators: components that measure the model and return metrics columns.

An evaluator is any object with `columns(model) -> dict[str, float]`, called by `Trainer.evaluate` at
every evaluation step (step 0 of a fresh run, every trainer.eval_every steps and the last one), in the
order of `Trainer.evaluators`; the dictionaries are merged into the metrics row (their keys must be
metrics.csv columns, records.METRIC_COLUMNS). `HeldOutLoss` is the one every run has; a downstream
evaluation or a per-source loss is another evaluator appended to that list.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from trmoe.config.schema import Config
from trmoe.data.pipeline import Batch, DataPipeline
from trmoe.model.transformer import TRMoETransformer
from trmoe.train import env
from trmoe.train.loss import chunked_tied_ce


class Evaluator(Protocol):
    def columns(self, model: TRMoETransformer) -> dict[str, float]: ...


def ppl(loss: float) -> float:
    return math.exp(min(loss, 50.0))


@torch.no_grad()
def evaluate(model: TRMoETransformer, batches: list[Batch], cfg: Config, device, amp_dtype) -> float:
    """Mean pure cross-entropy over the fixed held-out batches (always the exact chunked path)."""
    model.eval()
    ce = torch.zeros((), dtype=env.sum_dtype(device), device=device)
    tokens = torch.zeros((), dtype=torch.int64, device=device)
    for inputs, targets in batches:
        inputs, targets = inputs.to(device), targets.to(device)
        with env.autocast(device, amp_dtype):
            hidden = model(inputs)
        sums = chunked_tied_ce(hidden, model.head_weight, targets, chunk_tokens=cfg.loss.chunk_tokens)
        ce += sums.ce.to(ce.dtype)
        tokens += sums.tokens
    model.train()
    return (ce / tokens).item()


class HeldOutLoss:
    """The loss columns: held-out loss (and ppl, bits per byte) and the loss on a fixed stream of the
    training split; run_config.json["data"]["metric_streams"] names each stream."""

    def __init__(self, data: DataPipeline, cfg: Config, device: torch.device, amp_dtype: torch.dtype | None):
        self.data, self.cfg, self.device, self.amp_dtype = data, cfg, device, amp_dtype

    def columns(self, model: TRMoETransformer) -> dict[str, float]:
        eval_loss = evaluate(model, self.data.eval_set, self.cfg, self.device, self.amp_dtype)
        eval_train_loss = evaluate(model, self.data.eval_train_set, self.cfg, self.device, self.amp_dtype)
        return {
            "eval_train_loss": eval_train_loss,
            "eval_loss": eval_loss,
            "eval_ppl": ppl(eval_loss),
            "eval_bpb": self.data.bpb(eval_loss),
        }
