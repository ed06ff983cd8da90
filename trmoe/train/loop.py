"""The train loop, in one screen: the Trainer (trmoe.train.trainer) holds the components and does each part;
trmoe.train.job runs the launch around it."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from trmoe.config.schema import Config
from trmoe.run.signals import StopSignals
from trmoe.train import guards, job
from trmoe.train.trainer import Trainer


def train(raw_cfg: DictConfig, run_dir: Path, cfg: Config | None = None) -> float:
    """Run one training job into run_dir, or continue the run it holds (trainer.resume, docs/reliability.md);
    returns the final held-out loss. `cfg`: raw_cfg already checked by to_config (else it is checked here).
    Raises UserError on bad input, or on a run directory it must not overwrite or continue, before anything
    is written."""
    return job.run(raw_cfg, run_dir, loop, cfg)


def loop(trainer: Trainer, stop: StopSignals) -> float:
    trainer.start()  # resume from the launch's checkpoint, or evaluate step 0
    steps = trainer.cfg.trainer.steps
    while trainer.step < steps:
        step = trainer.step + 1
        verdict = trainer.train_step(step, stop)  # forward, backward, clip, guard, optimizer step
        if verdict.action == guards.ROLLBACK:  # a loss spike: back to the last good checkpoint
            trainer.rollback(step, verdict.reason)
            continue
        trainer.maybe_log(step)  # a metrics row (with an evaluation) at the log steps
        trainer.maybe_save(step)  # the checkpoint cadence, and the final step
        trainer.check_guard(step)  # too many non-finite steps in a row: stop
        signum = stop.agreed()  # a stop signal on any rank (SIGUSR2, SIGTERM, Ctrl-C, SIGHUP): save, stop
        if signum is not None and step < steps:
            trainer.preempt(step, stop, signum)
    return trainer.finish()
