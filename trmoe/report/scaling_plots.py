"""The Scaling section's PNG plots (trmoe.report.scaling): loss vs compute with each arm's frontier and band,
the compute multiplier against the control, the backtest. Apart from trmoe.report.plots, whose figures are
of runs and arms over steps; these are of fitted laws.

What the axes show is the data: x spans the runs' compute (a fifth of a decade of room each side), and the
end of the data is a dotted vertical line, "last run". The targets (1b, 8b) lie decades beyond; stretching
the axis to them put every run in its left tenth, so they are marks at the right edge instead: an arrow at
the predicted loss or multiplier (with its interval as a bar) and a note of how far beyond they lie. The
y range is the runs' (and the edge marks'); a 95% band is clipped to it, and where a band leaves the axis
(an end beyond it, or unbounded: no finite end) a triangle on that edge says so, never a finite stand-in
for ∞. Every PNG records in its `Axes` text chunk what each panel holds (limits, titles, labels, the data
extent of everything drawn, its texts): what the tests and a reader's tools read back."""

from __future__ import annotations

import math
from pathlib import Path

from trmoe.durable import json_text
from trmoe.report.plots import colors_of, pyplot, titles

MARGIN = 10**0.2  # x room each side of the runs' compute (a fifth of a decade)
MARK_EVERY = 6  # one edge triangle per this many grid points where a band leaves the axis
EDGE_NOTE = "▲/▼ on an edge: the 95% band goes beyond the axis there (to ∞ where unbounded)"


def plot_scaling(scaling, folder: Path) -> list[Path]:
    """The Scaling section's plots (trmoe.report.scaling): loss vs compute per arm (fit points, each rung's
    fitted L(N, C/(κN)) over its runs, the frontier L*(C) with its 95% band over the runs' compute, the
    targets' predicted losses marked at the right edge); the compute multiplier against the control with
    its band (or the interpolated fallback at the rungs); the backtest (predicted with its interval vs
    measured)."""
    if not scaling.arms:  # every ladder run was left out (the section lists why)
        return []
    written = [_loss_vs_compute(scaling, folder / "scaling_loss_vs_compute.png")]
    multiplier = _multiplier(scaling, folder / "scaling_multiplier.png")
    written += [multiplier] if multiplier else []
    backtest = _backtest(scaling, folder / "scaling_backtest.png")
    return written + ([backtest] if backtest else [])


def _runs_span(scaling) -> tuple[float, float]:
    cs = [p.C for a in scaling.arms for p in a.points]
    return min(cs), max(cs)


def _targets(scaling) -> list[tuple[str, float]]:
    return scaling.at[-len(scaling.targets) :] if scaling.targets else []


def _frame(ax, scaling, ylim: tuple[float, float]) -> None:
    """The axes' limits from the data, the "last run" line, log scales, and the targets' note."""
    low, last = _runs_span(scaling)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(low / MARGIN, last * MARGIN)
    ax.set_ylim(*ylim)
    ax.axvline(last, color="black", linewidth=0.9, linestyle=":")
    ax.annotate("last run", (last, 0.02), xycoords=("data", "axes fraction"), rotation=90, fontsize=7,
                ha="right", va="bottom")  # fmt: skip
    beyond = [f"{name}: C {c:.3g}, {math.log10(c / last):.1f} decades beyond the last run"
              for name, c in _targets(scaling)]  # fmt: skip
    if beyond:
        ax.text(0.99, 0.98, "targets, beyond the axis (→ right of it where estimated):\n" + "\n".join(beyond),
                transform=ax.transAxes, fontsize=7, ha="right", va="top",
                bbox={"facecolor": "white", "edgecolor": "0.8", "alpha": 0.9})  # fmt: skip
    ax.grid(alpha=0.3, which="both")


def _ylim(values, *, floor: float = 0.0, cap: float = math.inf) -> tuple[float, float]:
    """A log axis over the finite positive values, a tenth of a decade of room each side, within
    [floor, cap] (the data decide it, never an unbounded interval end)."""
    finite = [v for v in values if v is not None and math.isfinite(v) and v > 0]
    lo, hi = (min(finite), max(finite)) if finite else (1.0, 10.0)
    lo, hi = max(lo / 10**0.1, floor) if floor else lo / 10**0.1, min(hi * 10**0.1, cap)
    return (lo, hi) if hi > lo else (lo / 2, lo * 2)


def _band(ax, x, low, high, color, ylim) -> bool:
    """The 95% band between low and high clipped to the axis; where an end is beyond it (or unbounded),
    a triangle on that edge (True when there is one). No band where there is no interval (nan)."""
    import numpy as np

    x, low, high = (np.asarray(v, dtype=float) for v in (x, low, high))
    shown = ~np.isnan(low) | ~np.isnan(high)
    if not shown.any():
        return False
    lo_end = np.where(np.isnan(low) | (low < ylim[0]), ylim[0], low)  # no finite lower end: unbounded
    hi_end = np.where(np.isnan(high) | (high > ylim[1]), ylim[1], high)
    ax.fill_between(x, np.minimum(lo_end, ylim[1]), np.maximum(hi_end, ylim[0]), where=shown,
                    color=color, alpha=0.2, linewidth=0)  # fmt: skip
    marked = False
    for end, y, marker in ((hi_end, ylim[1], "^"), (lo_end, ylim[0], "v")):
        out = np.flatnonzero(shown & (end == y))[::MARK_EVERY]
        if out.size:
            ax.plot(x[out], np.full(out.size, y), marker, color=color, ms=5, clip_on=False)
            marked = True
    return marked


def _edge(ax, i: int, name: str, y, low, high, color, ylim) -> bool:
    """Target i's estimate (and interval) as an arrow named by the target (and a bar) just right of the
    axis, clipped to its y range (a triangle where the interval goes beyond: True); the targets side by
    side, in the order of the note. No bar without an interval (nan)."""
    from matplotlib.transforms import blended_transform_factory

    at_edge = blended_transform_factory(ax.transAxes, ax.transData)
    x, marked = 1.02 + 0.04 * i, False
    if not (math.isnan(low) or math.isnan(high)):
        lo, hi = min(max(low, ylim[0]), ylim[1]), max(min(high, ylim[1]), ylim[0])
        ax.plot([x, x], [lo, hi], "-", color=color, linewidth=2, transform=at_edge, clip_on=False)
        for beyond, end, marker in ((high > ylim[1], hi, "^"), (low < ylim[0], lo, "v")):
            if beyond:
                ax.plot([x], [end], marker, color=color, ms=5, transform=at_edge, clip_on=False)
                marked = True
    if ylim[0] <= y <= ylim[1]:
        ax.plot([x], [y], ">", color=color, ms=6, transform=at_edge, clip_on=False)
        ax.text(x, y, f" {name}", transform=at_edge, fontsize=6, ha="left", va="bottom", color=color)
    return marked


def _loss_vs_compute(scaling, path: Path) -> Path:
    import numpy as np

    from trmoe.report.scaling import _loss_cell, frontier_band

    plt = pyplot()
    colors = colors_of(scaling.arms)
    low, last = _runs_span(scaling)
    grid = np.geomspace(low, last, 60)
    bands = {a.name: frontier_band(scaling, a, grid) for a in scaling.arms if a.identified}
    edges = {}  # the targets' predicted losses worth a figure (within (0, ln V]: trmoe.report.scaling)
    for arm in scaling.arms:
        for name, e in arm.predictions.items():
            cell, _ = _loss_cell(scaling, e)
            if cell[0] is not None:
                edges[(arm.name, name)] = cell
    ys = [p.L for a in scaling.arms for p in a.points] + [v for b in bands.values() for v in b[0]]
    ylim = _ylim(ys + [e[0] for e in edges.values()])
    fig, ax = plt.subplots(figsize=(8, 5))
    marked = False
    for arm in scaling.arms:
        color = colors[arm.name]
        ax.plot([p.C for p in arm.points], [p.L for p in arm.points], "o", color=color, label=arm.name, ms=4)
        if arm.name not in bands:
            continue
        for n in sorted({p.N for p in arm.points}):
            mine = [p for p in arm.points if p.N == n]
            cs = np.geomspace(min(p.C for p in mine), max(p.C for p in mine), 10)
            kappa = float(np.exp(np.mean([np.log(p.kappa) for p in mine])))
            ax.plot(cs, _inside(arm.fit.law.loss(n, cs / (kappa * n)), ylim), ":", color=color, linewidth=0.8)
        band = bands[arm.name]
        ax.plot(grid, _inside(band[0], ylim), "-", color=color, linewidth=1.2)
        marked |= _band(ax, grid, band[1], band[2], color, ylim)
        for i, (name, _) in enumerate(_targets(scaling)):
            if (arm.name, name) in edges:
                est, lo, hi = (math.nan if v is None else v for v in edges[(arm.name, name)])
                marked |= _edge(ax, i, name, est, lo, hi, color, ylim)
    _frame(ax, scaling, ylim)
    ax.set_xlabel("training compute C (FLOPs)")
    ax.set_ylabel("final held-out loss (nats/token)")
    ax.set_title("loss vs compute: runs, fitted rungs (dotted), frontier L*(C) with 95% band", fontsize=9)
    ax.legend(fontsize=7, loc="lower left", title=EDGE_NOTE if marked else None, title_fontsize=6)
    return _save(fig, path)


def _inside(values, ylim):
    """A curve's values, nan (a gap) outside the axis: a line leaves the axis rather than being drawn
    where the axis cannot show it."""
    import numpy as np

    v = np.asarray(values, dtype=float)
    return np.where((v >= ylim[0]) & (v <= ylim[1]), v, np.nan)


def _multiplier(scaling, path: Path) -> Path | None:
    import numpy as np

    from trmoe.report.scaling import multiplier_band

    if scaling.control is None:
        return None
    compared = [
        a for a in scaling.arms if a.identified and a.comparison is not None and not a.comparison.reason
    ]
    fallback = [a for a in scaling.arms if a.fallback and any(math.isfinite(k) for k, _ in a.fallback)]
    if not compared and not fallback:
        return None
    plt = pyplot()
    colors = colors_of(scaling.arms)
    low, last = _runs_span(scaling)
    grid = np.geomspace(low, last, 60)
    bands = {a.name: multiplier_band(scaling, a, grid) for a in compared}
    rungs = len(scaling.at) - len(scaling.targets)
    ks = [1.0] + [k for b in bands.values() for k in b[0]] + [k for a in fallback for k, _ in a.fallback]
    ks += [k for a in compared for k in a.comparison.k]
    ylim = _ylim(ks, floor=1e-3, cap=1e3)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    marked = False
    for arm in compared:
        band, c, color = bands[arm.name], arm.comparison, colors[arm.name]
        ax.plot(grid, _inside(band[0], ylim), "-", color=color, label=arm.name)
        marked |= _band(ax, grid, band[1], band[2], color, ylim)
        ax.plot(c.C[:rungs], _inside(c.k[:rungs], ylim), "o", color=color, ms=4)
        for i, (name, _) in enumerate(_targets(scaling)):
            marked |= _edge(ax, i, name, c.k[rungs + i], c.low[rungs + i], c.high[rungs + i], color, ylim)
    for arm in fallback:
        ks = np.array([k for k, _ in arm.fallback])
        cs = np.array([c for _, c in scaling.at[: len(ks)]])
        ax.plot(cs, _inside(ks, ylim), "x", color=colors[arm.name], ms=7, mew=1.5,
                label=f"{arm.name}: interpolated at the rungs (law not identified), no interval")  # fmt: skip
    ax.axhline(1.0, color="gray", linewidth=1)
    _frame(ax, scaling, ylim)
    ax.set_xlabel("training compute C (FLOPs)")
    ax.set_ylabel(f"compute multiplier k vs {scaling.control.name}")
    ax.set_title("k > 1: the control needs k x the compute for the arm's loss (95% band)", fontsize=9)
    ax.legend(fontsize=7, loc="lower left", title=EDGE_NOTE if marked else None, title_fontsize=6)
    return _save(fig, path)


def _backtest(scaling, path: Path) -> Path | None:
    tested = [a for a in scaling.arms if a.backtest is not None and not a.backtest.reason]
    if not tested:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 1.5 + 0.5 * len(tested)))
    for i, arm in enumerate(tested):
        b = arm.backtest
        ax.plot([b.low, b.high], [i, i], "-", color="tab:blue", linewidth=2)
        ax.plot([b.predicted], [i], "o", color="tab:blue", label="predicted" if i == 0 else None)
        ax.plot([b.measured], [i], "x", color="tab:red", ms=8, label="measured" if i == 0 else None)
    ax.set_yticks(range(len(tested)), [a.name for a in tested], fontsize=7)
    ax.set_xlabel("loss of the largest rung, fitted without it (95% prediction interval)")
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=7)
    return _save(fig, path)


def describe(fig) -> list[dict]:
    """What each panel holds, in data coordinates: limits, scales, title and labels, the extent of every
    line and band (edge marks included: their place on the axis), how many values are infinite, and its
    texts. Read from the drawn artists, not from what the plotting code meant to draw."""
    import numpy as np

    out = []
    for ax in fig.axes:
        to_data = ax.transData.inverted()
        xy, infinite = [], 0
        shapes = [(a.get_transform(), a.get_xydata()) for a in ax.lines]
        shapes += [(c.get_transform(), p.vertices) for c in ax.collections for p in c.get_paths()]
        for transform, raw in shapes:
            raw = np.asarray(raw, dtype=float).reshape(-1, 2)
            infinite += int(np.isinf(raw).sum())
            raw = raw[np.isfinite(raw).all(axis=1)]
            if raw.size:
                xy.append(to_data.transform(transform.transform(raw)))
        xy = np.concatenate(xy) if xy else np.zeros((0, 2))
        xy = xy[np.isfinite(xy).all(axis=1)]
        legend = ax.get_legend()
        texts = [t.get_text() for t in ax.texts]
        texts += (
            [t.get_text() for t in legend.get_texts()] + [legend.get_title().get_text()] if legend else []
        )
        out.append({
            "title": ax.get_title(), "xlabel": ax.get_xlabel(), "ylabel": ax.get_ylabel(),
            "xscale": ax.get_xscale(), "yscale": ax.get_yscale(),
            "xlim": list(ax.get_xlim()), "ylim": list(ax.get_ylim()),
            "x": [float(xy[:, 0].min()), float(xy[:, 0].max())] if len(xy) else None,
            "y": [float(xy[:, 1].min()), float(xy[:, 1].max())] if len(xy) else None,
            "infinite": infinite, "texts": [t for t in texts if t],
        })  # fmt: skip
    return out


def _save(fig, path: Path) -> Path:
    """PNG with its titles and panels' description (`describe`) as text chunks; the saved area is the
    drawn one (bbox_inches="tight"): the edge marks and notes outside the axes are not cut."""
    fig.tight_layout()
    fig.canvas.draw()  # the limits and texts as they are drawn
    meta = {"Title": titles(fig), "Axes": json_text(describe(fig))}
    fig.savefig(path, dpi=100, metadata=meta, bbox_inches="tight", pad_inches=0.15)
    pyplot().close(fig)
    return path
