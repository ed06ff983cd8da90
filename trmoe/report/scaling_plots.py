"""The Scaling section's PNG plots (trmoe.report.scaling): loss vs compute with each arm's frontier and band,
the compute multiplier against the control, the backtest. Apart from trmoe.report.plots, whose figures are
of runs and arms over steps; these are of fitted laws."""

from __future__ import annotations

from pathlib import Path

from trmoe.report.plots import colors_of, pyplot, save


def plot_scaling(scaling, folder: Path) -> list[Path]:
    """The Scaling section's plots (trmoe.report.scaling): loss vs compute per arm (fit points, each rung's
    fitted L(N, C/(κN)) over its runs, the frontier L*(C) with its 95% band out to the targets); the
    compute multiplier against the control with its band; the backtest (predicted with its interval vs
    measured)."""
    import numpy as np

    from trmoe.report.scaling import frontier_band, multiplier_band

    if not scaling.arms:  # every ladder run was left out (the section lists why)
        return []
    plt = pyplot()
    fitted = [a for a in scaling.arms if a.identified]
    colors = colors_of(scaling.arms)
    top = max([c for _, c in scaling.at] + [p.C for a in scaling.arms for p in a.points])
    low = min(p.C for a in scaling.arms for p in a.points)
    grid = np.geomspace(low, top, 60)
    written = []

    fig, ax = plt.subplots(figsize=(8, 5))
    for arm in scaling.arms:
        color = colors[arm.name]
        ax.plot([p.C for p in arm.points], [p.L for p in arm.points], "o", color=color, label=arm.name, ms=4)
        if not arm.identified:
            continue
        for n in sorted({p.N for p in arm.points}):
            mine = [p for p in arm.points if p.N == n]
            cs = np.geomspace(min(p.C for p in mine), max(p.C for p in mine), 10)
            kappa = float(np.exp(np.mean([np.log(p.kappa) for p in mine])))
            ax.plot(cs, arm.fit.law.loss(n, cs / (kappa * n)), ":", color=color, linewidth=0.8)
        band = frontier_band(scaling, arm, grid)
        ax.plot(grid, band[0], "-", color=color, linewidth=1.2)
        ax.fill_between(grid, band[1], band[2], color=color, alpha=0.2, linewidth=0)
    for name, c in scaling.at[-len(scaling.targets) :] if scaling.targets else []:
        ax.axvline(c, color="gray", linewidth=0.8, linestyle="--")
        ax.annotate(name, (c, 1), xycoords=("data", "axes fraction"), fontsize=7, va="top")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("training compute C (FLOPs)")
    ax.set_ylabel("final held-out loss (nats/token)")
    ax.set_title("loss vs compute: runs, fitted rungs (dotted), frontier L*(C) with 95% band", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    written.append(save(fig, folder / "scaling_loss_vs_compute.png"))

    compared = [a for a in fitted if a.comparison is not None and not a.comparison.reason]
    if compared:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for arm in compared:
            band = multiplier_band(scaling, arm, grid)
            color = colors[arm.name]
            ax.plot(grid, band[0], "-", color=color, label=arm.name)
            ax.fill_between(grid, band[1], np.minimum(band[2], 1e6), color=color, alpha=0.2, linewidth=0)
            c = arm.comparison
            ax.plot(c.C, c.k, "o", color=color, ms=4)
        ax.axhline(1.0, color="gray", linewidth=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("training compute C (FLOPs)")
        ax.set_ylabel(f"compute multiplier k vs {scaling.control.name}")
        ax.set_title("k > 1: the control needs k x the compute for the arm's loss (95% band)", fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
        written.append(save(fig, folder / "scaling_multiplier.png"))

    tested = [a for a in scaling.arms if a.backtest is not None and not a.backtest.reason]
    if tested:
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
        written.append(save(fig, folder / "scaling_backtest.png"))
    return written
