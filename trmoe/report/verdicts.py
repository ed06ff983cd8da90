"""Verdicts: equivalence tests, the effective speed-up and the time to a target loss, each arm against the
control (docs/report.md, "Verdicts").

**TOST** (two one-sided tests, Schuirmann 1987) on the paired differences Δ_s = arm − control over seeds s:
H0⁻: μ ≤ −δ and H0⁺: μ ≥ +δ, each a one-sided Student-t test; p_equiv = max(p⁻, p⁺). A two-sided Student-t
test of μ = 0 gives p_diff. Over the arms against one control, each family of p-values (equivalence,
difference) is corrected with Holm's step-down method. The verdict, at α = 0.05 family-wise:
"equivalent within δ" when p_equiv (Holm) < α (the arm is within the margin whatever its sign: a difference
smaller than δ is not one the margin calls real), else "better" / "worse" when p_diff (Holm) < α (by the
sign of Δ and whether lower or higher is better), else "inconclusive". Downstream accuracies get the same
test with their own margin (higher is better there).

**Effective speed-up** (Marin's protocol) e = k × ρ: k the compute multiplier (the control needs k times the
arm's compute for the arm's loss) and ρ the throughput ratio (tokens/s of the arm ÷ the control's).
k comes from the Scaling section's fits when the arm's runs are a ladder's (at the control's largest rung),
else from matched-FLOP loss curves per seed: C_arm = FLOPs/token × tokens at the arm's final evaluation,
C_ctrl = where the control's held-out loss curve (its running minimum, linear in log C between evaluations)
first reaches the arm's final loss; k = C_ctrl / C_arm. An arm whose final loss is below anything the
control reached is measured at the control's lowest loss L_c instead: k = C_ctrl(L_c) / C_arm(L_c), C_arm(L_c)
where the arm's own curve first reaches L_c (the compute the arm saves for the control's result; noted per
seed). ρ per seed = exp(mean over the logging windows both
runs logged of log(tok/s arm ÷ tok/s control)) — the same steps, warm-up and evaluation rows left out
(trmoe.report.summary.throughput_rows), tok/s being training time only (no evaluation, no checkpoint). ρ is
refused, with the reason, when the two runs differ in hardware (device, its name, world size), CPU threads,
precision, or compile and telemetry settings. Intervals: 95% Student-t over seeds of log k, log ρ, log e
(with one seed: ρ's and e's over the windows' log ratios, k held fixed); with a ladder's k, its bootstrap
interval and ρ's combined in log space as independent (half-widths in quadrature).

**Time to target**: the training wall-clock (elapsed_s, evaluation excluded) at which a run's held-out loss
first reaches the target, linear between the two evaluations around it; "not reached" when it never does.

Over 400 lines on purpose: the three verdicts share the seed pairing, the settings check and the one section
of report.md and report_verdicts.csv that shows them; the statistics themselves are scipy's.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from trmoe.errors import UserError
from trmoe.report.compare import Arm, Pair, t975
from trmoe.report.runs import Run
from trmoe.report.summary import Summary, flops_per_token, throughput_rows
from trmoe.run.status import FINISHED

DEFAULT_MARGIN = 0.01  # nats/token: the equivalence margin δ of the held-out loss
DEFAULT_ACCURACY_MARGIN = 0.01  # accuracy (a fraction): one point
ALPHA = 0.05  # family-wise error rate of each Holm-corrected family
# What must be equal for a throughput ratio to mean anything: (record key, how the report names it).
SAME_SPEED_SETTINGS = (
    ("backend.device", "device"),
    ("backend.device_name", "device name"),
    ("world_size", "world size"),
    ("config.hardware.threads", "hardware.threads"),
    ("backend.threads", "torch threads"),
    ("config.hardware.precision", "hardware.precision"),
    ("backend.autocast_dtype", "autocast dtype"),
    ("config.trainer.compile", "trainer.compile"),
    ("config.trainer.compile_backend", "trainer.compile_backend"),
    ("config.telemetry", "telemetry settings"),
)


@dataclass
class Options:
    margin: float = DEFAULT_MARGIN
    accuracy_margin: float = DEFAULT_ACCURACY_MARGIN
    target_loss: float | None = None  # None: the control's mean final held-out loss


def parse_positive(option: str, text: str | float | None, allowed: str = "a positive number") -> float | None:
    """A positive finite number given as `option` (None when not given); else one line naming it."""
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise UserError(f"report: {option} {text}: allowed: {allowed}")
    return value


# ---------------------------------------------------------------------------------------------- equivalence


def tost(deltas: list[float], margin: float) -> tuple[float, float]:
    """(p_equiv, p_diff) of paired differences: TOST against ±margin, and the two-sided test of 0. A
    degenerate sample (no spread) gives the p-values its mean alone implies."""
    try:
        from scipy.stats import ttest_1samp
    except ImportError:
        raise UserError(
            "report: needs scipy for its verdicts; install: pip install 'trmoe[report]'"
        ) from None
    if statistics.pstdev(deltas) == 0:  # scipy's t is undefined: every seed agrees exactly
        mean = deltas[0]
        return (0.0 if abs(mean) < margin else 1.0), (0.0 if mean != 0 else 1.0)
    lower = ttest_1samp(deltas, -margin, alternative="greater").pvalue
    upper = ttest_1samp(deltas, margin, alternative="less").pvalue
    diff = ttest_1samp(deltas, 0.0).pvalue
    return float(max(lower, upper)), float(diff)


def holm(pvalues: list[float | None]) -> list[float | None]:
    """Holm's step-down adjusted p-values (None kept: an arm without a test). scipy has no Holm (its
    false_discovery_control is Benjamini-Hochberg), and statsmodels is not a dependency for a few lines."""
    tested = sorted((p, i) for i, p in enumerate(pvalues) if p is not None)
    m, out, running = len(tested), list(pvalues), 0.0
    for rank, (p, i) in enumerate(tested):
        running = max(running, min(1.0, (m - rank) * p))
        out[i] = running
    return out


@dataclass
class Verdict:
    pair: Pair
    margin: float
    p_equiv: float | None = None  # raw TOST p-value
    p_diff: float | None = None  # raw two-sided p-value
    p_equiv_holm: float | None = None
    p_diff_holm: float | None = None
    verdict: str = "inconclusive"


def verdicts(pairs: list[Pair], margin: float, *, higher_is_better: bool = False) -> list[Verdict]:
    """Each arm's verdict against the control (module docstring), Holm-corrected over these arms."""
    out = []
    for p in pairs:
        v = Verdict(p, margin)
        if p.n >= 2:
            v.p_equiv, v.p_diff = tost(p.deltas, margin)
        out.append(v)
    for v, pe, pd in zip(out, holm([v.p_equiv for v in out]), holm([v.p_diff for v in out]), strict=True):
        v.p_equiv_holm, v.p_diff_holm = pe, pd
        if v.pair.n < 2:
            v.verdict = "inconclusive (fewer than 2 paired seeds: no test)"
        elif pe < ALPHA:
            v.verdict = f"equivalent within δ={margin:g}"
        elif pd < ALPHA:
            v.verdict = "better" if (v.pair.mean > 0) == higher_is_better else "worse"
    return out


# ------------------------------------------------------------------------------------- effective speed-up


def _dig(record: dict, dotted: str):
    node = record
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def speed_mismatch(arm: Run, control: Run) -> str | None:
    """Why the two runs' throughputs are not comparable (None: they are): the settings that differ."""
    diffs = []
    for key, name in SAME_SPEED_SETTINGS:
        a, b = _dig(arm.record, key), _dig(control.record, key)
        if a != b:
            diffs.append(f"{name} {a} vs {b}")
    return "; ".join(diffs) or None


def window_log_ratios(arm: Run, control: Run) -> list[float]:
    """log(tok/s arm ÷ tok/s control) of each logging window both runs logged (the same steps)."""
    mine = {s: v for s, _, v in throughput_rows(arm) if v > 0}
    theirs = {s: v for s, _, v in throughput_rows(control) if v > 0}
    return [math.log(mine[s] / theirs[s]) for s in sorted(set(mine) & set(theirs))]


def _log_curve(run: Run) -> list[tuple[float, float]] | None:
    """(log C, running minimum of the held-out loss) at each evaluation; None without FLOPs per token."""
    fpt = flops_per_token(run)
    if not fpt:
        return None
    points, best = [], math.inf
    for _, tokens, loss in run.series("eval_loss"):
        if tokens > 0 and math.isfinite(tokens):
            best = min(best, loss)
            points.append((math.log(fpt * tokens), best))
    return points


def matched_flop_multiplier(arm: Run, arm_summary: Summary, control: Run) -> float | str:
    """k of one seed from the loss curves (module docstring), or why there is none."""
    fpt, curve = flops_per_token(arm), _log_curve(control)
    if not fpt or curve is None:
        return "no FLOPs per token recorded (run_config.json model_spec, params)"
    loss, tokens = arm_summary.final_eval, arm_summary.tokens
    if loss is None or not tokens or not curve:
        return "no final held-out loss and tokens"
    log_arm = math.log(fpt * tokens)
    if loss < curve[-1][1]:
        return _at_control_lowest(arm, curve, log_arm)
    if loss >= curve[0][1]:
        bound = math.exp(curve[0][0] - log_arm)
        return f"the control reached the arm's loss by its first evaluation (k ≤ {bound:.3g})"
    return math.exp(_first_reach(curve, loss) - log_arm)


def _first_reach(curve: list[tuple[float, float]], loss: float) -> float:
    """log C at which a running-minimum curve first reaches `loss` (at or above its last point's loss, below
    its first), linear between evaluations."""
    for (c0, l0), (c1, l1) in zip(curve, curve[1:], strict=False):
        if l1 <= loss:
            return c1 if l0 == l1 else c0 + (c1 - c0) * (l0 - loss) / (l0 - l1)
    raise AssertionError("unreachable: the curve's last point is at or below the loss")


def _at_control_lowest(arm: Run, curve: list[tuple[float, float]], log_arm: float) -> float | str:
    """k of an arm below the control's lowest loss L_c, measured at L_c (module docstring), or why not."""
    lowest, mine = curve[-1][1], _log_curve(arm) or []
    bound = math.exp(curve[-1][0] - log_arm)
    if len(curve) < 2 or not mine or mine[0][1] <= lowest:
        return (
            f"the arm's loss is below the control's lowest, and its own curve is there by its first "
            f"evaluation (k > {bound:.3g}; a longer control run or a ladder measures it)"
        )
    at_ctrl = curve[0][0] if curve[0][1] <= lowest else _first_reach(curve, lowest)
    return math.exp(at_ctrl - _first_reach(mine, lowest))


Est = tuple[float, float | None, float | None]  # value, 95% interval low, high (None: no interval)


def _geo(logs: list[float]) -> Est:
    """The geometric mean of exp(logs) and its 95% Student-t interval (in log space)."""
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), None, None
    half = t975(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


@dataclass
class Speedup:
    arm: Arm
    seeds: list[int] = field(default_factory=list)
    k_source: str = "matched-FLOP loss curves"
    k: Est | None = None
    rho: Est | None = None
    effective: Est | None = None
    per_seed: list[tuple[int, float | str, float | str]] = field(default_factory=list)  # seed, k, ρ
    notes: list[str] = field(default_factory=list)  # refusals and why a figure is missing


def _by_seed(arm: Arm, summaries: dict[str, Summary]) -> dict[int, Run]:
    return {
        r.seed: r
        for r in arm.runs
        if r.status == FINISHED and r.seed is not None and not summaries[r.name].diverged
    }


def speedups(
    arms: list[Arm],
    control: Arm,
    summaries: dict[str, Summary],
    ladder_k: dict[str, Est] | None = None,
) -> list[Speedup]:
    """Each arm's effective speed-up against the control, per common seed (module docstring). ladder_k:
    the Scaling section's multiplier of an arm (by label), used in place of the loss curves'."""
    base = _by_seed(control, summaries)
    out = []
    for arm in arms:
        if arm is control:
            continue
        sp, mine = Speedup(arm), _by_seed(arm, summaries)
        sp.seeds = sorted(set(mine) & set(base))
        k_logs, rho_logs, windows, lowest = [], [], [], []
        for seed in sp.seeds:
            a, c = mine[seed], base[seed]
            k = matched_flop_multiplier(a, summaries[a.name], c)
            curve, final = _log_curve(c), summaries[a.name].final_eval
            if isinstance(k, float) and curve and final is not None and final < curve[-1][1]:
                lowest.append(seed)  # measured at the control's lowest loss, not the arm's final
            why = speed_mismatch(a, c)
            logs = [] if why else window_log_ratios(a, c)
            rho: float | str = (
                f"refused: {why}"
                if why
                else math.exp(statistics.fmean(logs))
                if logs
                else "no common windows"
            )
            sp.per_seed.append((seed, k, rho))
            if isinstance(k, float):
                k_logs.append(math.log(k))
            if isinstance(rho, float):
                rho_logs.append(math.log(rho))
                windows.append(logs)
        notes = {f"seed {s}: k: {k}" for s, k, _ in sp.per_seed if isinstance(k, str)}
        notes |= {f"seed {s}: throughput ratio {r}" for s, _, r in sp.per_seed if isinstance(r, str)}
        notes |= {f"seed {s}: k at the control's lowest loss (the arm's final is below it)" for s in lowest}
        sp.notes = sorted(notes)
        if len(rho_logs) == len(sp.seeds) and sp.seeds:
            sp.rho = _geo(rho_logs) if len(rho_logs) > 1 else _geo(windows[0])
        if ladder_k and arm.label in ladder_k:
            sp.k_source, sp.k = "the ladder's fits", ladder_k[arm.label]
            if sp.rho is not None:
                sp.effective = _combine(sp.k, sp.rho)
        elif len(k_logs) == len(sp.seeds) and sp.seeds:
            sp.k = _geo(k_logs)
            if sp.rho is not None:
                both = [k + r for k, r in zip(k_logs, rho_logs, strict=True)]
                # one seed: k fixed, the interval the windows' (ρ's); several: over the seeds' products
                sp.effective = _geo(both) if len(both) > 1 else _scale(sp.rho, math.exp(k_logs[0]))
        out.append(sp)
    return out


def _scale(est: Est, factor: float) -> Est:
    return tuple(None if v is None else v * factor for v in est)  # type: ignore[return-value]


def _combine(k: Est, rho: Est) -> Est:
    """k × ρ with the two log-space half-widths in quadrature (independent estimates)."""
    value = k[0] * rho[0]
    if None in k or None in rho:
        return value, None, None
    lo = math.hypot(math.log(k[0] / k[1]), math.log(rho[0] / rho[1]))
    hi = math.hypot(math.log(k[2] / k[0]), math.log(rho[2] / rho[0]))
    return value, value * math.exp(-lo), value * math.exp(hi)


def ladder_multipliers(scaling, arms: list[Arm]) -> dict[str, Est]:
    """The Scaling section's k of each report arm whose runs hold a compared ladder arm's fit points, at
    the control's largest rung (the largest compute both measured)."""
    if scaling is None or scaling.control is None or not scaling.at:
        return {}
    from trmoe.report.scaling import multiplier_band

    rungs = [c for label, c in scaling.at if label.startswith("rung ")]
    if not rungs:
        return {}
    out = {}
    for fit in scaling.arms:
        if fit.comparison is None:
            continue
        names = {p.run for p in fit.points}
        arm = next((a for a in arms if names & {r.name for r in a.runs}), None)
        if arm is not None:
            band = multiplier_band(scaling, fit, [rungs[-1]])
            out[arm.label] = (float(band[0][0]), float(band[1][0]), float(band[2][0]))
    return out


# ------------------------------------------------------------------------------------------ time to target


def time_to_target(run: Run, target: float) -> float | None:
    """Training seconds at which the held-out loss first reaches `target` (module docstring); None: never."""
    points = [
        (row["elapsed_s"], row["eval_loss"])
        for row in run.rows
        if math.isfinite(row.get("eval_loss", math.nan)) and math.isfinite(row.get("elapsed_s", math.nan))
    ]
    for i, (t, loss) in enumerate(points):
        if loss <= target:
            if i == 0:
                return t
            t0, l0 = points[i - 1]
            return t0 + (t - t0) * (l0 - target) / (l0 - loss)
    return None


def default_target(control: Arm, summaries: dict[str, Summary]) -> float | None:
    """The control's mean final held-out loss over its finished, non-diverged seeds."""
    finals = [summaries[r.name].final_eval for r in _by_seed(control, summaries).values()]
    finals = [v for v in finals if v is not None and math.isfinite(v)]
    return statistics.fmean(finals) if finals else None


# ------------------------------------------------------------------------------------------------ markdown


def _p(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3g}"


def _est(e: Est | None, digits: int = 3) -> str:
    if e is None:
        return "n/a"
    value = f"{e[0]:.{digits}f}×"
    return value if e[1] is None else f"{value} [{e[1]:.{digits}f}, {e[2]:.{digits}f}]"


def verdict_rows(vs: list[Verdict]) -> list[list[str]]:
    return [
        [
            v.pair.arm.label,
            str(v.pair.n),
            "n/a" if v.pair.mean is None else f"{v.pair.mean:+.4f}",
            _p(v.p_equiv),
            _p(v.p_equiv_holm),
            _p(v.p_diff),
            _p(v.p_diff_holm),
            v.verdict,
        ]
        for v in vs
    ]


VERDICT_HEADER = ["arm", "seeds", "mean Δ", "p equiv (TOST)", "Holm", "p diff", "Holm", "verdict"]


def explain(margin: float, unit: str, higher: str) -> str:
    return (
        f"TOST (two one-sided Student-t tests) of the paired Δ against the margin δ = {margin:g} {unit}, and "
        f"a two-sided t-test of Δ = 0; each family's p-values Holm-corrected over the arms "
        f"(family-wise α = {ALPHA:g}). Verdict: *equivalent within δ* when the TOST rejects, else "
        f"*better* or *worse* ({higher} is better) when the difference test rejects, else *inconclusive*."
    )


def speedup_rows(sps: list[Speedup]) -> list[list[str]]:
    rows = []
    for sp in sps:
        rows.append(
            [
                sp.arm.label,
                str(len(sp.seeds)),
                f"{_est(sp.k)} ({sp.k_source})" if sp.k else "n/a",
                _est(sp.rho),
                _est(sp.effective),
                "; ".join(sp.notes) or "-",
            ]
        )
    return rows


def target_rows(arms: list[Arm], summaries: dict[str, Summary], target: float) -> list[list[str]]:
    rows = []
    for arm in arms:
        times = {s: time_to_target(r, target) for s, r in sorted(_by_seed(arm, summaries).items())}
        reached = [t for t in times.values() if t is not None]
        per_seed = ", ".join(f"{s}: {'not reached' if t is None else f'{t:.1f} s'}" for s, t in times.items())
        if not times:
            mean = "n/a"
        elif len(reached) == len(times):
            mean = f"{statistics.fmean(reached):.1f} s"
        else:
            mean = f"not reached ({len(times) - len(reached)} of {len(times)} seeds)"
        rows.append([arm.label, str(len(times)), mean, per_seed or "-"])
    return rows


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]


@dataclass
class Section:
    """The Verdicts of one report: what report.md shows and report_verdicts.csv lists."""

    options: Options
    loss: list[Verdict]
    accuracy: dict[str, list[Verdict]]  # column -> the arms' verdicts on it
    speedups: list[Speedup]
    target: float | None
    target_note: str


def analyse(rep, options: Options, accuracy_pairs: dict[str, list[Pair]]) -> Section | None:
    """The Verdicts of a report with a control (None without one): `rep` is trmoe.report.build.Report."""
    if rep.control is None or not rep.pairs:
        return None
    target, note = options.target_loss, "given (--target-loss)"
    if target is None:
        target, note = default_target(rep.control, rep.summaries), "the control's mean final held-out loss"
    return Section(
        options=options,
        loss=verdicts(rep.pairs, options.margin),
        accuracy={
            c: verdicts(ps, options.accuracy_margin, higher_is_better=True)
            for c, ps in accuracy_pairs.items()
        },
        speedups=speedups(rep.arms, rep.control, rep.summaries, ladder_multipliers(rep.scaling, rep.arms)),
        target=target,
        target_note=note,
    )


def markdown(section: Section, rep) -> list[str]:
    o = section.options
    lines = [
        "",
        "## Verdicts",
        "",
        "### Equivalence (held-out loss)",
        "",
        explain(o.margin, "nats/token", "lower"),
    ]
    lines += ["", *_table(VERDICT_HEADER, verdict_rows(section.loss))]
    for column, vs in section.accuracy.items():
        lines += ["", f"### Equivalence (`{column}`)", "", explain(o.accuracy_margin, "(accuracy)", "higher")]
        lines += ["", *_table(VERDICT_HEADER, verdict_rows(vs))]
    lines += [
        "",
        "### Effective speed-up",
        "",
        "Effective speed-up = compute multiplier k × throughput ratio ρ (Marin's protocol). k: the control "
        "needs k× the arm's compute for the arm's final held-out loss — from the Scaling section's fits at "
        "the "
        "control's largest rung when the runs are a ladder's, else per seed from matched-FLOP held-out loss "
        "curves. ρ: tok/s of the arm ÷ the control's over the logging windows both logged (warm-up and "
        "evaluation rows left out; evaluation and checkpoint time are not training time), refused when the "
        "runs differ in device, world size, threads, precision, or compile and telemetry settings. "
        "Geometric means with 95% Student-t intervals over seeds (one seed: over the windows, k fixed; a "
        "ladder's k: its bootstrap interval and ρ's combined in log space).",
        "",
        *_table(
            ["arm", "seeds", "compute multiplier k", "throughput ratio ρ", "effective speed-up", "notes"],
            speedup_rows(section.speedups),
        ),
        "",
        "### Time to the target held-out loss",
        "",
    ]
    if section.target is None:
        lines.append("No target: the control has no finished final held-out loss (give --target-loss).")
    else:
        lines.append(
            f"Target {section.target:.4f} nats/token ({section.target_note}): the training wall-clock "
            "(elapsed_s, evaluation excluded) at which the held-out loss first reaches it, linear between "
            "the evaluations around it; *not reached* when it never does."
        )
        lines += [
            "",
            *_table(
                ["arm", "seeds", "mean time", "per seed"],
                target_rows(rep.arms, rep.summaries, section.target),
            ),
        ]
    return lines


def csv_rows(section: Section) -> list[dict]:
    """report_verdicts.csv: one row per arm and measure."""
    rows = []
    for measure, vs in [("eval_loss", section.loss), *section.accuracy.items()]:
        for v in vs:
            rows.append({
                "measure": measure, "arm": v.pair.arm.label, "n_seeds": v.pair.n, "mean_delta": v.pair.mean,
                "margin": v.margin, "p_equiv": v.p_equiv, "p_equiv_holm": v.p_equiv_holm, "p_diff": v.p_diff,
                "p_diff_holm": v.p_diff_holm, "verdict": v.verdict, "value": None, "low": None, "high": None,
            })  # fmt: skip
    for sp in section.speedups:
        for measure, est in (("compute_multiplier", sp.k), ("throughput_ratio", sp.rho),
                             ("effective_speedup", sp.effective)):  # fmt: skip
            value, low, high = est or (None, None, None)
            rows.append({
                "measure": measure, "arm": sp.arm.label, "n_seeds": len(sp.seeds), "mean_delta": None,
                "margin": None, "p_equiv": None, "p_equiv_holm": None, "p_diff": None, "p_diff_holm": None,
                "verdict": "; ".join(sp.notes), "value": value, "low": low, "high": high,
            })  # fmt: skip
    return rows
