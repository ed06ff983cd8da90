"""The Hydra callback that writes the sweep report when a local --multirun ends (conf/config.yaml:
hydra.callbacks.report). Hydra instantiates it for every run, so this module imports nothing heavy, and its
__init__ only the report's Scaling options (trmoe.report.ladder: no torch)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf


class ReportCallback(Callback):
    def __init__(
        self, control: str | None = None, enabled: bool = True, scaling_samples: int | None = None
    ) -> None:
        from trmoe.report.ladder import DEFAULT_N, Options, parse_scaling
        from trmoe.report.scaling_targets import DEFAULT_TARGETS

        self.control = control  # the grid's control arm, e.g. "arm=routing_ablation/dense"
        self.enabled = enabled
        # a ladder's Scaling options: checked here, as the app starts, not after the sweep has trained
        samples = Options.samples if scaling_samples is None else scaling_samples
        where = "hydra.callbacks.report.scaling_samples"
        self.scaling = parse_scaling(DEFAULT_N, ",".join(DEFAULT_TARGETS), samples, where)
        self.found_report: bool | None = None  # whether report.md was there when the sweep started

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from trmoe.report.build import REPORT_MD

        self.found_report = (Path(str(config.hydra.sweep.dir)) / REPORT_MD).exists()

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if not self.enabled:
            return
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if not sweep_dir.is_dir():
            return
        from trmoe.report.build import REPORT_MD, SWEEP_WRITER, build_report
        from trmoe.report.study import save_multirun_config

        save_multirun_config(sweep_dir, config)  # an Optuna sweep: its searched keys and study
        # another sweep into this hydra.sweep.dir (before this one, or while it ran) wrote the report this one
        # replaces: said, never silent (the new one reads every run in the folder, theirs included)
        replaced = (sweep_dir / REPORT_MD).exists()
        when = {True: "an earlier sweep", False: "a sweep that ran beside this one"}.get(
            self.found_report, "another sweep"
        )

        try:
            rep = build_report(
                [sweep_dir], sweep_dir, control=self.control, scaling=self.scaling, written_by=SWEEP_WRITER
            )
        except Exception as e:  # the runs are written; a report problem must not hide them
            print(f"trmoe: the sweep report failed: {type(e).__name__}: {e}", file=sys.stderr)
            return
        for warning in rep.warnings:
            print(f"trmoe: report warning: {warning}", file=sys.stderr)
        if replaced:
            print(
                f"trmoe: report warning: {sweep_dir / REPORT_MD} held the report of {when} "
                "in this hydra.sweep.dir; replaced by this one's, which reads every run in the folder (give "
                "each sweep its own hydra.sweep.dir)",
                file=sys.stderr,
            )
        print(f"trmoe: sweep report: {sweep_dir / REPORT_MD}", file=sys.stderr)


def report_failed_search(hydra_cfg: dict, trials: list[str]) -> None:
    """An Optuna search in which every trial failed: the sweeper asks its study for the best trial and gets
    optuna's ValueError ("No trials are completed yet"), and Hydra skips the report callback. Instead: the
    sweep's report (which lists each trial as failed) and one line naming the trials (docs/reliability.md)."""
    cfg = OmegaConf.create(hydra_cfg)
    report = (cfg.get("callbacks") or {}).get("report") or {}
    ReportCallback(**{k: v for k, v in report.items() if k != "_target_"}).on_multirun_end(
        OmegaConf.create({"hydra": cfg})
    )
    print(
        f"trmoe: every trial of the search failed (trials {', '.join(trials)}: each one's line is above), so "
        f"there is no best trial; the sweep's report is in {cfg.sweep.dir}",
        file=sys.stderr,
    )
