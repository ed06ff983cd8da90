"""The runs of a model ladder as the scaling fits see them (docs/scaling.md, "The report's Scaling section").

A ladder run carries in run_config.json a top-level "ladder" object (written by the ladder experiment):

    {"name", "rung" (0 = smallest), "rung_label", "arm", "seed", "role": "stable" | "branch",
     "budget_tokens" (null for a stable run), "budgets" (the job's planned budgets), "parent_run" (relative
     to the sweep), "parent_step", "sweep" (where the sweep ran), "job" (its Hydra job number)}

`read_point` is the one place that reads it, with the run's other records:

    N = one of its parameter counts (run_config.json "params"; N_KINDS, default non-embedding active)
    D = tokens trained: the `tokens` of the final step's complete metrics.csv row (trmoe.report.summary)
    C = flops_per_token · D      (trmoe.model.flops via trmoe.report.summary: matrices, attention, tied head)
    L = the held-out loss of that row (trmoe.report.integrity); a run without that row, whose records
        disagree, that diverged or did not finish is no fit point (`Point.excluded` says why)

Ownership (`own`): in a sweep (a directory with multirun.yaml) a run is the ladder's own only when it names
the sweep's ladder and the directory the sweep ran in, its (rung, arm, seed) is in the sweep's grid and its
budget in its job's plan, and it sits at its planned place relative to the sweep: `<job>` for the stable run,
`<job>-d<budget tokens>` for a branch. Every other ladder run (a backup copy, a run copied in from another
ladder or sweep) is left out with the reason, and every planned run without its own run is named missing.
Places and the recorded sweep directory are relative or fixed at launch, so a moved sweep still reports; a
moved sweep rerun there (the runs it then trains record the new place, multirun.yaml too) owns every place
one of its stable runs records at its planned place.

Fit points (`select`): the branch runs (each budget's decay); a stable run only for an (arm, rung, seed)
that has no branch (a ladder of plain runs): a stable run that was branched never decayed, so its loss is
not a budget's.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

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
    record: dict = field(default_factory=dict)  # run_config.json's `ladder`
    sweep: Path | None = None  # the sweep directory the run is in now (None outside a sweep)
    where: str = ""  # the run's directory relative to `sweep`

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
        record=lad,
        sweep=run.sweep.path if (run.sweep.path / MULTIRUN).is_file() else None,
        where=Path(os.path.relpath(run.path, run.sweep.path)).as_posix(),
    )


MULTIRUN = "multirun.yaml"
GRID_KEYS = ("ladder.rung", "arm", "trainer.seed")


@dataclass(frozen=True)
class SweepPlan:
    """What a ladder sweep planned, from its multirun.yaml."""

    # runtime.cwd joined with hydra.sweep.dir: where it ran (runs record the same); None where Hydra saved
    # the directory as an interpolation (ladder_smoke's timestamp), which multirun.yaml cannot resolve
    ran_in: str | None
    name: str  # ladder.name
    grid: frozenset[tuple[int, str, int]]  # the jobs' (rung, arm, seed)
    # where else it ran: a sweep moved and rerun keeps runs that record its earlier place (`own`)
    also_ran_in: frozenset[str] = frozenset()


def _grid_values(task: list[str], params: dict, key: str) -> list[str] | None:
    """The values the sweep gives `key`: its command-line override, else hydra.sweeper.params (Hydra's
    order of precedence); None when neither sets it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    given = [o for o in parser.parse_overrides([str(t) for t in task]) if o.get_key_element() == key]
    if not given and key in params:
        given = parser.parse_overrides([f"{key}={params[key]}"])
    if not given:
        return None
    o = given[-1]
    return list(o.sweep_string_iterator()) if o.is_sweep_override() else [str(o.value())]


def sweep_plan(sweep: Path) -> SweepPlan | None:
    """The ladder plan of the sweep in `sweep`; None when its multirun.yaml names no ladder or cannot be
    read (then its runs are fitted as they are)."""
    import yaml

    try:
        cfg = yaml.safe_load((sweep / MULTIRUN).read_text()) or {}
        hydra = cfg["hydra"]
        name = (cfg.get("ladder") or {}).get("name")
        if name is None:
            return None
        task = (hydra.get("overrides") or {}).get("task") or []
        params = (hydra.get("sweeper") or {}).get("params") or {}
        base = {
            "ladder.rung": [str(cfg["ladder"]["rung"])],
            "arm": [hydra["runtime"]["choices"].get("arm") or cfg["routing"]["strategy"]],
            "trainer.seed": [str(cfg["trainer"]["seed"])],
        }
        rungs, arms, seeds = (_grid_values(task, params, k) or base[k] for k in GRID_KEYS)
        grid = frozenset((int(r), str(a), int(s)) for r in rungs for a in arms for s in seeds)
        where = str(hydra["sweep"]["dir"])
        ran_in = None if "${" in where else os.path.normpath(os.path.join(hydra["runtime"]["cwd"], where))
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError, AttributeError):
        return None
    return SweepPlan(ran_in, str(name), grid)


def _place(lad: dict) -> str:
    """Where the ladder puts this run relative to its sweep (trmoe.train.ladder.branch_dir)."""
    job = str(lad["job"])
    return job if lad.get("budget_tokens") is None else f"{job}-d{lad['budget_tokens']}"


def _foreign(p: Point, plan: SweepPlan) -> str:
    """Why `p` is no run of `plan` at all ("" when its records say it is one)."""
    lad = p.record
    if lad.get("job") is None or lad.get("sweep") is None:
        return "not this sweep's plan: its ladder record names no sweep or job (an older run)"
    if p.ladder != plan.name:
        return f"from another ladder: {p.ladder}, not this sweep's {plan.name}"
    if lad["sweep"] != plan.ran_in and lad["sweep"] not in plan.also_ran_in:
        return f"from another sweep: run in {lad['sweep']}, this sweep in {plan.ran_in}"
    if (p.rung, p.arm, p.seed) not in plan.grid:
        return f"not planned: rung {p.rung}, arm {p.arm}, seed {p.seed} is no job of this sweep's grid"
    if p.budget is not None and p.budget not in (lad.get("budgets") or []):
        return f"not planned: budget {p.budget} is not among its job's budgets {lad.get('budgets')}"
    return ""


def own(points: list[Point]) -> list[str]:
    """Mark every run of a ladder sweep that the sweep did not plan, or that is not at its planned place,
    as no fit point (module docstring); returns the planned runs that have no run, one line each. Runs
    outside a sweep, or of a sweep whose multirun.yaml names no ladder, are left as they are."""
    missing: list[str] = []
    for sweep in sorted({p.sweep for p in points if p.sweep is not None}):
        plan = sweep_plan(sweep)
        if plan is None:
            continue
        mine = [p for p in points if p.sweep == sweep]
        if plan.ran_in is None:  # the directory most of the ladder's runs here record: strays are few
            ran = Counter(p.record.get("sweep") for p in mine if p.ladder == plan.name)
            ran.pop(None, None)
            plan = replace(plan, ran_in=ran.most_common(1)[0][0] if ran else "")
        # a sweep moved and rerun: multirun.yaml names the new place, the runs that were complete before the
        # move the old one. Each place one of its stable runs records (at its planned place, of this ladder
        # and grid) is the sweep's; a run copied in from another sweep records a place none of them does
        stables = [
            p.record.get("sweep")
            for p in mine
            if p.role == "stable"
            and p.ladder == plan.name
            and p.record.get("job") is not None
            and p.where == _place(p.record)
            and (p.rung, p.arm, p.seed) in plan.grid
        ]
        plan = replace(plan, also_ran_in=frozenset(s for s in stables if s is not None))
        owned: dict[tuple, Point] = {}
        copies: list[Point] = []
        for p in mine:
            why = _foreign(p, plan)
            if why:
                p.excluded = why
            elif p.where != _place(p.record):
                copies.append(p)
            elif (key := (p.rung, p.arm, p.seed, p.budget)) in owned:  # two jobs of one grid point
                p.excluded = f"duplicate of {owned[key].run}"
            else:
                owned[key] = p
        for p in copies:
            key, place = (p.rung, p.arm, p.seed, p.budget), _place(p.record)
            held = owned.get(key)
            p.excluded = f"duplicate of {held.run}" if held else f"a copy: not at its planned place {place}"
        # the budgets each rung planned and each job's number, as any run of this ladder and sweep records
        budgets: dict[int, set[int]] = {}
        jobs: dict[tuple, int] = {}
        for p in mine:
            if p.record.get("sweep") == plan.ran_in and p.ladder == plan.name:
                budgets.setdefault(p.rung, set()).update(p.record.get("budgets") or [])
                if p.record.get("job") is not None:
                    jobs[(p.rung, p.arm, p.seed)] = p.record["job"]
        for rung, arm, seed in sorted(plan.grid):
            job = jobs.get((rung, arm, seed))
            for budget in [None, *sorted(budgets.get(rung, ()))]:
                if (rung, arm, seed, budget) in owned:
                    continue
                what = "stable run" if budget is None else f"branch of {budget} tokens"
                at = "" if job is None else f" at {_place({'job': job, 'budget_tokens': budget})}"
                missing.append(f"rung {rung}, arm {arm}, seed {seed}: {what}{at}")
            if rung not in budgets:
                no_record = "its branches (no run of the rung records its budgets)"
                missing.append(f"rung {rung}, arm {arm}, seed {seed}: {no_record}")
    return missing


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
