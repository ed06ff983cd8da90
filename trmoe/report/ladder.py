"""The runs of a model ladder as the scaling fits see them (docs/scaling.md, "The report's Scaling section").

A ladder run carries in run_config.json a top-level "ladder" object (written by the ladder experiment):

    {"name", "rung" (0 = smallest), "rung_label", "arm", "seed", "role": "stable" | "branch",
     "budget_tokens" (null for a stable run), "parent_run", "parent_step"}

`read_point` is the one place that reads it, with the run's other records:

    N = one of its parameter counts (run_config.json "params"; N_KINDS, default non-embedding active)
    D = tokens trained: the `tokens` of the final step's complete metrics.csv row (trmoe.report.summary)
    C = flops_per_token · D      (trmoe.model.flops via trmoe.report.summary: matrices, attention, tied head)
    L = the held-out loss of that row (trmoe.report.integrity); a run without that row, whose records
        disagree, that diverged or did not finish is no fit point (`Point.excluded` says why)

Fit points (`select`): the branch runs (each budget's decay); a stable run only for an (arm, rung, seed)
that has no branch (a ladder of plain runs): a stable run that was branched never decayed, so its loss is
not a budget's.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

from trmoe.config.resolve import group_options
from trmoe.errors import UserError
from trmoe.report.integrity import assess, value_at
from trmoe.report.runs import Run
from trmoe.report.scaling_targets import DEFAULT_TARGETS, TOKENS_PER_PARAM
from trmoe.report.summary import Summary, flops_per_token
from trmoe.run.status import FINISHED

LADDER_KEY = "ladder"
# N for the fits: name -> (what it counts, its value from run_config.json "params")
N_KINDS = {
    "non_embedding_active": "active parameters minus the embedding (Kaplan et al. 2020)",
    "active": "parameters a token visits, the embedding included",
    "non_embedding": "all parameters minus the embedding (every expert)",
    "total": "all parameters (every expert, the embedding)",
}
DEFAULT_N = "non_embedding_active"


@dataclass(frozen=True)
class Options:
    n_kind: str = DEFAULT_N
    targets: tuple[str, ...] = DEFAULT_TARGETS
    tokens_per_param: float = TOKENS_PER_PARAM
    samples: int = 100  # bootstrap replicates (a standard error needs a few dozen)
    seed: int = 0


MIN_SAMPLES = 10  # fewer replicates do not estimate a standard deviation worth an interval


def parse_scaling(
    n_kind: str, targets: str, samples: int = Options.samples, where: str = "--scaling-samples"
) -> Options:
    """--scaling-n, --scaling-targets and the bootstrap's replicates (`where` names their key in an error),
    checked before anything is read or written."""
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < MIN_SAMPLES:
        raise UserError(
            f"report: {where} {samples}: allowed: an integer >= {MIN_SAMPLES} (bootstrap replicates; a "
            "standard error needs a few dozen)"
        )
    if n_kind not in N_KINDS:
        raise UserError(f"report: --scaling-n {n_kind}: allowed: {', '.join(N_KINDS)}")
    names = tuple(t.strip() for t in targets.split(",") if t.strip())
    allowed = [o for o in group_options("model") if not o.endswith("/...")]
    if not names or set(names) - set(allowed):
        raise UserError(
            f"report: --scaling-targets {targets}: allowed: model profiles, comma-separated "
            f"({', '.join(allowed)})"
        )
    return Options(n_kind=n_kind, targets=names, samples=samples)


def n_of(params: dict, kind: str) -> float | None:
    """The N of `kind` (N_KINDS) from a parameter-count mapping (total, active, embedding)."""
    try:
        total, active, embedding = (float(params[k]) for k in ("total", "active", "embedding"))
    except (KeyError, TypeError, ValueError):
        return None
    return {
        "non_embedding_active": active - embedding,
        "active": active,
        "non_embedding": total - embedding,
        "total": total,
    }[kind]


@dataclass
class Point:
    """One ladder run: where it stands in the ladder, and its (N, D, C, L), or why it is not usable."""

    run: str
    ladder: str
    arm: str
    rung: int
    rung_label: str
    seed: int
    role: str
    budget: int | None
    N: float | None
    D: float | None
    C: float | None
    L: float | None
    data: str  # the run's data choice (config "data", canonical JSON): arms on other data are not compared
    excluded: str = ""  # why it is no fit point ("" when it is one)

    @property
    def kappa(self) -> float:
        """FLOPs per token per parameter of this run: C / (N · D)."""
        return self.C / (self.N * self.D)


def is_ladder(run: Run) -> bool:
    return isinstance(run.record.get(LADDER_KEY), dict)


def read_point(run: Run, summary: Summary, n_kind: str = DEFAULT_N) -> Point:
    """The ladder record of `run` and its (N, D, C, L) (module docstring); `excluded` says what is missing."""
    lad = run.record[LADDER_KEY]
    N = n_of(run.record.get("params") or {}, n_kind)
    D = summary.tokens  # None unless the final step's metrics.csv row is complete
    per_token = flops_per_token(run)
    C = float(per_token) * float(D) if per_token and D else None
    L = summary.final_eval
    why = ""
    if summary.diverged:
        why = f"diverged ({summary.diverged})"
    elif run.status != FINISHED:
        why = f"not finished ({run.status})"
    elif summary.disagreements:
        why = "records disagree: " + "; ".join(summary.disagreements)
    elif D is None or value_at(run, assess(run).final_step, "eval_loss") is None:
        why = "no complete metrics.csv row at its final step"
    elif L is None or not math.isfinite(L):
        why = "no held-out loss at its final step"
    elif not N or N <= 0 or C is None:
        why = "no parameter counts, model spec or token count in run_config.json"
    return Point(
        run=run.name,
        ladder=str(lad.get("name", "")),
        arm=str(lad.get("arm", "")),
        rung=int(lad.get("rung", -1)),
        rung_label=str(lad.get("rung_label", lad.get("rung", ""))),
        seed=int(lad.get("seed", run.seed or 0)),
        role=str(lad.get("role", "stable")),
        budget=lad.get("budget_tokens"),
        N=N,
        D=float(D) if D is not None else None,
        C=C,
        L=L,
        data=json.dumps(run.config.get("data"), sort_keys=True),
        excluded=why,
    )


def select(points: list[Point]) -> list[Point]:
    """Mark the stable runs of a branched (arm, rung, seed) as no fit points (module docstring); returns
    the usable points."""
    branched = {(p.arm, p.rung, p.seed) for p in points if p.role == "branch"}
    for p in points:
        if not p.excluded and p.role != "branch" and (p.arm, p.rung, p.seed) in branched:
            p.excluded = "stable run of a branched rung: its branches are the fit points"
    return [p for p in points if not p.excluded]


def kappa_at(points: list[Point], C, extra: list[tuple[float, float]] = ()) -> np.ndarray:
    """κ at compute C: log-linear interpolation in log C over the rungs' (geometric mean C, geometric mean
    κ) and `extra` (C, κ) pairs (the targets), constant beyond the ends. κ falls with size (the head and
    attention are a shrinking share of a token's FLOPs), so one κ per arm would misplace the frontier."""
    by_rung: dict[int, list[Point]] = {}
    for p in points:
        by_rung.setdefault(p.rung, []).append(p)
    table = [
        (float(np.mean([math.log(p.C) for p in ps])), float(np.mean([math.log(p.kappa) for p in ps])))
        for ps in by_rung.values()
    ]
    table += [(math.log(c), math.log(k)) for c, k in extra]
    table.sort()
    xs, ys = zip(*table, strict=True)
    return np.exp(np.interp(np.log(np.asarray(C, dtype=float)), xs, ys))
