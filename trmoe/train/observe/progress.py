"""Progress display: a live bar on an interactive terminal, plain log lines elsewhere (SLURM logs, CI)."""

from __future__ import annotations

import logging
import math
import sys

from trmoe.config.schema import Progress

log = logging.getLogger("trmoe")

FILE_ONLY = "trmoe_file_only"  # a record attribute: the line is for the log file, not the console


def _not_file_only(record: logging.LogRecord) -> bool:
    return not getattr(record, FILE_ONLY, False)


class ProgressReporter:
    """Closed by `close()` or, whatever ends the run, by leaving it as a context manager: the bar's log
    redirection must be undone before the run's log file is detached (else it puts the detached handler
    back when it is collected)."""

    def __init__(self, mode: Progress, total_steps: int, start_step: int = 0):
        use_bar = mode == Progress.bar or (mode == Progress.auto and sys.stdout.isatty())
        self._bar = None
        if use_bar:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)
            # log lines (evaluations, checkpoints) print above the bar instead of into its line
            self._redirect = logging_redirect_tqdm()
            self._redirect.__enter__()
            self._console = [
                h for h in logging.getLogger().handlers if not isinstance(h, logging.FileHandler)
            ]
            for handler in self._console:
                handler.addFilter(_not_file_only)

    def step(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def report(self, row: dict, total_steps: int, eta_s: float) -> None:
        """Called at log steps with the metrics row (the bar shows its own ETA)."""
        parts = [f"loss {row['train_loss']:.4f}", f"lr {row['lr']:.2e}", f"tok/s {row['tok_s']:.0f}"]
        if row.get("eval_loss") is not None:
            parts.insert(1, f"eval {row['eval_loss']:.4f}")
        if row.get("mfu") is not None:  # nan: faster than the peak, which reads low (observe/meters.py)
            parts.append(f"mfu {100 * row['mfu']:.1f}%" if math.isfinite(row["mfu"]) else "mfu n/a")
        if row.get("peak_mem_gib") is not None:
            parts.append(f"mem {row['peak_mem_gib']:.2f} GiB")
        if row.get("expert_imbalance") is not None:  # telemetry.moe
            parts.append(f"imb {row['expert_imbalance']:.2f}")
        if row.get("expert_dead") is not None:
            parts.append(f"dead {row['expert_dead']}")
        eta = f"{int(eta_s // 60)}m{int(eta_s % 60):02d}s"
        if self._bar is not None:
            self._bar.set_postfix_str(" | ".join(parts), refresh=True)
        # with the bar the line goes to train.log only (the bar shows it on the console)
        extra = {FILE_ONLY: True} if self._bar is not None else None
        log.info("step %d/%d | %s | eta %s", row["step"], total_steps, " | ".join(parts), eta, extra=extra)
        if self._bar is not None and row.get("eval_loss") is not None:
            # an evaluation stays on the console as its own line (the bar's figures change at the next row)
            log.info("step %d | eval %.4f", row["step"], row["eval_loss"])

    def close(self) -> None:
        if self._bar is not None:
            for handler in self._console:
                handler.removeFilter(_not_file_only)
            self._redirect.__exit__(None, None, None)
            self._bar.close()
            self._bar = None

    def __enter__(self) -> ProgressReporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
