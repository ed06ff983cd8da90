"""Where a run's metrics rows go: metrics.csv, the experiment trackers and the console display.

One component, so that a row reaches all of them at once. Rank 0 writes; the ranks > 0 of a distributed run
compute the same rows (their reductions are collective) and write nothing. A rollback rewinds metrics.csv; the
trackers keep what they logged (MLflow and W&B skip the replayed steps, TensorBoard records them again).
"""

from __future__ import annotations

from typing import Any

from trmoe.config.schema import Config, LoggerConfig, Progress
from trmoe.run import records
from trmoe.run.launch import Launch
from trmoe.run.rundir import RunDir
from trmoe.train.observe import trackers
from trmoe.train.observe.metrics import NullMetrics
from trmoe.train.observe.progress import ProgressReporter


class RunOutput:
    """`write(row)` sends a metrics row to metrics.csv (`columns`), the trackers (`logger.*`) and, with
    `eta_s`, the progress display. A resumed run appends to its metrics.csv and continues its tracker runs
    after the checkpoint's step; a restart (killed before its first checkpoint) logs again from step 0."""

    def __init__(
        self,
        cfg: Config,
        launch: Launch,
        *,
        rank: int,
        columns: tuple[str, ...],
        config_hash: str,
        config: dict[str, Any],
    ):
        main, run = rank == 0, launch.run
        self.total_steps = cfg.trainer.steps
        self.metrics = (
            records.StepCsv(
                run.metrics,
                columns,
                # a header alone (a resume that found no metrics.csv) gets this run's header
                append=launch.mode == "resume" and launch.metrics_rows > 0,
                rows=launch.metrics_rows,
            )
            if main
            else NullMetrics()
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
        )

    def write(
        self, row: dict[str, Any], layers: list[dict[str, Any]] | None = None, eta_s: float | None = None
    ) -> None:
        """A metrics row, with the telemetry.csv rows of the same step (`layers`) for the trackers."""
        self.metrics.write(row)
        self.trackers.log(row, layers=layers)
        if eta_s is not None:
            self.progress.report(row, self.total_steps, eta_s=eta_s)

    def rewind(self, step: int) -> None:
        """metrics.csv back to its rows up to `step` (a rollback to that step's checkpoint)."""
        self.metrics.rewind(step)

    def close_files(self) -> None:
        """metrics.csv and the display (idempotent)."""
        self.progress.close()
        self.metrics.close()

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
