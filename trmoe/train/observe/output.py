"""Where a run's rows go: metrics.csv, telemetry.csv (telemetry.moe's per-layer rows of the same step), the
experiment trackers and the console display.

One component, so that a row reaches all of them at once. Rank 0 writes; the ranks > 0 of a distributed run
compute the same rows (their reductions are collective) and write nothing. A rollback rewinds metrics.csv; the
trackers keep what they logged (MLflow and W&B skip the replayed steps, TensorBoard records them again).
"""

from __future__ import annotations

from typing import Any

from trmoe.config.schema import Config, LoggerConfig, Progress, TrainerConfig
from trmoe.run import records, trackers
from trmoe.run.cadence import Cadence
from trmoe.run.columns import MetricColumn, header, sections
from trmoe.run.launch import Launch
from trmoe.run.rundir import RunDir
from trmoe.train.observe.evaluation import held_out_cadence
from trmoe.train.observe.metrics import NullMetrics
from trmoe.train.observe.progress import ProgressReporter
from trmoe.train.observe.telemetry import telemetry_columns


def log_cadence(t: TrainerConfig) -> Cadence:
    """The steps that write a metrics row (and telemetry's gradient norms): 1, every trainer.log_every,
    the held-out evaluation's steps and the last. A step at which any evaluator is due, or a guard halts
    the run, writes one too."""
    return Cadence(t.log_every, at=(1, t.steps)) | held_out_cadence(t)


class RunOutput:
    """`write(row, layers)` sends a metrics row to metrics.csv (`columns`: the producers' declarations), its
    telemetry rows (`layers`) to telemetry.csv (when `telemetry_experts` is given), both to the trackers
    (`logger.*`, each column under its declared section) and, with `eta_s`, the row to the progress display.
    A resumed run appends to its metrics.csv and continues its tracker runs after the checkpoint's step;
    a restart (killed before its first checkpoint) logs again from step 0."""

    def __init__(
        self,
        cfg: Config,
        launch: Launch,
        *,
        rank: int,
        columns: tuple[MetricColumn, ...],
        config_hash: str,
        config: dict[str, Any],
        telemetry_experts: int | None = None,
    ):
        main, run = rank == 0, launch.run
        self.total_steps = cfg.trainer.steps
        self.metrics = (
            records.StepCsv(
                run.metrics,
                header(columns),
                # a header alone (a resume that found no metrics.csv) gets this run's header
                append=launch.mode == "resume" and launch.metrics_rows > 0,
                rows=launch.metrics_rows,
                migrate=True,  # an older header: to this run's columns, by name
            )
            if main
            else NullMetrics()
        )
        self.telemetry = (
            records.StepCsv.continuing(run.telemetry, telemetry_columns(telemetry_experts))
            if main and telemetry_experts is not None
            else None
        )
        self.progress = ProgressReporter(
            cfg.run.progress if main else Progress.log, self.total_steps, start_step=launch.start_step
        )
        self.trackers = trackers.Trackers(
            cfg.logger if main else LoggerConfig(),
            run.path,
            identity=tracker_identity(run, config_hash),
            config=config,
            resume_step={"resume": launch.start_step, "restart": -1}.get(launch.mode),
            sections=sections(columns),
        )

    def write(
        self, row: dict[str, Any], layers: list[dict[str, Any]] | None = None, eta_s: float | None = None
    ) -> None:
        """A metrics row, with the telemetry.csv rows of the same step (`layers`)."""
        if layers and self.telemetry is not None:
            self.telemetry.write_rows(layers)
        self.metrics.write(row)
        self.trackers.log(row, layers=layers)
        if eta_s is not None:
            self.progress.report(row, self.total_steps, eta_s=eta_s)

    def rewind(self, step: int) -> None:
        """metrics.csv and telemetry.csv back to their rows up to `step` (a rollback to that step's
        checkpoint)."""
        self.metrics.rewind(step)
        if self.telemetry is not None:
            self.telemetry.rewind(step)

    def close_files(self) -> None:
        """metrics.csv, telemetry.csv and the display (idempotent)."""
        self.progress.close()
        self.metrics.close()
        if self.telemetry is not None:
            self.telemetry.close()

    def close(self, outcome: BaseException | None = None) -> None:
        """Everything; the trackers are told how the run ended (finished, preempted, failed)."""
        self.close_files()
        if outcome is None:
            self.trackers.__exit__(None, None, None)
        else:
            self.trackers.__exit__(type(outcome), outcome, outcome.__traceback__)


def tracker_identity(run: RunDir, config_hash: str) -> dict[str, Any]:
    """What names a run in a tracker: its name and directory, trmoe's version, the config hash."""
    import trmoe

    return {
        "run_name": run.name,
        "run_dir": str(run.path.resolve()),
        "trmoe_version": trmoe.__version__,
        "config_hash": config_hash,
    }
