"""Arms and paired comparisons.

An arm is one combination of the swept overrides other than the seed (`arm=routing_ablation/dense`,
`routing=random attention=mha`, ...). Each arm is compared with the control arm run by run on the same seed:
the paired difference in final held-out loss, its mean over seeds and a 95% Student-t interval. Pairing
removes what a seed does to both arms alike (data order, initialisation), so the interval is about the arm.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from trmoe.errors import UserError
from trmoe.report.integrity import held_out_windows
from trmoe.report.runs import SEED_KEY, Run, is_hidden_key, override_dict, override_key
from trmoe.report.summary import Summary
from trmoe.run.status import FINISHED


def t975(df: int) -> float:
    """The two-sided 95% Student-t quantile for `df` degrees of freedom (scipy's, the `report` extra)."""
    try:
        from scipy.stats import t
    except ImportError:
        raise UserError(
            "report: needs scipy for its intervals; install: pip install 'trmoe[report]'"
        ) from None
    return float(t.ppf(0.975, df))


def swept_keys(runs: list[Run]) -> list[str]:
    """Keys swept by the launches (multirun directories) of these runs, in order of appearance. A key that
    differs between separate launches is not swept: the comparability check reports it."""
    keys: list[str] = []
    for run in runs:
        keys += [k for k in run.sweep.swept if not is_hidden_key(k)]
    return list(dict.fromkeys(keys))


@dataclass
class Arm:
    label: str
    values: dict[str, str]  # swept key -> value, the seed left out
    runs: list[Run]

    @property
    def seeds(self) -> list[int]:
        return sorted(r.seed for r in self.runs if r.status == FINISHED and r.seed is not None)


def arm_keys(runs: list[Run]) -> list[str]:
    return [k for k in swept_keys(runs) if k != SEED_KEY]


def _launch(run: Run) -> tuple[tuple, str]:
    """Identity and label of the arm a run is when nothing but the seed was swept: its launch — the jobs of
    one multirun (seeds of one configuration) are one arm, a single run is an arm of its own."""
    if run.sweep.path == run.path:
        return (run.name,), run.name
    parent = str(Path(run.name).parent)  # the multirun directory as the report names its runs
    return (str(run.sweep.path.resolve()),), parent if parent != "." else run.sweep.path.name


def group_arms(runs: list[Run]) -> list[Arm]:
    keys = arm_keys(runs)
    arms: dict[tuple, Arm] = {}
    for run in runs:
        values = {k: run.value_of(k) for k in keys}
        if keys:
            ident, label = tuple(values.items()), " ".join(f"{k}={v}" for k, v in values.items())
        else:
            ident, label = _launch(run)
        if ident not in arms:
            arms[ident] = Arm(label, values, [])
        arms[ident].runs.append(run)
    for arm in arms.values():
        if any(_analysis_only(r) for r in arm.runs):
            arm.label += " (analysis only)"
    return list(arms.values())


def _analysis_only(run: Run) -> bool:
    """The run routes on what inference does not have (oracle_future_hash: the target token): its loss is an
    upper bound for analysis, not a model to compare as one."""
    from trmoe.model.routing import REGISTRY

    entry = REGISTRY.get(str(run.config_value("routing.strategy")))
    return entry is not None and entry.analysis_only


def _is_dense(arm: Arm) -> bool:
    runs = [r for r in arm.runs if r.config]
    return bool(runs) and all(
        r.config_value("model.num_experts") == 1 or r.config_value("model.routed_width") == 0 for r in runs
    )


def pick_control(arms: list[Arm], spec: str | None) -> tuple[Arm | None, str]:
    """The control arm and how it was chosen. spec: overrides the arm must have ("arm=topk/dense"), its
    label, or the name of one of its runs (separate runs have no swept overrides)."""
    if spec:
        wanted = override_dict(spec.split())

        def is_match(arm: Arm) -> bool:
            if spec == arm.label or spec in {r.name for r in arm.runs}:
                return True
            return bool(arm.values) and all(arm.values.get(override_key(k)) == v for k, v in wanted.items())

        matches = [a for a in arms if is_match(a)]
        if len(matches) == 1:
            return matches[0], "named by the grid or --control"
        if not matches:
            return None, f"no arm matches the requested control `{spec}`"
        return matches[0], f"`{spec}` matches {len(matches)} arms; the first is used"
    dense = [a for a in arms if _is_dense(a)]
    if len(dense) == 1 and len(arms) > 1:
        return dense[0], "chosen as the only dense arm (E=1 or no routed experts)"
    if arms:
        return arms[0], "the first arm, as no control was named (--control)"
    return None, "no runs"


@dataclass
class Pair:
    arm: Arm
    seeds: list[int]  # seeds both arms finished
    deltas: list[float]  # arm - control, per seed
    arm_mean: float | None
    control_mean: float | None
    excluded: list[str] = field(default_factory=list)  # runs of either arm left out, each with the reason

    @property
    def n(self) -> int:
        return len(self.deltas)

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.deltas) if self.deltas else None

    @property
    def interval(self) -> tuple[float, float] | None:
        if self.n < 2:
            return None
        half = t975(self.n - 1) * statistics.stdev(self.deltas) / math.sqrt(self.n)
        return self.mean - half, self.mean + half

    @property
    def verdict(self) -> str:
        if self.n == 0:
            return "no common finished seed"
        ci = self.interval
        if ci is None:
            return "one seed: no interval, cannot be told from noise"
        if ci[0] > 0:
            return "higher than control"
        if ci[1] < 0:
            return "lower than control"
        return "within noise (the interval contains 0)"


def paired(
    arms: list[Arm],
    control: Arm,
    summaries: dict[str, Summary],
    value: Callable[[Summary], float | None] = lambda s: s.final_eval,
) -> list[Pair]:
    """Each arm against the control on `value` (default: the final held-out loss), seed by seed: the seeds
    both it and the control finished; a diverged run (trmoe.report.integrity) is left out, with the reason,
    so that its non-finite or untrained loss never enters a mean or an interval."""

    def by_seed(arm: Arm, excluded: list[str]) -> dict[int, tuple[float, Run]]:
        out = {}
        for run in arm.runs:
            s = summaries[run.name]
            loss = value(s)
            if run.status == FINISHED and s.diverged:
                excluded.append(f"{run.name} (seed {run.seed}): diverged: {s.diverged}")
            elif run.status == FINISHED and run.seed is not None and loss is not None:
                out[run.seed] = (loss, run)
        return out

    def same_set(seed: int, mine: Run, theirs: Run, excluded: list[str]) -> bool:
        """Both evaluated on one held-out set (its size in windows); an unknown one is not the same."""
        a, b = held_out_windows(mine), held_out_windows(theirs)
        if a is not None and a == b:
            return True
        excluded.append(
            f"{mine.name} (seed {seed}): held-out set of {a if a is not None else 'unknown'} windows, the "
            f"control's {b if b is not None else 'unknown'}: evaluations of different sets are not compared"
        )
        return False

    control_excluded: list[str] = []
    base_runs = by_seed(control, control_excluded)
    base = {seed: loss for seed, (loss, _) in base_runs.items()}
    pairs = []
    for arm in arms:
        if arm is control:
            continue
        excluded = list(control_excluded)
        mine_runs = by_seed(arm, excluded)
        mine = {
            seed: loss
            for seed, (loss, run) in mine_runs.items()
            if seed not in base_runs or same_set(seed, run, base_runs[seed][1], excluded)
        }
        seeds = sorted(set(mine) & set(base))
        pairs.append(
            Pair(
                arm=arm,
                seeds=seeds,
                deltas=[mine[s] - base[s] for s in seeds],
                arm_mean=statistics.fmean(mine[s] for s in seeds) if seeds else None,
                control_mean=statistics.fmean(base[s] for s in seeds) if seeds else None,
                excluded=excluded,
            )
        )
    return pairs
