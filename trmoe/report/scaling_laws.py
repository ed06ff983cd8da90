"""Scaling-law fits of a model ladder: the Chinchilla form, its compute frontier, compute multipliers
between arms, bootstrap intervals and a backtest (docs/scaling.md). numpy and scipy only: no torch.

    L(N, D) = E + A / N^α + B / D^β                       N parameters, D training tokens (Hoffmann et al.
                                                          2022, approach 3)
    fit:      minimise Σ_i Huber_δ( LSE(e, a − α ln N_i, b − β ln D_i) − ln L_i )   e, a, b = ln E, ln A, ln B
              (δ = 1e-3, in log-loss: robust to a bad run), Huber_δ(r) = r²/2 for |r| ≤ δ, δ|r| − δ²/2
              beyond; scipy.optimize.least_squares (trust region reflective, analytic Jacobian, α and β
              bounded, E in [min L / E_SPAN, min L]) from a grid of starts, a bootstrap refit by
              scipy.optimize.minimize (SLSQP, same cost and bounds, analytic gradient; the trust region
              where it fails) from the same grid plus the full fit's optimum; ln N and ln D are centred
              on the data's geometric means for conditioning, and A, B reported in the original units
    identified: no parameter on its bound (E, α, β), and the runs reject each exponent halved and doubled
              (profile of the squared log residuals, likelihood-ratio test at 95%); otherwise no law
    compute:  C = κ · N · D, κ = training FLOPs per token per parameter (6 for the matrix multiplies alone;
              the ladder measures it from trmoe.model.flops, attention included, per arm)
    frontier: the least loss at compute C, over N with D = C / (κ N):
              N_opt = g · X^(β/(α+β)),  g = (αA / (βB))^(1/(α+β)),  X = C / κ
              L*(C) = E + G · X^(−γ),   γ = αβ / (α+β),  G = A g^(−α) + B g^β
    inverse:  C(L) = κ · (G / (L − E))^(1/γ)       (infinite for L ≤ E: beyond the law's floor)
    multiplier of an arm against the control at compute C: k(C) = C_control(L*_arm(C)) / C, i.e.
              L*_control(k · C) = L*_arm(C); k > 1: the arm reaches the control's loss with 1/k of its compute

Intervals are bootstrap standard-error intervals, estimate ± z·sd over the replicates (on the log scale for
multipliers and losses; Efron & Tibshirani 1993, ch. 13: a few dozen replicates estimate a standard error,
percentiles need thousands): the runs of each arm are resampled with replacement (cases
bootstrap; with the seed as the unit when every cell has several seeds: whole seeds are drawn, the same ones
for every arm, so paired seeds stay paired) and each replicate is refitted from the full fit's grid of starts
and its optimum. A replicate that does not converge or sits on a bound is dropped and counted; above
MAX_DROPPED the interval is not identified. E, α and β get their intervals on the logit scale of their
bounds (inside them). The backtest fits without the largest rung and
predicts its runs; its interval is a bootstrap prediction interval (each replicate's prediction plus a
resampled residual of the reduced fit).

Over 400 lines on purpose: the estimator (the law, its cost, the two solvers, the starts) and what is derived
from it (bootstrap, multipliers, intervals, backtest) are one method under the formulas above, in the order
docs/scaling.md explains them.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import Bounds, least_squares, minimize
from scipy.stats import norm

DELTA = 1e-3  # Huber threshold on log-loss residuals (Hoffmann et al. 2022)
BOUNDS = (1e-3, 3.0)  # α, β: an exponent at a bound is not identified by the data
# E, the floor, lies in [min L / E_SPAN, min L]: below a hundredth of the least loss the runs cannot tell a
# floor from a small exponent (E → 0 trades against A/N^α with α → 0), above it the floor is already reached
E_SPAN = 100.0
PROFILE_FACTOR = 2.0  # an exponent is identified when the runs reject α/2 and 2α (likewise β) ...
PROFILE_CHI2 = 3.841  # ... by a likelihood-ratio test at 95%: ΔSSR > χ²₁(0.95) σ̂² (σ̂² = SSR / (n − 5))
MAX_DROPPED = 0.2  # more than this share of replicates dropped: the interval is not identified
AT_BOUND = 1e-5  # a parameter within this of a bound (internal scale: ln E, α, β) sits on it
MIN_RUNGS = 3  # distinct N: fewer cannot separate E from A/N^α
MIN_POINTS = 7  # five parameters, and at least two degrees of freedom left
MIN_SEEDS = 3  # whole seeds resampled from 3 on: 2 give 3 distinct resamples, no standard error
EXTRAPOLATION_DECADES = 1.0  # a target more than this many decades of compute beyond the data is flagged


@dataclass(frozen=True)
class Law:
    """L(N, D) = E + A/N^α + B/D^β."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float

    def loss(self, N, D):
        return self.E + self.A / np.power(N, self.alpha) + self.B / np.power(D, self.beta)

    @property
    def gamma(self) -> float:
        return self.alpha * self.beta / (self.alpha + self.beta)

    def _g_G(self) -> tuple[float, float]:
        g = (self.alpha * self.A / (self.beta * self.B)) ** (1 / (self.alpha + self.beta))
        return g, self.A * g ** (-self.alpha) + self.B * g**self.beta

    def n_opt(self, C, kappa: float):
        g, _ = self._g_G()
        return g * np.power(np.asarray(C, dtype=float) / kappa, self.beta / (self.alpha + self.beta))

    def frontier(self, C, kappa: float):
        """L*(C): the least loss at compute C."""
        _, G = self._g_G()
        return self.E + G * np.power(np.asarray(C, dtype=float) / kappa, -self.gamma)

    def compute_for(self, L, kappa: float):
        """C(L), the frontier's inverse; inf where L <= E."""
        _, G = self._g_G()
        gap = np.asarray(L, dtype=float) - self.E
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(
                gap > 0, kappa * np.power(G / np.where(gap > 0, gap, 1.0), 1 / self.gamma), np.inf
            )

    def to_dict(self) -> dict[str, float]:
        return {"E": self.E, "A": self.A, "B": self.B, "alpha": self.alpha, "beta": self.beta}


def multiplier(control: Law, arm: Law, C, kappa_control: float, kappa_arm: float):
    """k(C) with L*_control(k·C) = L*_arm(C)."""
    C = np.asarray(C, dtype=float)
    return control.compute_for(arm.frontier(C, kappa_arm), kappa_control) / C


@dataclass
class Fit:
    """A fitted law, or why there is none (`reason`: too few rungs or points, no convergence, or not
    identified: a parameter on its bound or an exponent whose profile is flat within the noise)."""

    law: Law | None
    reason: str = ""
    points: int = 0
    theta: np.ndarray | None = field(default=None, repr=False)  # internal parameters, for warm starts
    centre: tuple[float, float] = (0.0, 0.0)  # ln N0, ln D0
    bounds: Bounds | None = field(default=None, repr=False)  # of θ: the replicates keep the full fit's
    starts: list[np.ndarray] = field(default_factory=list, repr=False)  # the grid the replicates reuse

    @property
    def ok(self) -> bool:
        return self.law is not None

    @property
    def e_bounds(self) -> tuple[float, float]:
        """E's bounds [min L / E_SPAN, min L] of this fit."""
        return math.exp(self.bounds.lb[0]), math.exp(self.bounds.ub[0])


def _bounds(y) -> Bounds:
    """θ = (ln E, ln A', α, ln B', β): ln E in [ln min L − ln E_SPAN, ln min L], α and β in BOUNDS."""
    top = float(np.min(y))
    lb = [top - math.log(E_SPAN), -np.inf, BOUNDS[0], -np.inf, BOUNDS[0]]
    return Bounds(lb, [top, np.inf, BOUNDS[1], np.inf, BOUNDS[1]])


def _lse(theta, n, d, y):
    """r_i = LSE(e, a − α n_i, b − β d_i) − y_i and the softmax w of the terms: ∂r_i/∂(e, a, α, b, β) =
    (w0, w1, −w1 n_i, w2, −w2 d_i)."""
    t1, t2 = theta[1] - theta[2] * n, theta[3] - theta[4] * d
    top = np.maximum(np.maximum(t1, t2), theta[0])
    w = np.exp(theta[0] - top), np.exp(t1 - top), np.exp(t2 - top)
    total = w[0] + w[1] + w[2]
    return top + np.log(total) - y, [v / total for v in w]


def _fun(theta, n, d, y):
    return _lse(theta, n, d, y)[0]


def _jac(theta, n, d, y):
    _, (w0, w1, w2) = _lse(theta, n, d, y)
    return np.stack([w0, w1, -w1 * n, w2, -w2 * d], axis=1)


def _huber(theta, n, d, y, delta):
    """Σ_i Huber_δ(r_i)/δ = Σ_i u_i (r_i − δ u_i/2), u = clip(r/δ, −1, 1), and its gradient Σ_i u_i ∂r_i/∂θ:
    least_squares' cost (loss="huber", f_scale=δ) in units of δ, on which SLSQP takes 15% fewer steps."""
    r, (w0, w1, w2) = _lse(theta, n, d, y)
    u = np.clip(r / delta, -1.0, 1.0)
    q1, q2 = u * w1, u * w2
    return u @ (r - delta * u / 2), np.array([u @ w0, q1.sum(), -(q1 @ n), q2.sum(), -(q2 @ d)])


def _solve(theta0, n, d, y, delta, bounds: Bounds, *, fast: bool = False):
    """From a grid start, least_squares' trust region (it explores: of one test ladder's two optima it finds
    the lower, SLSQP the higher). For a bootstrap replicate (`fast`), SLSQP on the same cost, ~2x faster:
    with δ below the noise most residuals sit on Huber's linear part, whose curvature the trust region's
    Gauss-Newton model drops, so it creeps (docs/performance.md); ftol, absolute on the cost in units of δ,
    is ~1e-12 relative. The trust region takes over where SLSQP does not converge."""
    theta0 = np.clip(theta0, bounds.lb, bounds.ub)
    if fast:
        options = {"ftol": 1e-13, "maxiter": 1000}
        result = minimize(_huber, theta0, (n, d, y, delta), "SLSQP", jac=True, bounds=bounds, options=options)
        if result.success:
            result.cost = result.fun * delta
            return result
    return least_squares(_fun, theta0, _jac, bounds, args=(n, d, y), loss="huber", f_scale=delta)


def _starts(y) -> list[np.ndarray]:
    floor = float(np.min(y))
    out = []
    for frac, alpha, beta in itertools.product((0.5, 0.9), (0.25, 0.6), (0.25, 0.6)):
        e = floor + math.log(frac)
        rest = math.log(max(math.exp(floor) * (1 - frac), 1e-6))
        out.append(np.array([e, rest, alpha, rest, beta]))
    return out


def _law(theta, centre) -> Law:
    e, a, alpha, b, beta = (float(v) for v in theta)
    n0, d0 = centre
    return Law(math.exp(e), math.exp(a + alpha * n0), math.exp(b + beta * d0), alpha, beta)


def _on_bound(result, bounds: Bounds) -> str:
    """Why the optimum is no estimate ("" when it is one): no convergence, or a parameter on its bound."""
    if not result.success or not np.all(np.isfinite(result.x)):
        return f"did not converge ({result.message})"
    for i, name in ((0, "E"), (2, "alpha"), (4, "beta")):
        lb, ub, value = bounds.lb[i], bounds.ub[i], result.x[i]
        if min(value - lb, ub - value) < AT_BOUND:
            shown = math.exp(value) if i == 0 else value
            return f"not identified: {name} at its bound {shown:.3g}"
    return ""


def _flat_profile(best, n, d, y, bounds: Bounds) -> str:
    """Why an exponent is not identified by the runs' scatter ("" when both are): the profile of the sum of
    squared log residuals over α (likewise β), the other parameters refitted, must rise by more than
    PROFILE_CHI2 σ̂² at α/PROFILE_FACTOR and at α·PROFILE_FACTOR (clipped to the bounds): the runs reject
    an exponent half or twice as large (docs/scaling.md)."""
    plain = least_squares(_fun, best.x, _jac, bounds, args=(n, d, y))
    ssr = 2 * plain.cost
    dof = len(y) - 5
    sigma2 = max(ssr / dof, 1e-300)
    for i, name in ((2, "alpha"), (4, "beta")):
        keep = [j for j in range(5) if j != i]

        def fun(p, v, i=i, keep=keep):
            theta = np.insert(p, i, v)
            return _fun(theta, n, d, y)

        def jac(p, v, i=i, keep=keep):
            theta = np.insert(p, i, v)
            return _jac(theta, n, d, y)[:, keep]

        sub = Bounds(bounds.lb[keep], bounds.ub[keep])
        for factor in (1 / PROFILE_FACTOR, PROFILE_FACTOR):
            v = float(np.clip(plain.x[i] * factor, bounds.lb[i], bounds.ub[i]))
            p0 = np.clip(plain.x[keep], sub.lb, sub.ub)
            rise = 2 * least_squares(fun, p0, jac, sub, args=(v,)).cost - ssr
            if rise < PROFILE_CHI2 * sigma2:
                return (
                    f"not identified: the cost's profile over {name} is flat within the noise ({name} = "
                    f"{v:.3g} fits as well: Δ SSR {rise / sigma2:.2f} σ² < {PROFILE_CHI2})"
                )
    return ""


def fit(N, D, L, *, delta: float = DELTA, start: Fit | None = None) -> Fit:
    """The Chinchilla law of runs (N_i, D_i, final loss L_i), checked for identification. `start`: a
    bootstrap replicate of that fit: the same centre, bounds and grid of starts plus that fit's optimum,
    solved by SLSQP; only the bounds are checked (the profile is the full fit's)."""
    N, D, L = (np.asarray(v, dtype=float) for v in (N, D, L))
    if len(np.unique(N)) < MIN_RUNGS:
        return Fit(None, f"too few rungs ({len(np.unique(N))} sizes; a fit needs >= {MIN_RUNGS})", len(L))
    if len(L) < MIN_POINTS:
        return Fit(None, f"too few runs ({len(L)}; a fit of 5 parameters needs >= {MIN_POINTS})", len(L))
    if len(np.unique(np.round(np.log(D / N), 6))) < 2 and len(np.unique(D)) < MIN_RUNGS:
        return Fit(
            None, "one token budget per size and too few budgets: alpha and beta are not separable", len(L)
        )
    replicate = start is not None and start.theta is not None
    y = np.log(L)
    if replicate:
        centre, bounds, starts = start.centre, start.bounds, [*start.starts, start.theta]
    else:
        centre = (float(np.mean(np.log(N))), float(np.mean(np.log(D))))
        bounds, starts = _bounds(y), _starts(y)
    n, d = np.log(N) - centre[0], np.log(D) - centre[1]
    results = [_solve(theta0, n, d, y, delta, bounds, fast=replicate) for theta0 in starts]
    best = min(results, key=lambda r: r.cost if r.success else math.inf)
    why = _on_bound(best, bounds) or ("" if replicate else _flat_profile(best, n, d, y, bounds))
    if why:
        return Fit(None, why, len(L))
    return Fit(_law(best.x, centre), "", len(L), best.x, centre, bounds, starts if not replicate else [])


@dataclass
class Groups:
    """How the bootstrap resamples: the run indices of each unit (a seed, or each run on its own)."""

    units: list[np.ndarray]


def resampling_units(seeds, cells) -> Groups:
    """Whole seeds when every cell (rung x budget) holds >= MIN_SEEDS distinct seeds, else single runs."""
    seeds, cells = np.asarray(seeds), [tuple(c) for c in cells]
    per_cell: dict[tuple, set] = {}
    for s, c in zip(seeds, cells, strict=True):
        per_cell.setdefault(c, set()).add(s)
    if per_cell and min(len(v) for v in per_cell.values()) >= MIN_SEEDS:
        return Groups([np.flatnonzero(seeds == s) for s in sorted(set(seeds.tolist()))])
    return Groups([np.array([i]) for i in range(len(seeds))])


@dataclass
class Replicates:
    """The bootstrap's refitted laws (None where a replicate did not converge or sat on a bound: dropped,
    and counted)."""

    laws: list[Law | None]

    @property
    def dropped(self) -> int:
        return sum(law is None for law in self.laws)

    @property
    def identified(self) -> bool:
        """At most MAX_DROPPED of the replicates dropped: dropping more would narrow the interval to the
        resamples that happen to identify the law."""
        return bool(self.laws) and self.dropped <= MAX_DROPPED * len(self.laws)

    @property
    def note(self) -> str:
        """e.g. "100 replicates, 42 not converged" (shown beside every interval they give)."""
        return f"{len(self.laws)} replicates, {self.dropped} not converged"

    def values(self, f) -> np.ndarray:
        """f(law) over the converged replicates (stacked)."""
        return np.array([f(law) for law in self.laws if law is not None])


def draws(units: int, samples: int, seed: int) -> np.ndarray:
    """[samples, units] unit indices drawn with replacement (shared by the arms: paired seeds stay paired)."""
    return np.random.default_rng(seed).integers(0, units, size=(samples, units))


def bootstrap(N, D, L, full: Fit, groups: Groups, picks: np.ndarray) -> Replicates:
    """Refit every resample (`picks`: rows of unit indices) from the full fit's grid of starts and its
    optimum; a replicate on a bound is dropped (counted in Replicates.dropped)."""
    N, D, L = (np.asarray(v, dtype=float) for v in (N, D, L))
    laws = []
    for row in picks:
        index = np.concatenate([groups.units[u] for u in row])
        laws.append(fit(N[index], D[index], L[index], start=full).law)
    return Replicates(laws)


@dataclass
class Arm:
    """One arm's usable runs: parameters N, tokens D, final loss L, seed, and κ (FLOPs per token per N)."""

    N: np.ndarray
    D: np.ndarray
    L: np.ndarray
    seeds: np.ndarray
    kappa: float | np.ndarray  # one κ, or each run's C_i / (N_i D_i)

    def __post_init__(self):
        self.N, self.D, self.L = (np.asarray(v, dtype=float) for v in (self.N, self.D, self.L))
        self.seeds = np.asarray(self.seeds)

    @property
    def units(self) -> Groups:
        return resampling_units(self.seeds, zip(self.N, self.D, strict=True))


@dataclass
class Comparison:
    """The compute multiplier of an arm against the control at computes C, with intervals; `reason` says
    why there is no number (either fit not identified, or too many replicates dropped)."""

    C: np.ndarray
    k: np.ndarray
    low: np.ndarray
    high: np.ndarray
    control: Fit
    arm: Fit
    control_reps: Replicates | None = None
    arm_reps: Replicates | None = None
    paired: bool = False
    reason: str = ""
    decades: np.ndarray | None = None  # log10(C / the largest compute of the runs), per C (> 0: beyond)

    @property
    def extrapolated(self) -> np.ndarray:
        return self.decades > EXTRAPOLATION_DECADES

    @property
    def note(self) -> str:
        """The replicates of both arms, e.g. "control: 30 replicates, 2 not converged; arm: ..."."""
        reps = (("control", self.control_reps), ("arm", self.arm_reps))
        return "; ".join(f"{who}: {r.note}" for who, r in reps if r is not None)


def compare(
    control: Arm, arm: Arm, C, *, kappa=None, samples: int = 100, seed: int = 0, level: float = 0.95
) -> Comparison:
    """k(C) of `arm` against `control` (module docstring) and its bootstrap interval. Paired when both
    resample whole seeds and share them (the same seeds drawn for both). `kappa`: (κ_control, κ_arm) at
    each C (arrays, or scalars), default the arms' own κ; an arm's κ may be per run (its largest C_i).
    No number (`reason`) unless both laws are identified and neither bootstrap dropped more than
    MAX_DROPPED of its replicates."""
    C = np.atleast_1d(np.asarray(C, dtype=float))
    kappa = kappa or (control.kappa, arm.kappa)
    nan = np.full(C.shape, np.nan)
    seen = max(float(np.max(a.kappa * a.N * a.D)) for a in (control, arm))
    decades = np.log10(C / seen)
    fits = fit(control.N, control.D, control.L), fit(arm.N, arm.D, arm.L)
    if not all(f.ok for f in fits):
        which = "control" if not fits[0].ok else "arm"
        reason = f"{which}: {(fits[0] if which == 'control' else fits[1]).reason}"
        return Comparison(C, nan, nan, nan, *fits, reason=reason, decades=decades)
    k = multiplier(fits[0].law, fits[1].law, C, *kappa)
    units = control.units, arm.units
    by_seed = [len(u.units) < len(a.L) for a, u in zip((control, arm), units, strict=True)]
    paired = all(by_seed) and set(control.seeds.tolist()) == set(arm.seeds.tolist())
    picks = [draws(len(units[0].units), samples, seed)]
    picks.append(picks[0] if paired else draws(len(units[1].units), samples, seed + 1))
    reps = [
        bootstrap(a.N, a.D, a.L, f, u, p)
        for a, f, u, p in zip((control, arm), fits, units, picks, strict=True)
    ]
    for who, r in zip(("control", "arm"), reps, strict=True):
        if not r.identified:
            reason = f"{who}: interval not identified ({r.note}: more than {MAX_DROPPED:.0%})"
            return Comparison(C, nan, nan, nan, *fits, *reps, paired, reason, decades)
    values = np.array(
        [
            multiplier(c, a, C, *kappa)
            for c, a in zip(reps[0].laws, reps[1].laws, strict=True)
            if c is not None and a is not None
        ]
    ).reshape(-1, C.size)
    bounds = np.array([interval(k[i], values[:, i], level, log=True) for i in range(C.size)]).reshape(
        C.size, 2
    )
    return Comparison(C, k, bounds[:, 0], bounds[:, 1], *fits, reps[0], reps[1], paired, "", decades)


def interpolated_multiplier(
    control: Arm, arm: Arm, N: float, C: float, *, arm_N: float | None = None
) -> tuple[float, str]:
    """The fallback where a law is not identified: k at rung N and compute C from the runs alone. Each
    arm's loss against compute at that rung (mean log L per budget, log-log, linear between budgets); the
    arm's loss at C, and the control's compute reaching that loss: k = C_control / C. (nan, why) where C is
    outside the arm's runs at the rung, or the loss outside the control's, or a curve does not fall.
    `arm_N`: the arm's N at that rung where it is not the control's (a dense control matched to a routed
    arm's total has every parameter active, so its N is larger at the same rung)."""
    curves = []
    for a, n in ((control, N), (arm, N if arm_N is None else arm_N)):
        mine = a.N == n
        if not mine.any():
            return math.nan, "no runs at this rung"
        c = np.log(np.broadcast_to(a.kappa, a.N.shape)[mine] * a.N[mine] * a.D[mine])
        budgets = np.unique(np.round(c, 9))
        x = np.array([np.mean(c[np.round(c, 9) == b]) for b in budgets])
        y = np.array([np.mean(np.log(a.L[mine][np.round(c, 9) == b])) for b in budgets])
        if len(x) < 2 or np.any(np.diff(y) >= 0):
            return math.nan, "the loss does not fall with compute at this rung"
        curves.append((x, y))
    (xc, yc), (xa, ya) = curves
    at = math.log(C)
    if not xa[0] <= at <= xa[-1]:
        return math.nan, "outside the arm's runs at this rung"
    loss = float(np.interp(at, xa, ya))
    if not yc[-1] <= loss <= yc[0]:
        return math.nan, "the arm's loss is outside the control's runs at this rung"
    reached = float(np.interp(loss, yc[::-1], xc[::-1]))
    return math.exp(reached - at), ""


def _logit(lo: float, hi: float):
    """(forward, back) of the logit of x in (lo, hi): an interval on this scale stays inside the bounds."""

    def forward(x):
        u = (np.asarray(x, dtype=float) - lo) / (hi - lo)
        return np.log(u) - np.log1p(-u)

    def back(t):
        return lo + (hi - lo) / (1 + math.exp(-t))

    return forward, back


def parameter_intervals(full: Fit, reps: Replicates, level: float = 0.95) -> dict[str, tuple[float, ...]]:
    """(estimate, low, high) of E, A, B, α and β: A, B on the log scale, E, α and β on the logit scale of
    their bounds (their intervals stay inside them); (estimate, nan, nan) when the replicates do not
    identify it (too many dropped, or no spread)."""
    point = full.law.to_dict()
    scales = {"E": _logit(*full.e_bounds), "alpha": _logit(*BOUNDS), "beta": _logit(*BOUNDS)}
    out = {}
    for name, value in point.items():
        values = reps.values(lambda law, n=name: law.to_dict()[n])
        if not reps.identified:
            out[name] = (value, math.nan, math.nan)
        elif name in scales:
            out[name] = (value, *interval(value, values, level, scale=scales[name]))
        else:
            out[name] = (value, *interval(value, values, level, log=True))
    return out


def comparable(control_cells, arm_cells) -> str:
    """Why two arms' runs cannot be compared ("" when they can): each must hold the same (rung, tokens)
    cells, or a multiplier would mix a difference of budgets into the difference of arms."""
    missing = set(map(tuple, control_cells)) ^ set(map(tuple, arm_cells))
    return (
        f"the arms' runs differ in {len(missing)} (rung, tokens) cells, e.g. {sorted(missing)[0]}"
        if missing
        else ""
    )


def interval(point, values, level: float = 0.95, *, log: bool = False, scale=None) -> tuple[float, float]:
    """The bootstrap standard-error interval: point ± z·sd(values) on the log scale (`log`: a ratio or a
    loss, always positive) or on `scale` ((forward, back): a bounded parameter's logit). nan without
    replicates or when they do not spread (an interval of zero width claims what no resample shows);
    (nan, inf) when more than the tail share of the replicates is infinite (a multiplier beyond the control's
    floor): not estimable."""
    values = np.asarray(values, dtype=float)
    values = values[~np.isnan(values)]
    if values.size < 2 or not math.isfinite(point):
        return (math.nan, math.nan)
    if np.isinf(values).sum() > (1 - level) / 2 * values.size:
        return (math.nan, math.inf)  # not estimable: no standard error over replicates that are infinite
    if log:
        scale = (np.log, math.exp)
    forward, back = scale or (np.asarray, float)
    z = float(norm.ppf(0.5 + level / 2))
    finite = values[np.isfinite(values)]
    with np.errstate(divide="ignore", invalid="ignore"):
        moved = np.asarray(forward(finite), dtype=float)
        centre = float(forward(point))
    moved = moved[np.isfinite(moved)]
    sd = float(np.std(moved, ddof=1)) if moved.size > 1 else math.inf
    if not sd > 0 or not math.isfinite(centre):
        return (math.nan, math.nan)
    if not math.isfinite(sd):
        return (math.nan, math.nan)
    return float(back(centre - z * sd)), float(back(centre + z * sd))


BACKTEST_WIDTH = 0.10  # "covered" needs an informative interval: (high − low) / predicted at most this


@dataclass
class Backtest:
    """The largest rung predicted from the others."""

    N: float
    predicted: float  # mean over the rung's runs of the prediction
    measured: float  # mean of their final losses
    low: float
    high: float
    reason: str = ""
    note: str = ""  # the replicates, e.g. "100 replicates, 3 not converged"

    @property
    def relative_error(self) -> float:
        """(predicted − measured) / measured."""
        return (self.predicted - self.measured) / self.measured

    @property
    def informative(self) -> bool:
        """An interval no wider than BACKTEST_WIDTH of the prediction (a ±20% interval covers anything)."""
        width = self.high - self.low
        return math.isfinite(width) and width <= BACKTEST_WIDTH * self.predicted

    @property
    def covered(self) -> bool:
        return self.informative and self.low <= self.measured <= self.high

    @property
    def verdict(self) -> str:
        """covered | NOT covered | not informative (the rule of BACKTEST_WIDTH), with the relative error."""
        width = (self.high - self.low) / self.predicted
        if not self.informative:
            said = f"interval not informative (width {width:.0%} of the prediction > {BACKTEST_WIDTH:.0%})"
        else:
            said = "covered" if self.covered else "NOT covered"
        return f"{said}; relative error {self.relative_error:+.1%}"


def backtest(N, D, L, *, samples: int = 100, seed: int = 0, level: float = 0.95) -> Backtest:
    """Fit without the largest N; predict its runs' mean loss, with a bootstrap prediction interval."""
    N, D, L = (np.asarray(v, dtype=float) for v in (N, D, L))
    top = N.max()
    held, kept = N == top, N < top
    measured = float(np.mean(L[held]))
    reduced = fit(N[kept], D[kept], L[kept])
    if not reduced.ok:
        return Backtest(float(top), math.nan, measured, math.nan, math.nan, reduced.reason)
    predicted = float(np.mean(reduced.law.loss(N[held], D[held])))
    residuals = np.log(L[kept]) - np.log(reduced.law.loss(N[kept], D[kept]))
    groups = Groups([np.array([i]) for i in range(int(kept.sum()))])
    picks = draws(len(groups.units), samples, seed)
    reps = bootstrap(N[kept], D[kept], L[kept], reduced, groups, picks)
    if not reps.identified:
        why = f"interval not identified ({reps.note}: more than {MAX_DROPPED:.0%})"
        return Backtest(float(top), predicted, measured, math.nan, math.nan, why, reps.note)
    noise = np.random.default_rng(seed + 1).choice(residuals, size=len(reps.laws)) / math.sqrt(
        int(held.sum())
    )
    values = [
        float(np.mean(law.loss(N[held], D[held]))) * math.exp(eps)
        for law, eps in zip(reps.laws, noise, strict=True)
        if law is not None
    ]
    low, high = interval(predicted, values, level, log=True)
    return Backtest(float(top), predicted, measured, low, high, "", reps.note)
