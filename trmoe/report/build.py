"""Build a report from run directories: report.md, report.csv, report_pairs.csv and plots/ in one folder.

Over 400 lines on purpose: it assembles report.md's sections in the order a reader
meets them; each section is a small function here, the statistics live in compare.py and summary.py.
"""

from __future__ import annotations

import csv
import io
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from trmoe.durable import write_file
from trmoe.errors import UserError, require_directory
from trmoe.report import plots, scaling_plots
from trmoe.report.checks import CheckItem, check
from trmoe.report.compare import Arm, Pair, arm_keys, group_arms, paired, pick_control, swept_keys
from trmoe.report.ladder import Options, is_ladder
from trmoe.report.runs import Run, common_root, load_runs
from trmoe.report.study import Study, load_study
from trmoe.report.summary import THROUGHPUT_WARMUP_STEPS, Summary, summarize
from trmoe.report.verdicts import Options as VerdictOptions
from trmoe.report.verdicts import Section as Verdicts
from trmoe.report.verdicts import analyse as analyse_verdicts
from trmoe.report.verdicts import csv_rows as verdict_csv_rows
from trmoe.report.verdicts import markdown as verdicts_markdown
from trmoe.report.verdicts import parse_positive

if TYPE_CHECKING:  # the Scaling section (scipy, the `report` extra) is imported where a ladder is read
    from trmoe.report.scaling import Scaling

REPORT_MD, REPORT_CSV, PAIRS_CSV, PLOTS_DIR = "report.md", "report.csv", "report_pairs.csv", "plots"
VERDICTS_CSV = "report_verdicts.csv"  # TOST verdicts and effective speed-ups (trmoe.report.verdicts.csv_rows)
SCALING_CSV = "report_scaling.csv"  # a ladder's fits: one row per number (trmoe.report.scaling.rows)
# report.csv: run, path, arm, swept.<key> for every swept key other than the seed, then these.
RUN_COLUMNS = (
    "seed", "status", "error", "params_total", "params_active", "match_field", "match_width",
    "match_residual", "tokens", "final_eval_loss", "best_eval_loss", "eval_bpb", "eval_bpb_estimated",
    "train_loss", "median_tok_s", "mfu",
)  # fmt: skip


@dataclass
class Report:
    folder: Path
    runs: list[Run]
    summaries: dict[str, Summary]
    arms: list[Arm]
    control: Arm | None
    control_note: str
    pairs: list[Pair]
    warnings: list[str]
    checklist: list[CheckItem]
    plots: list[Path] = field(default_factory=list)
    plots_note: str = ""
    markdown: str = ""
    study: Study | None = None  # an Optuna search: its jobs are ranked as trials, not compared as arms
    scaling: Scaling | None = None  # runs of a model ladder: the Scaling section
    written_by: str = "`python -m trmoe.report`"  # or the sweep's callback (SWEEP_WRITER)
    verdicts: Verdicts | None = None  # TOST verdicts, effective speed-up, time to target (with a control)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _num(value: float | None, digits: int = 4) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _int(value: int | None) -> str:
    return "n/a" if value is None else f"{value:,}"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _match_cell(run: Run) -> str:
    m = run.record.get("param_match")
    if not m:
        return "-"
    residual = "exact" if m.get("residual") == 0 else f"residual {m.get('residual'):+,}"
    return f"{m.get('field')}={m.get('width')} ({residual})"


def _status_cell(run: Run, summary: Summary) -> str:
    notes = list(run.unreadable)  # e.g. "run_config.json unreadable: not valid JSON"
    notes += [f"diverged: {summary.diverged}"] * bool(summary.diverged)
    notes += [f"records disagree: {d}" for d in summary.disagreements]
    if run.status == "failed":
        return "; ".join([f"failed: {run.error or 'no error line'}", *notes])
    if run.error:  # e.g. preempted: why it stopped
        return "; ".join([f"{run.status}: {run.error}", *notes])
    notes = ["inferred"] * run.status_inferred + notes
    return run.status + (f" ({'; '.join(notes)})" if notes else "")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return out


def _study_lines(rep: Report) -> list[str]:
    """The trials of an Optuna search, best first, its searched keys as columns."""
    study = rep.study
    finals = {name: s.final_eval for name, s in rep.summaries.items()}
    header = ["rank", "trial", "status", "final eval", *[f"`{k}`" for k in study.params]]
    header += ["best eval", "train loss", "tok/s"]
    rows = []
    for rank, run in enumerate(study.ranked(rep.runs, finals), 1):
        s = rep.summaries[run.name]
        rows.append(
            [str(rank), run.name, _status_cell(run, s), _num(s.final_eval)]
            + [run.value_of(k) for k in study.params]
            + [_num(s.best_eval), _num(s.train_loss)]
            + ["n/a" if s.median_tok_s is None else f"{s.median_tok_s:,.0f}"]
        )
    return ["## Trials", "", *_table(header, rows)]


def render_markdown(rep: Report, title: str) -> str:
    runs, arms = rep.runs, rep.arms
    finished = sum(r.status == "finished" for r in runs)
    keys = swept_keys(runs)
    if rep.study is not None:
        best = rep.study.ranked(runs, {n: s.final_eval for n, s in rep.summaries.items()})[0]
        summary = (
            f"{_count(len(runs), 'trial')} ({finished} finished) of the Optuna study `{rep.study.name}` "
            f"({rep.study.direction} the final held-out loss); searched: "
            + ", ".join(f"`{k}`" for k in rep.study.params)
            + f". Best: trial `{best.name}`, final eval {_num(rep.summaries[best.name].final_eval)}."
        )
    else:
        summary = (
            f"{_count(len(runs), 'run')} ({finished} finished) in {_count(len(arms), 'arm')}; swept keys: "
            + (", ".join(f"`{k}`" for k in keys) or "none (separate runs)")
            + f". Control arm: {('`' + rep.control.label + '`') if rep.control else 'none'}; "
            f"{rep.control_note}."
        )
    lines = [
        f"# Report: {title}",
        "",
        summary,
        f"Written by {rep.written_by} on {time.strftime('%Y-%m-%d %H:%M')}.",
        "",
        "## Warnings",
        "",
    ]
    if rep.warnings:
        lines += [f"- **{w}**" for w in rep.warnings]
    else:
        lines.append(
            "None: beyond the swept keys, the runs match on every item of the comparability checklist below."
        )
    estimated = any(s.bpb_estimated for s in rep.summaries.values())
    if rep.study is not None:
        lines += ["", *_study_lines(rep)]
    lines += ["", "## Runs", ""]
    bpb = "eval bpb" + (" *" if estimated else "")
    header = ["run", "arm", "seed", "status", "params", "active", "matched width", "tokens", "final eval"]
    header += ["best eval", bpb, "train loss", "tok/s", "MFU"]
    rows = []
    for arm in arms:
        for run in arm.runs:
            s = rep.summaries[run.name]
            rows.append(
                [
                    run.name,
                    arm.label,
                    str(run.seed) if run.seed is not None else "n/a",
                    _status_cell(run, s),
                    _int(s.params_total),
                    _int(s.params_active),
                    _match_cell(run),
                    _int(s.tokens),
                    _num(s.final_eval),
                    _num(s.best_eval),
                    _num(s.eval_bpb),
                    _num(s.train_loss),
                    "n/a" if s.median_tok_s is None else f"{s.median_tok_s:,.0f}",
                    "n/a" if s.mfu is None else f"{100 * s.mfu:.1f}%",
                ]
            )
    lines += _table(header, rows)
    lines += [
        "",
        "Losses are cross-entropy in nats per token on the fixed held-out batches (final = the evaluation at "
        "the run's final step, never an earlier one). tok/s is the median of the logged windows after step "
        f"{THROUGHPUT_WARMUP_STEPS}, "
        "evaluation rows left out. MFU needs a known peak: a bf16 GPU datasheet or `--peak-tflops`; "
        "n/a otherwise.",
        _peak_line(arms),
    ]
    if estimated:
        lines.append(
            "\\* bits per byte estimated as final eval loss / ln 2 x tokens per byte of the held-out split "
            "(the run did not record `eval_bpb`)."
        )

    lines += ["", "## Paired comparison with the control", ""]
    if rep.study is not None:
        lines.append("An Optuna search: its trials are ranked above, not paired with a control.")
    elif rep.control is None:
        lines.append(f"No control arm: {rep.control_note}.")
    elif not rep.pairs:
        lines.append("Only one arm: nothing to compare.")
    else:
        lines.append(
            f"Δ = final held-out loss of the arm minus that of `{rep.control.label}` on the same seed; the "
            "mean over seeds and its 95% Student-t interval. An interval that contains 0 cannot be told from "
            "seed noise."
        )
        lines.append("")
        prow = []
        for p in rep.pairs:
            ci = p.interval
            prow.append(
                [
                    p.arm.label,
                    str(p.n),
                    _num(p.control_mean),
                    _num(p.arm_mean),
                    "n/a" if p.mean is None else f"{p.mean:+.4f}",
                    "n/a" if ci is None else f"[{ci[0]:+.4f}, {ci[1]:+.4f}]",
                    ", ".join(f"{s}: {d:+.4f}" for s, d in zip(p.seeds, p.deltas, strict=True)) or "-",
                    p.verdict,
                ]
            )
        lines += _table(
            ["arm", "seeds", "control loss", "arm loss", "mean Δ", "95% interval", "Δ per seed", "reading"],
            prow,
        )
        left_out = list(dict.fromkeys(e for p in rep.pairs for e in p.excluded))
        if left_out:
            lines += [
                "",
                f"Left out of the paired comparison ({len(left_out)}): " + "; ".join(left_out) + ".",
            ]

    lines += _per_source_section(rep)
    lines += _accuracy_section(rep)
    if rep.verdicts:
        lines += verdicts_markdown(rep.verdicts, rep)
    if rep.scaling:
        from trmoe.report.scaling import markdown

        lines += markdown(rep.scaling)

    lines += ["", "## Comparability checklist", ""]
    lines.append(
        "Checked against the reproducible-comparison checklist. *differs by the swept keys*: the sweep made "
        "the difference (every other override is shared). **DIFFERS**: a warning above. **UNKNOWN**: a run "
        "has no record of it (a warning above); an unknown never counts as the same."
    )
    lines.append("")
    lines += _table(
        ["item", "status", "details"],
        [
            [c.title, f"**{c.status}**" if c.status in ("DIFFERS", "UNKNOWN") else c.status, c.detail]
            for c in rep.checklist
        ],
    )

    failed = [r for r in runs if r.status == "failed"]
    if failed:
        lines += ["", "## Failed runs", ""]
        lines += _table(
            ["run", "overrides", "error"], [[r.name, " ".join(r.overrides), r.error or "-"] for r in failed]
        )

    lines += ["", "## Plots", ""]
    if rep.plots:
        # The grid-level plots inline; one loss plot (and expert-share map) per run as links.
        per_run = [p for p in rep.plots if p.stem.startswith(("run_", "shares_"))]
        for path in rep.plots:
            if path not in per_run:
                lines += [f"![{path.stem}]({path.relative_to(rep.folder).as_posix()})", ""]
        if per_run:
            links = ", ".join(f"[{p.stem}]({p.relative_to(rep.folder).as_posix()})" for p in per_run)
            lines.append(f"Per run: {links}.")
    else:
        lines.append(rep.plots_note or "No plots.")
    return "\n".join(lines) + "\n"


def _seen(rep: Report, field_name: str) -> list[str]:
    """The keys of one Summary mapping (`field_name`) that any run recorded, in first-seen order."""
    names: dict[str, None] = {}
    for run in rep.runs:
        names.update(dict.fromkeys(getattr(rep.summaries[run.name], field_name)))
    return list(names)


def source_names(rep: Report) -> list[str]:
    """The mixture sources any run evaluated separately, in first-seen order."""
    return _seen(rep, "sources")


def _per_source_section(rep: Report) -> list[str]:
    """data=mixture: each arm's final held-out loss and bpb per source, and the paired Δ against the control
    per source (the same seeds and Student-t interval as the overall comparison)."""
    names = source_names(rep)
    if not names:
        return []
    lines = [
        "",
        "## Per-source held-out loss",
        "",
        "Runs on a mixture (`data=mixture`) score each source's held-out split separately "
        "(`eval_loss/<source>`, `eval_bpb/<source>` in metrics.csv). Loss and bpb: the mean over the arm's "
        "finished seeds of the final evaluation; Δ: the arm minus the control on the same seed, with its 95% "
        "Student-t interval.",
        "",
    ]
    rows = []
    for name in names:

        def loss(s: Summary, name: str = name) -> float | None:
            return s.sources.get(name, (None, None))[0]

        pairs = _pairs_by_arm(rep, loss)
        for arm in rep.arms:
            done = [rep.summaries[r.name] for r in arm.runs if r.status == "finished"]
            losses = [v for v in (loss(s) for s in done) if v is not None]
            bpbs = [v for v in (s.sources.get(name, (None, None))[1] for s in done) if v is not None]
            p = pairs.get(arm.label)
            rows.append(
                [
                    name,
                    arm.label,
                    str(len(losses)),
                    _num(sum(losses) / len(losses) if losses else None),
                    _num(sum(bpbs) / len(bpbs) if bpbs else None),
                    *_pair_cells(arm is rep.control, p),
                ]
            )
    return lines + _table(
        ["source", "arm", "seeds", "final loss", "bpb", "mean Δ", "95% interval", "reading"], rows
    )


def _pairs_by_arm(rep: Report, value: Callable[[Summary], float | None]) -> dict[str, Pair]:
    """Each arm's paired comparison with the control on `value(summary)` (none without a control)."""
    return (
        {p.arm.label: p for p in paired(rep.arms, rep.control, rep.summaries, value)} if rep.control else {}
    )


def _pair_cells(is_control: bool, p: Pair | None) -> list[str]:
    """The mean difference, its interval and its reading: the last three cells of a per-arm paired table."""
    mean = "control" if is_control else ("n/a" if p is None or p.mean is None else f"{p.mean:+.4f}")
    ci = p.interval if p else None
    return [mean, "n/a" if ci is None else f"[{ci[0]:+.4f}, {ci[1]:+.4f}]", "-" if p is None else p.verdict]


def accuracy_columns(rep: Report) -> list[str]:
    """The downstream accuracy columns (acc/<task>, acc_norm/<task>) any run recorded, first-seen order."""
    return _seen(rep, "accuracies")


def _accuracy_section(rep: Report) -> list[str]:
    """downstream.tasks: each arm's final accuracy per task and metric, and the paired Δ against the control
    (the same seeds and Student-t interval as the loss)."""
    columns = accuracy_columns(rep)
    if not columns:
        return []
    lines = [
        "",
        "## Downstream accuracy",
        "",
        "Runs with `downstream.tasks` score lm-evaluation-harness tasks on a fixed subset during training "
        "(`acc/<task>`, `acc_norm/<task>` in metrics.csv). **Higher is better** (unlike the losses above). "
        "Accuracy: the mean over the arm's finished seeds of the evaluation at the final step; Δ: the arm "
        "minus the control on the same seed, with its 95% Student-t interval (a positive Δ: more accurate "
        "than the control).",
        "",
    ]
    rows = []
    for column in columns:
        metric, task = column.split("/", 1)

        def value(s: Summary, column: str = column) -> float | None:
            return s.accuracies.get(column)

        pairs = _pairs_by_arm(rep, value)
        for arm in rep.arms:
            done = [rep.summaries[r.name] for r in arm.runs if r.status == "finished"]
            values = [v for v in (value(s) for s in done) if v is not None]
            p = pairs.get(arm.label)
            rows.append(
                [
                    task,
                    metric,
                    arm.label,
                    str(len(values)),
                    _num(sum(values) / len(values) if values else None),
                    *_pair_cells(arm is rep.control, p),
                ]
            )
    return lines + _table(
        ["task", "metric", "arm", "seeds", "final accuracy", "mean Δ", "95% interval", "reading"], rows
    )


def _runs_csv(rep: Report) -> str:
    keys = arm_keys(rep.runs)
    buf = io.StringIO()
    writer = csv.writer(buf)
    names = source_names(rep)
    per_source = [f"{kind}/{n}" for n in names for kind in ("final_eval_loss", "eval_bpb")]
    accuracies = accuracy_columns(rep)  # final acc/<task>, acc_norm/<task>
    header = ["run", "path", "arm", *[f"swept.{k}" for k in keys], *RUN_COLUMNS, *per_source, *accuracies]
    if rep.scaling:
        from trmoe.report.scaling import POINT_COLUMNS, point_cells

        header += POINT_COLUMNS
    writer.writerow(header)
    for arm in rep.arms:
        for run in arm.runs:
            s, m = rep.summaries[run.name], run.record.get("param_match") or {}
            writer.writerow(
                [run.name, str(run.path), arm.label, *[run.value_of(k) for k in keys], run.seed, run.status]
                + [run.error or "", s.params_total, s.params_active, m.get("field"), m.get("width")]
                + [m.get("residual"), s.tokens, s.final_eval, s.best_eval, s.eval_bpb, s.bpb_estimated]
                + [s.train_loss, s.median_tok_s, s.mfu]
                + [v for n in names for v in s.sources.get(n, (None, None))]
                + [s.accuracies.get(c) for c in accuracies]
                + (point_cells(rep.scaling, run.name) if rep.scaling else [])
            )
    return buf.getvalue()


def _dict_csv(table: list[dict], empty_header: str) -> str:
    """CSV text of rows that are dicts with the same keys (a header of `empty_header` when there are none)."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(table[0]) if table else [empty_header])
    writer.writeheader()
    writer.writerows(table)
    return buf.getvalue()


def _scaling_csv(scaling: Scaling) -> str:
    from trmoe.report.scaling import rows

    return _dict_csv(rows(scaling), "section")


def _pairs_csv(rep: Report) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(
        ["arm", "control", "n_seeds", "seeds", "control_mean", "arm_mean", "mean_delta", "ci95_low"]
        + ["ci95_high", "verdict"]
    )
    for p in rep.pairs:
        ci = p.interval or (None, None)
        control = rep.control.label if rep.control else ""
        seeds = " ".join(map(str, p.seeds))
        writer.writerow(
            [p.arm.label, control, p.n, seeds, p.control_mean, p.arm_mean, p.mean, *ci, p.verdict]
        )
    return buf.getvalue()


def _verdicts_csv(section: Verdicts) -> str:
    return _dict_csv(verdict_csv_rows(section), "measure")


def default_folder(paths: list[Path]) -> Path:
    """Next to the runs: the one directory given, or the deepest directory that holds them all."""
    if len(paths) == 1:
        return paths[0]
    return common_root(paths)


def check_folder(folder: Path) -> None:
    """The report folder (--out) must be a directory, or not exist yet below one: never a file."""
    require_directory(
        folder,
        "report: --out",
        "a directory (new or existing) for report.md, report.csv, report_pairs.csv and plots/",
    )


def _peak_line(arms) -> str:
    """Where the MFU column's peaks came from (run_config.json's mfu_peak of each run)."""
    peaks = {}
    for arm in arms:
        for run in arm.runs:
            peak = run.record.get("mfu_peak")
            if isinstance(peak, dict) and isinstance(peak.get("flops"), int | float):
                peaks.setdefault(f"{peak['flops'] / 1e12:.4g} TFLOP/s ({peak.get('source')})", []).append(
                    run.name
                )
    if not peaks:
        return "The runs recorded no peak (run_config.json `mfu_peak`): their MFU is the datasheet's or n/a."
    said = "; ".join(f"{figure}: {', '.join(names)}" for figure, names in peaks.items())
    return f"MFU peaks (run_config.json `mfu_peak`, unless --peak-tflops): {said}."


def parse_peak(text: str | float | None) -> float | None:
    """--peak-tflops: a positive finite number (TFLOP/s of one device), or None when not given."""
    allowed = "a positive number, the peak TFLOP/s of one device (bf16 dense: H100/H200 989, A100 312)"
    return parse_positive("--peak-tflops", text, allowed)


# who wrote a report that the sweep's end wrote (a rerun of `python -m trmoe.report` says itself)
SWEEP_WRITER = "the sweep's end (hydra.callbacks.report; rerun: `python -m trmoe.report <sweep dir>`)"


def build_report(
    paths: list[Path],
    folder: Path | None = None,
    control: str | None = None,
    peak_tflops: float | None = None,
    make_plots: bool = True,
    *,
    require_control: bool = False,
    scaling: Options | None = None,
    written_by: str | None = None,
    verdicts: VerdictOptions | None = None,
) -> Report:
    """Read the runs under `paths` and write the report files into `folder` (default: next to them).
    Bad input raises UserError before anything is written. A control that matches no arm is a warning in
    the report (the grid's recorded control), or with require_control a UserError (--control as typed)."""
    missing = [str(p) for p in paths if not p.is_dir()]
    if missing:
        raise UserError(f"report: not a directory: {', '.join(missing)}")
    parse_peak(peak_tflops)
    if folder is not None:
        check_folder(folder)
    folder = folder or default_folder(paths)
    runs = load_runs(paths)
    if not runs:
        raise UserError(
            f"report: no runs under {', '.join(map(str, paths))} (a run directory holds run_config.json or "
            "status.json)"
        )
    peak = peak_tflops * 1e12 if peak_tflops else None
    summaries = {r.name: summarize(r, peak) for r in runs}
    arms = group_arms(runs)
    spec = control or next((r.control for r in runs if r.control), None)
    control_arm, control_note = pick_control(arms, spec)
    if require_control and control and control_arm is None:
        labels = [f"`{a.label}`" for a in arms]
        listed = ", ".join(labels[:8]) + (f" and {len(labels) - 8} more" if len(labels) > 8 else "")
        raise UserError(
            f"report: --control {control}: matches no arm; allowed: an arm ({listed}), the name of one of "
            'its runs, or its swept overrides ("key=value ...")'
        )
    study = load_study(list(dict.fromkeys(r.sweep.path for r in runs)))
    if study is not None:  # trials are ranked, not compared with a control
        control_arm, control_note = None, "an Optuna search"
    pairs = paired(arms, control_arm, summaries) if control_arm is not None else []
    warnings, checklist = check(runs, arms, summaries)
    if spec and control_arm is None and study is None:
        warnings.insert(0, control_note)
    rep = Report(folder, runs, summaries, arms, control_arm, control_note, pairs, warnings, checklist)
    if written_by is not None:
        rep.written_by = written_by
    rep.study = study
    if study is None and any(is_ladder(r) for r in runs):
        rep.scaling = _scaling(runs, summaries, spec, scaling or Options())
    accuracy_pairs = {
        c: paired(arms, control_arm, summaries, lambda s, c=c: s.accuracies.get(c))
        if control_arm is not None
        else []
        for c in accuracy_columns(rep)
    }
    if study is None:
        rep.verdicts = analyse_verdicts(rep, verdicts or VerdictOptions(), accuracy_pairs)

    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # checked above; here: no permission, or a file put there since
        raise UserError(f"report: --out {folder}: cannot create the directory ({e.strerror or e})") from None
    _check_writable(folder)
    if not make_plots:
        rep.plots_note = "Plots were not requested (--no-plots)."
    elif not plots.available():
        rep.plots_note = "No plots: matplotlib is not installed (`pip install 'trmoe[report]'`)."
    title = str(paths[0]) if len(paths) == 1 else f"{len(paths)} paths under {folder}"
    try:
        if make_plots and plots.available():
            rep.plots = plots.write_plots(runs, arms, pairs, control_arm, folder / PLOTS_DIR, accuracy_pairs)
            rep.plots += scaling_plots.plot_scaling(rep.scaling, folder / PLOTS_DIR) if rep.scaling else []
        rep.markdown = render_markdown(rep, title)
        for name, text in (
            (REPORT_CSV, _runs_csv(rep)),
            (PAIRS_CSV, _pairs_csv(rep)),
            *([(SCALING_CSV, _scaling_csv(rep.scaling))] if rep.scaling else []),
            *([(VERDICTS_CSV, _verdicts_csv(rep.verdicts))] if rep.verdicts else []),
            (REPORT_MD, rep.markdown),
        ):
            write_file(folder / name, text)
    except OSError as e:  # a disk that filled meanwhile: each file is whole or as it was
        raise UserError(f"report: cannot write the report into {folder} ({e.strerror or e})") from None
    return rep


def _scaling(
    runs: list[Run], summaries: dict[str, Summary], control: str | None, options: Options
) -> Scaling:
    """The Scaling section of a ladder's runs; it needs scipy (the `report` extra), as the intervals do."""
    try:
        from trmoe.report.scaling import analyse
    except ImportError:
        raise UserError(
            "report: needs scipy for the Scaling section of a ladder; install: pip install 'trmoe[report]'"
        ) from None
    return analyse(runs, summaries, control, options)


def _check_writable(folder: Path) -> None:
    """Before any write: a read-only sweep directory (or a full disk) is one line naming --out, not a
    traceback after half the plots."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".report-", suffix=".tmp") as probe:
            probe.write(b"x")
            probe.flush()
    except OSError as e:
        raise UserError(
            f"report: cannot write into {folder} ({e.strerror or e}); use --out DIR to write it elsewhere"
        ) from None
