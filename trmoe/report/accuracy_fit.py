"""Step 2 of the two-step downstream prediction (OLMo's model ladder, Bhagia et al. 2024, arXiv 2412.04403):
task accuracy as a sigmoid of the loss, fitted over the ladder's runs with scipy.optimize.curve_fit. OLMo's
loss is the task's own; downstream.tasks records accuracies only, so here it is the held-out loss:

    Acc(L) = b + a / (1 + exp(k · (L − L0)))      a > 0, k > 0: accuracy rises as the loss falls

Step 1 is the loss law (trmoe.report.scaling_laws); the predicted accuracy at a target is Acc(L̂(N, D)), its
interval the loss interval's ends mapped through Acc (monotone: step 2's own error is not in it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import curve_fit

MIN_POINTS = 6  # four parameters, and two degrees of freedom left


def sigmoid(L, a: float, k: float, L0: float, b: float):
    return b + a / (1 + np.exp(k * (np.asarray(L, dtype=float) - L0)))


@dataclass
class AccuracyFit:
    column: str  # acc/<task> or acc_norm/<task>
    params: tuple[float, float, float, float] | None  # a, k, L0, b
    points: int
    reason: str = ""  # why not fitted

    def predict(self, L: float) -> float:
        return float(sigmoid(L, *self.params))


def fit_accuracy(column: str, L, acc) -> AccuracyFit:
    """Acc(L) of the runs' (final loss, final accuracy) pairs, or why it is not fitted."""
    L, acc = np.asarray(L, dtype=float), np.asarray(acc, dtype=float)
    if L.size < MIN_POINTS:
        return AccuracyFit(
            column, None, int(L.size), f"too few runs with {column} ({L.size}; >= {MIN_POINTS})"
        )
    if np.ptp(acc) <= 0:
        return AccuracyFit(column, None, int(L.size), "the accuracy does not vary over the runs")
    p0 = (
        min(2 * float(np.ptp(acc)), 0.99),
        4.0 / max(float(np.ptp(L)), 1e-6),
        float(np.median(L)),
        float(acc.min()),
    )
    bounds = ([0, 0, -np.inf, 0], [1, np.inf, np.inf, 1])
    try:
        params, cov = curve_fit(sigmoid, L, acc, p0=p0, bounds=bounds, maxfev=20000)
    except (RuntimeError, ValueError) as e:
        return AccuracyFit(column, None, int(L.size), f"did not converge ({e})")
    if not np.all(np.isfinite(params)) or not np.all(np.isfinite(np.diag(cov))):
        return AccuracyFit(column, None, int(L.size), "did not converge (parameters not identified)")
    return AccuracyFit(column, tuple(float(v) for v in params), int(L.size))


def predict_interval(fit: AccuracyFit, loss: tuple[float, float, float]) -> tuple[float, float, float]:
    """Acc at a predicted loss (estimate, low, high): the loss interval's ends mapped (the high loss gives
    the low accuracy)."""
    est, low, high = loss
    ends = [fit.predict(v) if math.isfinite(v) else math.nan for v in (est, high, low)]
    return ends[0], ends[1], ends[2]
