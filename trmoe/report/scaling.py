"""The report's Scaling section: the fits of trmoe.report.scaling_laws on the runs of a model ladder
(trmoe.report.ladder), with the honesty checks that decide when no number is printed (docs/scaling.md).

Per arm: L(N, D) = E + A/N^α + B/D^β with bootstrap intervals for every parameter and for the frontier's
exponent γ = αβ/(α+β); the predicted loss at the targets (model profiles at D = tokens_per_param · N). Per
arm against the control: the compute multiplier k with L*_control(k·C) = L*_arm(C) at each rung's compute
(the geometric mean C of the control's fit points there) and at the targets' C, κ = C/(N·D) interpolated
in log C (trmoe.report.ladder.kappa_at). Per arm: a backtest (fit without the largest rung, predict it).
Downstream: the two-step fit of trmoe.report.accuracy_fit.

Over 400 lines on purpose: the section is one story from the fits to what is printed, and its honesty
checks (not identified, the interpolated fallback, not estimable, ln V) must be read beside the figures they
withhold; split, a reader would have to hold two modules to know why a number is missing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from trmoe.report import scaling_laws as sl
from trmoe.report.accuracy_fit import AccuracyFit, fit_accuracy, predict_interval
from trmoe.report.compare import Arm as ReportArm
from trmoe.report.compare import pick_control
from trmoe.report.ladder import Options, Point, is_ladder, kappa_at, n_of, own, read_point, select
from trmoe.report.runs import Run, override_dict
from trmoe.report.scaling_targets import Target, target
from trmoe.report.summary import Summary

Est = tuple[float, float, float]  # estimate, low, high of a 95% interval
FLOOR = "; not estimable: the arm's loss is below the control law's floor E (no compute reaches it)"
FALLBACK = (
    "fallback: interpolated at the rung from the runs (each arm's loss against compute between its budgets), "
    "no law, no interval"
)


@dataclass
class ArmFit:
    name: str
    points: list[Point]
    fit: sl.Fit
    params: dict[str, Est] = field(default_factory=dict)  # E, A, B, alpha, beta, gamma
    predictions: dict[str, Est] = field(default_factory=dict)  # target -> predicted loss
    backtest: sl.Backtest | None = None
    comparison: sl.Comparison | None = None
    refused: str = ""  # why this arm is not compared with the control
    reps: sl.Replicates | None = None  # the bootstrap's laws (the plots' bands)
    fallback: list[tuple[float, str]] = field(default_factory=list)  # per rung: interpolated k, or why not

    @property
    def identified(self) -> bool:
        """The law is identified (sl.fit), its bootstrap dropped at most sl.MAX_DROPPED of the replicates."""
        return self.fit.ok and self.reps is not None and self.reps.identified

    @property
    def why_not(self) -> str:
        if not self.fit.ok:
            return self.fit.reason
        if self.reps is not None and not self.reps.identified:
            return f"not identified: {self.reps.note} (more than {sl.MAX_DROPPED:.0%})"
        return ""

    @property
    def data(self) -> sl.Arm:
        ps = self.points
        return sl.Arm(
            [p.N for p in ps], [p.D for p in ps], [p.L for p in ps], [p.seed for p in ps],
            np.array([p.kappa for p in ps]),
        )  # fmt: skip

    @property
    def label(self) -> str:  # as the report's arms: the plots' colours
        return self.name

    @property
    def max_C(self) -> float:
        return max(p.C for p in self.points)


@dataclass
class Scaling:
    options: Options
    arms: list[ArmFit]
    control: ArmFit | None
    control_note: str
    targets: list[Target]
    at: list[tuple[str, float]]  # where the multipliers are: (rung label or target name, C)
    excluded: list[Point]
    accuracy: list[AccuracyFit]
    accuracy_note: str = ""
    extra: list[tuple[float, float]] = field(default_factory=list)  # the targets' (C, κ)
    max_loss: float = math.inf  # ln V: a predicted loss above the uniform guess's is no figure
    points: list[Point] = field(default_factory=list)  # every ladder run, fit point or not
    missing: list[str] = field(default_factory=list)  # planned runs with no run of their own (ladder.own)

    def decades(self, arm: ArmFit, C: float) -> float:
        """How far beyond the arm's (and the control's) largest run compute C lies, in decades."""
        seen = max(arm.max_C, self.control.max_C if self.control else 0.0)
        return math.log10(C / seen)

    def target_n(self, t: Target) -> float:
        return n_of(t.params, self.options.n_kind)


def _shared_overrides(runs: list[Run]) -> dict[str, str]:
    """The overrides every run of a ladder arm shares (what --control / the grid's control matches)."""
    common = override_dict(runs[0].overrides)
    for run in runs[1:]:
        mine = override_dict(run.overrides)
        common = {k: v for k, v in common.items() if mine.get(k) == v}
    return common


def _reps(arm: ArmFit, opts: Options) -> sl.Replicates:
    data = arm.data
    units = data.units
    picks = sl.draws(len(units.units), opts.samples, opts.seed)
    return sl.bootstrap(data.N, data.D, data.L, arm.fit, units, picks)


def _est(point: float, values, log: bool) -> Est:
    return (point, *sl.interval(point, values, log=log))


def analyse(
    runs: list[Run], summaries: dict[str, Summary], control: str | None, opts: Options | None = None
) -> Scaling | None:
    """The Scaling section of these runs; None when no run carries a "ladder" record."""
    opts = opts or Options()
    ladder_runs = [r for r in runs if is_ladder(r)]
    if not ladder_runs:
        return None
    points = [read_point(r, summaries[r.name], opts.n_kind) for r in ladder_runs]
    missing = own(points)
    usable = select(points)
    by_arm: dict[str, list[Point]] = {}
    for p in usable:
        by_arm.setdefault(p.arm, []).append(p)
    arms = [ArmFit(name, ps, sl.fit([p.N for p in ps], [p.D for p in ps], [p.L for p in ps]))
            for name, ps in by_arm.items()]  # fmt: skip
    names = {r.name: r for r in ladder_runs}
    members = [[names[p.run] for p in a.points] for a in arms]
    # the ladder's arm is the job's `arm` choice: a control named "arm=<grid>/<arm>" matches it even where a
    # branch directory holds no Hydra overrides of its own
    choices = [
        ReportArm(a.name, {"arm": a.name, **_shared_overrides(m)}, m)
        for a, m in zip(arms, members, strict=True)
    ]
    chosen, note = pick_control(choices, control) if choices else (None, "no usable run")
    ctrl = arms[choices.index(chosen)] if chosen is not None else None
    targets = [target(t, tokens_per_param=opts.tokens_per_param) for t in opts.targets]
    out = Scaling(
        opts,
        arms,
        ctrl,
        note,
        targets,
        [],
        [p for p in points if p.excluded],
        [],
        points=points,
        missing=missing,
    )
    out.max_loss = _ln_vocab(ladder_runs)
    rung_n = []  # the control's rungs (the fallback's): their label, the control's N
    if ctrl is not None:
        rungs = sorted({p.rung for p in ctrl.points})
        for rung in rungs:
            at = [p for p in ctrl.points if p.rung == rung]
            out.at.append((f"rung {at[0].rung_label}", float(np.exp(np.mean([np.log(p.C) for p in at])))))
            rung_n.append((rung, at[0].N))
    out.at += [(t.name, t.C) for t in targets]
    extra = out.extra = [(t.C, t.C / (out.target_n(t) * t.D)) for t in targets]
    for arm in arms:
        arm.refused = _refusal(ctrl, arm) if ctrl is not None and arm is not ctrl else ""
        if not arm.fit.ok:
            continue
        reps = None
        if ctrl is not None and arm is not ctrl:
            if not arm.refused and ctrl.fit.ok:
                C = np.array([c for _, c in out.at])
                kappa = (kappa_at(ctrl.points, C, extra), kappa_at(arm.points, C, extra))
                arm.comparison = sl.compare(
                    ctrl.data, arm.data, C, kappa=kappa, samples=opts.samples, seed=opts.seed
                )
                reps = arm.comparison.arm_reps
        reps = arm.reps = reps or _reps(arm, opts)
        if not reps.identified:
            continue
        arm.params = sl.parameter_intervals(arm.fit, reps)
        arm.params["gamma"] = _est(arm.fit.law.gamma, reps.values(lambda law: law.gamma), False)
        for t in targets:
            n = out.target_n(t)
            arm.predictions[t.name] = _est(
                float(arm.fit.law.loss(n, t.D)), reps.values(lambda law, n=n, d=t.D: law.loss(n, d)), True
            )
    for arm in arms:
        c = arm.comparison
        if ctrl is not None and arm is not ctrl and not arm.refused and (c is None or c.reason):
            # each arm's own N at the rung: a dense control's is larger than a routed arm's of one total
            mine = {p.rung: p.N for p in arm.points}
            arm.fallback = [
                sl.interpolated_multiplier(ctrl.data, arm.data, n, C, arm_N=mine.get(rung, math.nan))
                for (rung, n), (_, C) in zip(rung_n, out.at, strict=False)
            ]
    for arm in arms:
        d = arm.data
        arm.backtest = sl.backtest(d.N, d.D, d.L, samples=opts.samples, seed=opts.seed)
    out.accuracy, out.accuracy_note = _downstream(usable, summaries)
    return out


def _ln_vocab(runs: list[Run]) -> float:
    """ln V of the runs' vocabulary (config model.vocab_size, else the embedding's rows): the loss of a
    uniform guess, above which no trained model's loss lies; inf when no run records it."""
    sizes = [r.config_value("model.vocab_size") or (r.record.get("model_spec") or {}).get("embedding_rows")
             for r in runs]  # fmt: skip
    sizes = [float(v) for v in sizes if isinstance(v, int | float) and v > 1]
    return math.log(max(sizes)) if sizes else math.inf


def frontier_band(s: Scaling, arm: ArmFit, C) -> np.ndarray:
    """[3, len(C)]: the arm's frontier L*(C) and its 95% interval (κ interpolated, kappa_at)."""
    kappa = kappa_at(arm.points, C, s.extra)
    point = arm.fit.law.frontier(C, kappa)
    values = arm.reps.values(lambda law: law.frontier(C, kappa)).reshape(-1, len(C))
    return np.array([[point[i], *sl.interval(point[i], values[:, i], log=True)] for i in range(len(C))]).T


def multiplier_band(s: Scaling, arm: ArmFit, C) -> np.ndarray:
    """[3, len(C)]: k(C) of the arm against the control and its 95% interval (the comparison's replicates,
    paired as they were drawn)."""
    c = arm.comparison
    kappa = (kappa_at(s.control.points, C, s.extra), kappa_at(arm.points, C, s.extra))
    point = sl.multiplier(c.control.law, c.arm.law, C, *kappa)
    laws = zip(c.control_reps.laws, c.arm_reps.laws, strict=True)
    values = np.array(
        [sl.multiplier(a, b, C, *kappa) for a, b in laws if a is not None and b is not None]
    ).reshape(-1, len(C))
    return np.array([[point[i], *sl.interval(point[i], values[:, i], log=True)] for i in range(len(C))]).T


def _refusal(control: ArmFit, arm: ArmFit) -> str:
    """Why `arm` is not compared with the control: other (rung, tokens) cells or other data."""
    cells = [[(p.rung, round(p.D)) for p in a.points] for a in (control, arm)]
    why = sl.comparable(*cells)
    data = {p.data for p in control.points} ^ {p.data for p in arm.points}
    if data:
        why = "; ".join(filter(None, [why, "the arms' runs were trained on other data (config `data`)"]))
    return why


def _downstream(points: list[Point], summaries: dict[str, Summary]) -> tuple[list[AccuracyFit], str]:
    """The loss -> accuracy fit of each accuracy column the fit points recorded (pooled over arms)."""
    columns = list(dict.fromkeys(c for p in points for c in summaries[p.run].accuracies))
    if not columns:
        return [], "no fit point recorded a downstream accuracy (`downstream.tasks`: acc/<task> columns)"
    fits = []
    for column in columns:
        pairs = [(p.L, summaries[p.run].accuracies.get(column)) for p in points]
        pairs = [(loss, acc) for loss, acc in pairs if acc is not None and math.isfinite(acc)]
        fits.append(fit_accuracy(column, [a for a, _ in pairs], [b for _, b in pairs]))
    return fits, ""


def _fmt(value: float, digits: int = 4) -> str:
    if value is None or not math.isfinite(value):
        return "not estimable" if value == math.inf else "n/a"
    return f"{value:.{digits}g}"


def _cell(e: Est, digits: int = 4) -> str:
    est, low, high = e
    return f"{_fmt(est, digits)} [{_fmt(low, digits)}, {_fmt(high, digits)}]"


def _flag(s: Scaling, decades: float) -> str:
    if decades > sl.EXTRAPOLATION_DECADES:
        return f"EXTRAPOLATED {decades:.1f} decades beyond the runs (> {sl.EXTRAPOLATION_DECADES:g})"
    return "within the runs" if decades <= 0 else f"{decades:.1f} decades beyond the runs"


POINT_COLUMNS = ("ladder.arm", "ladder.rung", "ladder.role", "ladder.budget_tokens", "scaling.N", "scaling.D")
POINT_COLUMNS += ("scaling.C", "scaling.L", "scaling.fit_point")


def point_cells(s: Scaling, run: str) -> list:
    """report.csv's ladder columns of one run (POINT_COLUMNS; empty for a run outside the ladder)."""
    p = next((p for p in s.points if p.run == run), None)
    if p is None:
        return [""] * len(POINT_COLUMNS)
    return [p.arm, p.rung, p.role, p.budget, p.N, p.D, p.C, p.L, p.excluded or "yes"]


def rows(s: Scaling) -> list[dict]:
    """Every number of the section, one row each (report_scaling.csv): section, arm, what, at, C,
    decades, estimate, low, high, note. No estimate where a check refused one (the note says why)."""
    out = []

    def add(section, arm, what, at="", C=None, decades=None, e=(None, None, None), note=""):
        out.append(dict(section=section, arm=arm, what=what, at=at, C=C, decades=decades,
                        estimate=e[0], low=e[1], high=e[2], note=note))  # fmt: skip

    for p in s.excluded:
        add("excluded", p.arm, "run", p.run, note=p.excluded)
    for m in s.missing:
        add("missing", "", "run", m, note="planned by the sweep, no run of its own")
    for arm in s.arms:
        if not arm.identified:
            fallback = "; fallback: the multipliers at the rungs interpolated from the runs"
            fallback = fallback if arm.fallback else ""
            if not arm.fit.ok and not arm.fit.reason.startswith("not identified"):
                add("fit", arm.name, "law", note=f"not fitted: {arm.fit.reason}{fallback}")
            else:
                why = arm.why_not.removeprefix("not identified: ")
                add("fit", arm.name, "law", note=f"not identified: {why}{fallback}")
        else:
            for name, e in arm.params.items():
                add("fit", arm.name, name, e=e, note=f"{arm.fit.points} runs; {arm.reps.note}")
            for t in s.targets:
                d = s.decades(arm, t.C)
                e, why = _loss_cell(s, arm.predictions[t.name])
                note = "; ".join(filter(None, [_flag(s, d), why]))
                add("prediction", arm.name, "loss", t.name, t.C, d, e, note)
        b = arm.backtest
        if b.reason:
            said = "no figure" if b.reason.startswith(("not identified", "interval not")) else "not fitted"
            add("backtest", arm.name, "loss", f"N={b.N:.6g}", note=f"{said}: {b.reason}")
        else:
            note = f"{b.verdict}; measured {b.measured:.6g}; {b.note}"
            add("backtest", arm.name, "loss", f"N={b.N:.6g}", e=(b.predicted, b.low, b.high), note=note)
    for arm in s.arms:
        if s.control is None or arm is s.control:
            continue
        c = arm.comparison
        if arm.fallback:
            why = (c.reason if c else "") or arm.why_not or s.control.why_not
            for (at, C), (k, missing) in zip(s.at, arm.fallback, strict=False):
                d = s.decades(arm, C)
                e = (k, None, None) if math.isfinite(k) else (None, None, None)
                said = FALLBACK if math.isfinite(k) else f"not estimable: {missing}"
                note = f"law not identified ({why}); {said}"
                add("multiplier", arm.name, "k", at, C, d, e, note)
            for at, C in s.at[len(arm.fallback) :]:
                add("multiplier", arm.name, "k", at, C, s.decades(arm, C),
                    note="not estimable: no identified law to extrapolate with")  # fmt: skip
            continue
        why = arm.refused or (c.reason if c else "") or ("" if arm.fit.ok else f"arm: {arm.fit.reason}")
        why = why or ("" if s.control.fit.ok else f"control: {s.control.fit.reason}")
        if why or c is None:
            add("multiplier", arm.name, "k", "all", note=f"not compared: {why}")
            continue
        paired = "paired seeds" if c.paired else "runs resampled per arm"
        for i, (at, C) in enumerate(s.at):
            d = s.decades(arm, C)
            e = (c.k[i], c.low[i], c.high[i])
            note = f"{_flag(s, d)}; {paired}; {c.note}"
            if not np.isfinite(c.k[i]):
                e, note = (None, None, None), note + FLOOR
            elif not np.isfinite(c.high[i]):
                e = (c.k[i], None, None)
                note += "; interval not estimable (replicates beyond the floor)"
            add("multiplier", arm.name, "k", at, C, d, e, note)
    return out


def markdown(s: Scaling) -> list[str]:
    """The section's lines of report.md."""
    o = s.options
    ctrl = f"`{s.control.name}` ({s.control_note})" if s.control else f"none ({s.control_note})"
    lines = ["", "## Scaling", ""]
    lines.append(
        f"Per arm, L(N, D) = E + A/N^α + B/D^β (Hoffmann et al. 2022) fitted by Huber loss on log-loss from "
        f"several starts; N = `{o.n_kind}` parameters, D = tokens trained, C = trmoe.model.flops per token "
        f"(attention and head included) × D. Fit points: the branch runs (a stable run only where its rung "
        f"has no branch). Intervals: 95%, bootstrap over runs or whole seeds ({o.samples} replicates). "
        f"Control: {ctrl}. k > 1: the control needs k× the compute to reach the arm's loss. Targets: "
        + ", ".join(f"`{t.name}` (N {s.target_n(t):.3g}, D {t.D:.3g}, C {t.C:.3g})" for t in s.targets)
        + f"; beyond {sl.EXTRAPOLATION_DECADES:g} decade(s) of the runs' compute a number is flagged "
        "EXTRAPOLATED. "
        "docs/scaling.md says how to read it."
    )
    if s.excluded:
        by_reason: dict[str, list[str]] = {}
        for p in s.excluded:
            by_reason.setdefault(p.excluded, []).append(p.run)
        lines += ["", f"Left out of the fits ({len(s.excluded)}):", ""]
        lines += [f"- {', '.join(runs)}: {why}" for why, runs in by_reason.items()]
    if s.missing:
        lines += ["", f"Planned by the sweep, no run of its own ({len(s.missing)}):", ""]
        lines += [f"- {m}" for m in s.missing]
    table = rows(s)
    fit_title = "Fits per arm (γ: the frontier's exponent, L* = E + G·(C/κ)^−γ)"
    back_title = "Backtest: the largest rung predicted from the others"
    sections = (
        ("fit", fit_title, ["arm", "parameter", "estimate [95%]", "note"],
         lambda r: [r["arm"], r["what"], _est_cell(r), r["note"]]),
        ("multiplier", "Compute multiplier against the control",
         ["arm", "at", "C (FLOPs)", "k [95%]", "note"],
         lambda r: [r["arm"], r["at"], _fmt(r["C"], 3), _est_cell(r), r["note"]]),
        ("prediction", "Predicted loss at the targets", ["arm", "target", "C (FLOPs)", "loss [95%]", "note"],
         lambda r: [r["arm"], r["at"], _fmt(r["C"], 3), _est_cell(r), r["note"]]),
        ("backtest", back_title, ["arm", "held out", "predicted [95%]", "note"],
         lambda r: [r["arm"], r["at"], _est_cell(r), r["note"]]),
)  # fmt: skip
    for key, title, header, cells in sections:
        mine = [cells(r) for r in table if r["section"] == key]
        if mine:
            lines += ["", f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in mine]
    lines += ["", "### Downstream accuracy (loss → accuracy, two-step)", ""]
    if not s.accuracy:
        lines.append(f"Not fitted: {s.accuracy_note}.")
    for f in s.accuracy:
        if f.params is None:
            lines.append(f"- `{f.column}`: not fitted: {f.reason}.")
            continue
        a, k, L0, b = f.params
        said = [f"`{arm.name}` at `{t}`: {_cell(predict_interval(f, e), 3)}"
                for arm in s.arms for t, e in arm.predictions.items()]  # fmt: skip
        lines.append(
            f"- `{f.column}` = {b:.3f} + {a:.3f} / (1 + exp({k:.3g}·(L − {L0:.3f}))) over {f.points} runs; "
            "predicted: " + ("; ".join(said) or "no fitted loss law") + " (loss interval only)."
        )
    return lines


def _loss_cell(s: Scaling, e: Est) -> tuple[Est, str]:
    """A predicted loss and its interval as figures only within (0, ln V]: beyond, no figure and why."""
    est, low, high = e
    inside = [v is not None and math.isfinite(v) and 0 < v <= s.max_loss for v in e]
    if not inside[0]:
        return (None, None, None), f"predicted loss outside (0, ln V = {s.max_loss:.3g}]: no figure"
    if not all(inside):
        return (est, None, None), f"interval reaches outside (0, ln V = {s.max_loss:.3g}]: not identified"
    return e, ""


def _est_cell(r: dict) -> str:
    if r["estimate"] is None:
        return "—"
    if r["low"] is None or not all(map(math.isfinite, (r["low"], r["high"]))):
        interval = "no interval" if "fallback" in r["note"] else "not identified"
        interval = "not estimable" if "interval not estimable" in r["note"] else interval
        return f"{_fmt(r['estimate'], 3)} [{interval}]"
    return _cell((r["estimate"], r["low"], r["high"]))
