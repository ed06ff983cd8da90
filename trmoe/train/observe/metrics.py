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
