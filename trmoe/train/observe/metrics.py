"""The metrics window: the running sums behind the next metrics.csv row, as one component.

The sums stay on the device between rows (no host sync except at log steps). Distributed, every rank holds
its own share; a row's means and a checkpoint's `window_totals` are the sums over ranks (one all-reduce).
A checkpoint keeps both: a resume with the same number of ranks loads each rank's own share, one with
another number puts the totals on rank 0 and shares the tokens out as a step shares them, so that a row
written after a resume covers the same steps, with the same sums, as without one.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from trmoe.run.columns import MetricColumn
from trmoe.runtime import distributed, env


class MetricsWindow:
    def __init__(self, device: torch.device):
        self.ce = torch.zeros((), dtype=env.sum_dtype(device), device=device)
        self.objective = torch.zeros((), dtype=env.sum_dtype(device), device=device)
        self.tokens = 0
        self.time = 0.0  # training seconds in the window (tok_s)

    def add(self, ce: torch.Tensor, objective: torch.Tensor, tokens: int) -> None:
        self.ce += ce
        self.objective += objective
        self.tokens += tokens

    def reset(self) -> None:
        self.ce.zero_()
        self.objective.zero_()
        self.tokens, self.time = 0, 0.0

    def totals(self) -> dict[str, float | int]:
        """The window summed over ranks (one all-reduce when distributed)."""
        ce, objective, tokens = distributed.all_reduce_sum(
            self.ce, self.objective, torch.tensor(self.tokens, dtype=torch.float64)
        )
        return {
            "ce": float(ce),
            "objective": float(objective),
            "tokens": int(tokens),
            "world_size": distributed.world_size(),
        }

    def means(self) -> tuple[float, float]:
        """Mean CE and objective per token over the window and all ranks (nan if every step of it was
        skipped): the host sync of a log row."""
        if not distributed.active():
            if self.tokens == 0:
                return math.nan, math.nan
            return (self.ce / self.tokens).item(), (self.objective / self.tokens).item()
        totals = self.totals()
        if totals["tokens"] == 0:
            return math.nan, math.nan
        return totals["ce"] / totals["tokens"], totals["objective"] / totals["tokens"]

    # The checkpoint keeps two entries: "window" (this rank's share; sums as Python floats: exact) and
    # "window_totals" (collective: every rank calls state_dict).
    def state_dict(self) -> dict[str, Any]:
        own = {
            "ce": self.ce.item(),
            "objective": self.objective.item(),
            "tokens": self.tokens,
            "time": self.time,
        }
        return {"window": own, "window_totals": self.totals()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        own, totals = state["window"], state.get("window_totals")
        world_size = distributed.world_size()
        if totals is not None and totals["world_size"] != world_size:
            first = distributed.rank() == 0
            own = {
                "ce": totals["ce"] if first else 0.0,
                "objective": totals["objective"] if first else 0.0,
                "tokens": totals["tokens"] // world_size,
                "time": own["time"],
            }
        self.ce.fill_(own["ce"])
        self.objective.fill_(own["objective"])
        self.tokens, self.time = int(own["tokens"]), float(own["time"])


def ppl(loss: float) -> float:
    return math.exp(min(loss, 50.0))


class TrainingColumns:
    """The first columns of every metrics row, a producer (trmoe.run.columns): the step, the tokens, the
    window's losses and throughput, the last step's gradient norm (`grad_norm`, set by the step)."""

    COLUMNS = (
        MetricColumn("step", "step", "step", "the optimizer step the row is written after", slot=0),
        MetricColumn("tokens", "tokens", "train/tokens", "training tokens so far, all ranks", slot=1),
        MetricColumn("train_loss", "nats/token", "train/loss", plot=True, slot=2, meaning=(
            "pure cross-entropy, mean over the tokens of the steps since the last row")),
        MetricColumn("train_ppl", "1", "train/ppl", "exp(train_loss)", slot=3),
        MetricColumn("train_objective", "nats/token", "train/objective", slot=4, meaning=(
            "what was optimised: smoothed CE + z-loss term (+ router losses, diversity penalty)")),
        MetricColumn("grad_norm", "1", "optim/grad_norm", "global gradient norm before clipping", slot=12),
        MetricColumn("tok_s", "tokens/s", "throughput/tok_s", plot=True, slot=13, meaning=(
            "training tokens per second over the logging window, evaluation time excluded")),
        MetricColumn("elapsed_s", "s", "throughput/elapsed_s", "training time so far", slot=14),
    )  # fmt: skip

    def __init__(self, window: MetricsWindow, state, world_size: int):
        self.window, self.state, self.world_size = window, state, world_size
        self.grad_norm: torch.Tensor | None = None
        self._means = (math.nan, math.nan)

    def columns_declared(self) -> tuple[MetricColumn, ...]:
        return self.COLUMNS

    def sync(self) -> None:
        """The window's host sync (and all-reduce), before the clock stops for the row."""
        self._means = self.window.means()

    def row(self, step: int, row) -> dict[str, Any]:
        (train_ce, train_objective), window = self._means, self.window
        return {
            "step": step,
            "tokens": self.state.tokens,
            "train_loss": train_ce,
            "train_ppl": ppl(train_ce),
            "train_objective": train_objective,
            "grad_norm": None if self.grad_norm is None else self.grad_norm.item(),
            "tok_s": window.tokens * self.world_size / max(window.time, 1e-9),
            "elapsed_s": self.state.train_time,
        }


class NullMetrics:
    """metrics.csv on ranks > 0: rows are computed (collectively) but rank 0 alone writes them."""

    rows = 0

    def write(self, row) -> None:
        pass

    def sync(self) -> dict:
        return {}

    def rewind(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass
