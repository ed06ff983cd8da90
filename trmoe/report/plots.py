"""PNG plots of a report (matplotlib, the optional `report` extra): loss vs tokens per run and overlaid,
held-out loss vs tokens beside vs wall-clock, throughput, paired differences, expert shares per layer when a
run recorded telemetry, and one figure of each other column the runs' producers declare with `plot=True`
(`plot_column`; units from the declarations too, trmoe.report.runs: a new per-step metric is plotted with no
change here).

An arm of one seed is one line; an arm of several is its mean over the seeds with a band (their min..max) and
each seed a faint line of its own dash pattern (the legend names the patterns). A panel nothing was drawn in
says "no data" rather than showing a bare axis, and a figure with no data anywhere is not written. Each PNG
records its titles in its `Title` text chunk (what the tests and a reader's tools can read back)."""

from __future__ import annotations

import csv
import math
import re
from pathlib import Path

from trmoe.report.compare import Arm, Pair
from trmoe.report.runs import Run, undeclared
from trmoe.report.summary import is_accuracy, throughput_rows
from trmoe.run.columns import MetricColumn
from trmoe.run.rundir import RunDir

DRAWN = ("train_loss", "eval_loss", "tok_s")  # the plotted columns with their own figure (and is_accuracy)


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def _drawn(ax) -> bool:
    return bool(ax.lines or ax.images or ax.collections or ax.patches)


def titles(fig) -> str:
    """The figure's titles (its own, then each panel's), as its PNG records them."""
    suptitle = fig._suptitle.get_text() if fig._suptitle else ""
    return " | ".join(t for t in [suptitle, *(ax.get_title() for ax in fig.axes)] if t)


def save(fig, path: Path, *, dpi: int = 100, tight: bool = True) -> Path:
    """Write a figure as PNG (tight layout unless the caller placed its parts) and free it. A panel with
    nothing drawn says so in its middle: a bare 0..1 axis reads as a plotting bug, not as "no data"."""
    for ax in fig.axes:
        if not _drawn(ax) and ax.get_label() != "<colorbar>":
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
    if tight:
        fig.tight_layout()
    fig.savefig(path, dpi=dpi, metadata={"Title": titles(fig)})
    pyplot().close(fig)
    return path


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "run"


def colors_of(arms: list[Arm]) -> dict[str, tuple]:
    plt = pyplot()
    cmap = plt.get_cmap("tab10" if len(arms) <= 10 else "tab20")
    return {arm.label: cmap(i % cmap.N) for i, arm in enumerate(arms)}


def _xy(run: Run, column: str) -> tuple[list[float], list[float]]:
    rows = [(t, v) for _, t, v in run.series(column) if math.isfinite(t)]
    return [t for t, _ in rows], [v for _, v in rows]


def declaration(runs: list[Run], column: str) -> MetricColumn:
    """The column as the first run that wrote it declared it (runs of other versions may differ)."""
    run = next((r for r in runs if r.has_column(column)), None)
    return run.declaration(column) if run else undeclared(column)


def _runs(arms: list[Arm]) -> list[Run]:
    return [run for arm in arms for run in arm.runs]


def plotted(runs: list[Run]) -> list[MetricColumn]:
    """The columns declared `plot=True` that no figure of their own draws and some run logged, in first-seen
    order."""
    names = dict.fromkeys(c for r in runs for c in r.columns if r.declaration(c).plot and r.series(c))
    return [declaration(runs, c) for c in names if c not in DRAWN and not is_accuracy(c)]


SEED_DASHES = ("--", ":", "-.", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 3)))  # one per seed of an arm, cycled


def _draw_arm(ax, arm: Arm, color, series: list[tuple[list[float], list[float]]], style: str) -> None:
    """One arm's runs: a run alone as one line; several as their mean (label: the arm) with a min..max
    band and each seed faint in its dash pattern. Seeds' points are paired by position (the same logged
    steps); x is their mean, exact for tokens, the seeds' average for wall-clock."""
    series = [(x, y) for x, y in series if x]
    if len(series) == 1:
        ax.plot(*series[0], style, color=color, label=arm.label, markersize=3, linewidth=1)
        return
    if not series:
        return
    import numpy as np

    marker = style.rstrip("-")
    for i, (x, y) in enumerate(series):
        ax.plot(x, y, color=color, alpha=0.4, linewidth=1, linestyle=SEED_DASHES[i % len(SEED_DASHES)])
    n = min(len(x) for x, _ in series)
    xs = np.array([x[:n] for x, _ in series]).mean(axis=0)
    ys = np.array([y[:n] for _, y in series])
    ax.fill_between(xs, ys.min(axis=0), ys.max(axis=0), color=color, alpha=0.15, linewidth=0)
    ax.plot(
        xs,
        ys.mean(axis=0),
        marker + "-",
        color=color,
        label=f"{arm.label} (mean of {len(series)})",
        markersize=3,
        linewidth=1.5,
    )


def _seed_legend(ax, arms: list[Arm]) -> None:
    """Gray legend entries naming each seed's dash pattern, when some arm has several seeds."""
    lists = {tuple(r.seed for r in _by_seed(arm)) for arm in arms if len(arm.runs) > 1}
    if not lists:
        return
    same = len(lists) == 1  # every arm has these seeds: name them; else their rank within the arm
    for i, seed in enumerate(max(lists, key=len)):
        label = f"seed {seed}" if same else f"seed #{i + 1} of an arm"
        ax.plot([], [], color="gray", alpha=0.6, linestyle=SEED_DASHES[i % len(SEED_DASHES)], label=label)


def _by_seed(arm: Arm) -> list[Run]:
    """The arm's runs in seed order (a run without a seed last): seed i draws in SEED_DASHES[i]."""
    return sorted(arm.runs, key=lambda r: (r.seed is None, r.seed or 0))


def _per_arm(ax, arms: list[Arm], column: str, style: str) -> None:
    """Every arm's column against tokens, one colour per arm (seeds: mean, band, faint lines)."""
    colors = colors_of(arms)
    for arm in arms:
        _draw_arm(ax, arm, colors[arm.label], [_xy(run, column) for run in _by_seed(arm)], style)
    if _drawn(ax):
        _seed_legend(ax, arms)


def run_title(run: Run, arm: Arm | None) -> str:
    """A run plot's title: its arm and seed (the job number alone names no configuration), then its path."""
    seed = f"seed {run.seed}" if run.seed is not None else "seed unknown"
    return f"{arm.label if arm else run.name}, {seed}\n(run {run.name})"


def plot_run(run: Run, path: Path, arm: Arm | None = None) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for column, style in (("train_loss", ".-"), ("eval_loss", "o-")):
        x, y = _xy(run, column)
        if x:
            ax.plot(x, y, style, label=column.replace("_", " "), markersize=3)
    ax.set_xlabel("tokens")
    ax.set_ylabel(f"cross-entropy ({run.declaration('eval_loss').unit})")
    ax.set_title(run_title(run, arm), fontsize=9)
    ax.grid(alpha=0.3)
    if _drawn(ax):
        ax.legend()
    save(fig, path)


def plot_overlay(arms: list[Arm], path: Path) -> None:
    """Train and held-out loss of every run, one colour per arm (seeds of an arm share it)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, column, title in ((axes[0], "train_loss", "train loss"), (axes[1], "eval_loss", "held-out loss")):
        _per_arm(ax, arms, column, ".-" if column == "train_loss" else "o-")  # markers: few points
        ax.set_title(title)
        ax.set_xlabel("tokens")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"cross-entropy ({declaration(_runs(arms), 'eval_loss').unit})")
    handles, labels = axes[1].get_legend_handles_labels()
    if not handles:
        handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(3, len(labels)), fontsize=7)
        fig.subplots_adjust(bottom=0.12 + 0.05 * math.ceil(len(labels) / 3), top=0.92, wspace=0.05)
    save(fig, path, tight=False)


def plot_wallclock(arms: list[Arm], path: Path) -> None:
    """Held-out loss against tokens and, beside it, against training wall-clock (elapsed_s: evaluation
    excluded): an arm that wins per token can lose per second."""
    plt, colors = pyplot(), colors_of(arms)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    _per_arm(axes[0], arms, "eval_loss", "o-")
    for arm in arms:
        series = []
        for run in _by_seed(arm):
            xy = [(r.get("elapsed_s", math.nan), r.get("eval_loss", math.nan)) for r in run.rows]
            xy = [p for p in xy if math.isfinite(p[0] + p[1])]
            series.append(([x for x, _ in xy], [y for _, y in xy]))
        _draw_arm(axes[1], arm, colors[arm.label], series, "o-")
    for ax, x in ((axes[0], "tokens"), (axes[1], "training wall-clock (s, evaluation excluded)")):
        ax.set(xlabel=x, title=f"held-out loss vs {x.split(' (')[0]}")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"cross-entropy ({declaration(_runs(arms), 'eval_loss').unit})")
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=7)
    save(fig, path)


def plot_throughput(arms: list[Arm], path: Path) -> bool:
    """tok/s per logging window against step; not written (False) when no run has a window after warm-up
    (every short sweep): an empty axis would say nothing."""
    if not any(throughput_rows(run) for run in _runs(arms)):
        return False
    plt = pyplot()
    colors = colors_of(arms)
    fig, ax = plt.subplots(figsize=(8, 4))
    for arm in arms:
        series = [throughput_rows(run) for run in _by_seed(arm)]
        series = [([s for s, _, _ in rows], [v for _, _, v in rows]) for rows in series]
        _draw_arm(ax, arm, colors[arm.label], series, ".-")
    _seed_legend(ax, arms)
    ax.set_xlabel("step")
    ax.set_ylabel(f"{declaration(_runs(arms), 'tok_s').unit} (logging window)")
    ax.set_title("throughput (warm-up and evaluation rows left out)")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    save(fig, path)
    return True


def plot_accuracy(arms: list[Arm], columns: list[str], path: Path) -> None:
    """Downstream accuracy (acc/<task>, acc_norm/<task>) against tokens, one panel per column, one colour
    per arm (seeds of an arm share it)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(columns), figsize=(4.5 * len(columns), 4), squeeze=False)
    for ax, column in zip(axes[0], columns, strict=True):
        _per_arm(ax, arms, column, "o-")
        ax.set_title(f"{column} (higher is better)", fontsize=9)
        ax.set_xlabel("tokens")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(declaration(_runs(arms), columns[0]).unit)
    if axes[0][0].get_legend_handles_labels()[0]:
        axes[0][0].legend(fontsize=7)
    save(fig, path)


def plot_column(arms: list[Arm], column: MetricColumn, path: Path) -> None:
    """A declared column against tokens, one colour per arm: its meaning and unit as its producer declared."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    _per_arm(ax, arms, column.name, ".-")
    ax.set_title(f"{column.meaning or column.name} ({column.unit}) vs tokens", fontsize=9)
    ax.set_xlabel("tokens")
    ax.set_ylabel(f"{column.name} ({column.unit})")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    save(fig, path)


def plot_pairs(
    pairs: list[Pair], control: Arm, path: Path, what: str = "held-out loss minus control"
) -> None:
    """Mean paired difference of held-out loss (or `what`) per arm, with its 95% interval where there are
    2+ seeds."""
    plt = pyplot()
    shown = [p for p in pairs if p.mean is not None]
    fig, ax = plt.subplots(figsize=(8, max(2.5, 1.2 + 0.45 * len(shown))))  # title, axis: ~1.2 in
    for i, pair in enumerate(shown):
        ci = pair.interval
        if ci:
            ax.plot(ci, [i, i], "-", color="tab:blue", linewidth=2)
        ax.plot([pair.mean], [i], "o", color="tab:blue")
    ax.axvline(0.0, color="gray", linewidth=1)
    ax.set_yticks(range(len(shown)), [p.arm.label for p in shown], fontsize=7)
    ax.invert_yaxis()  # first arm on top, as in the table
    # One seed per arm draws no interval, so the axis must not promise one.
    drawn = any(p.interval for p in shown)
    ax.set_xlabel(f"{what} ({'mean over seeds, 95% t interval' if drawn else 'one seed: no interval'})")
    ax.set_title(f"control: {control.label}", fontsize=9)
    ax.grid(alpha=0.3, axis="x")
    save(fig, path)


def _share_columns(columns: list[str]) -> list[str]:
    return [c for c in columns if re.search(r"share", c) and re.search(r"\d+$", c)]


def telemetry_shares(run: Run) -> tuple[list[int], list[str], list[list[float]]] | None:
    """Per-layer expert shares of the last logged step of telemetry.csv, if the run wrote one with a
    `layer` column and per-expert share columns (`..share..<e>`)."""
    path = RunDir(run.path).telemetry
    if not path.is_file():
        return None
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or "layer" not in rows[0]:
        return None
    columns = _share_columns(list(rows[0]))
    if not columns:
        return None
    last_step = rows[-1].get("step")
    last = [r for r in rows if r.get("step") == last_step]
    layers, values = [], []
    for row in last:
        try:
            layers.append(int(float(row["layer"])))
            values.append([float(row[c]) if row[c] not in ("", None) else math.nan for c in columns])
        except (ValueError, KeyError):
            continue
    return (layers, columns, values) if layers else None


def plot_shares(run: Run, path: Path) -> bool:
    shares = telemetry_shares(run)
    if shares is None:
        return False
    layers, columns, values = shares
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(1.5 + 0.5 * len(columns), 1 + 0.4 * len(layers)))
    image = ax.imshow(values, aspect="auto", cmap="viridis")
    if len(columns) <= 16 and len(layers) <= 32:  # small enough to print each share
        for row, shares_row in enumerate(values):
            for col, share in enumerate(shares_row):
                ax.text(col, row, f"{share:.2f}", ha="center", va="center", fontsize=6, color="white")
    ax.set_xticks(range(len(columns)), [re.search(r"(\d+)$", c).group(1) for c in columns])
    ax.set_yticks(range(len(layers)), [str(layer) for layer in layers])
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_title(f"expert token shares, last step ({run.name})", fontsize=8)
    fig.colorbar(image, ax=ax)
    save(fig, path)
    return True


def write_plots(
    runs: list[Run],
    arms: list[Arm],
    pairs: list[Pair],
    control: Arm | None,
    folder: Path,
    accuracy_pairs: dict[str, list[Pair]] | None = None,
) -> list[Path]:
    """Every plot of the report under folder/; returns the files written. `accuracy_pairs`: each downstream
    accuracy column's paired comparison with the control (an accuracy plot, and its paired deltas)."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    overlay = folder / "loss_vs_tokens.png"
    plot_overlay(arms, overlay)
    written.append(overlay)
    wallclock = folder / "loss_vs_wallclock.png"
    plot_wallclock(arms, wallclock)
    written.append(wallclock)
    throughput = folder / "tok_s.png"
    if plot_throughput(arms, throughput):
        written.append(throughput)
    if control is not None and any(p.mean is not None for p in pairs):
        deltas = folder / "paired_deltas.png"
        plot_pairs(pairs, control, deltas)
        written.append(deltas)
    accuracy_pairs = accuracy_pairs or {}
    if accuracy_pairs:
        accuracy = folder / "accuracy_vs_tokens.png"
        plot_accuracy(arms, list(accuracy_pairs), accuracy)
        written.append(accuracy)
    for column, column_pairs in accuracy_pairs.items():
        if control is not None and any(p.mean is not None for p in column_pairs):
            deltas = folder / f"paired_deltas_{_safe(column)}.png"
            plot_pairs(column_pairs, control, deltas, f"{column} minus control (higher is better)")
            written.append(deltas)
    for column in plotted(_runs(arms)):
        path = folder / f"metric_{_safe(column.name)}.png"
        plot_column(arms, column, path)
        written.append(path)
    arm_of = {run.name: arm for arm in arms for run in arm.runs}
    for run in runs:
        if run.series("train_loss") or run.series("eval_loss"):
            path = folder / f"run_{_safe(run.name)}.png"
            plot_run(run, path, arm_of.get(run.name))
            written.append(path)
        shares = folder / f"shares_{_safe(run.name)}.png"
        if plot_shares(run, shares):
            written.append(shares)
    return written
