"""One training job around a Trainer: from the composed config to a finished, failed or preempted run.

    the run's lock -> config -> device, model spec, ranks -> the launch decision (reads only) -> pre-flight
           checks (controls, wall time on a CPU, trackers, downstream tasks) -> data (its identity checked
           against the run's) -> the memory check -> the launch's writes, status "running", logs
           -> Trainer (builds, writes nothing) -> run_record.announce (log lines, run_config.json)
           -> with the Trainer (its files open) the loop (trmoe.train.loop) -> status "finished" |
              "preempted" | "failed"

Nothing is written before every check has passed: a bad config, a run directory that must not be
overwritten or continued, or data that differs from the checkpoint's raise UserError with the directory
untouched. A run directory that cannot be written (a full disk, a read-only mount) ends with one line and
exit 3 (trmoe.run.storage); a second live launch into the same directory is refused (trmoe.run.lock).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig

from trmoe import distill as distillation
from trmoe.config.resolve import to_config
from trmoe.config.schema import Config
from trmoe.config.spec import model_spec
from trmoe.data.build import build_data
from trmoe.plan import walltime
from trmoe.run import launch, records, signals, status, storage, trackers
from trmoe.run import lock as runlock
from trmoe.run.checkpoint import CheckpointStore, read_pointer
from trmoe.run.identity import config_container, derived_values, training_view
from trmoe.run.rundir import RunDir
from trmoe.runtime import distributed, env, parallel
from trmoe.train import init_from, preflight, run_record, sizing
from trmoe.train.observe.downstream import Downstream
from trmoe.train.prepare import check_backends
from trmoe.train.trainer import Trainer

log = logging.getLogger("trmoe")

Loop = Callable[[Trainer, signals.StopSignals], float]


def run(raw_cfg: DictConfig, run_dir: Path, loop: Loop, cfg: Config | None = None) -> float:
    """Run one job into run_dir with `loop`; returns the final held-out loss. `cfg`: raw_cfg already checked
    by to_config (the app checks it before it imports the training stack), else it is checked here."""
    early = records.EarlyLog()  # what is logged before train.log may be written goes into it first
    logging.getLogger().addHandler(early)
    try:
        with runlock.hold(run_dir, rank=distributed.detect().rank):  # one live launch per run directory
            return _job(raw_cfg, cfg, RunDir(run_dir), early, loop)
    except OSError as e:  # the run directory cannot be written (full disk, read-only): one line, exit 3
        if not storage.is_storage_error(e, run_dir):
            raise
        raise storage.failure(e, run_dir, read_pointer(RunDir(run_dir).checkpoints)) from None
    finally:
        logging.getLogger().removeHandler(early)


def _job(raw_cfg: DictConfig, cfg: Config | None, run: RunDir, early: records.EarlyLog, loop: Loop) -> float:
    cfg = cfg if cfg is not None else to_config(raw_cfg)
    device = env.select_device(cfg.hardware)
    amp_dtype = env.autocast_dtype(cfg.hardware, device)
    spec = model_spec(cfg)
    dist_env, device = distributed.init(device)  # torchrun / submitit ranks; shut down by the app
    rank = dist_env.rank
    store = CheckpointStore.for_run(cfg.checkpoint, run, rank, dist_env.world_size, cfg.trainer.steps)
    view = training_view(config_container(raw_cfg), derived_values(cfg, dist_env.world_size, amp_dtype), None)
    plan = launch.decide(cfg, view, run, store)  # reads only
    preflight.check(plan, cfg)
    init = init_from.resolve(cfg, plan, dist_env.world_size)  # trainer.init_from: the parent, checked
    parent = distillation.resolve(cfg, plan)  # routing=distilled: the router its tables come from, checked
    if plan.mode == "complete":
        if rank == 0:  # status.json, the log and so the report agree on what the run is
            log.info("%s", status.settle_complete(run.path, plan.start_step, plan.checkpoint.meta))
        return plan.final_eval_loss
    check_backends(cfg, device)  # loss backend and compile backend: before anything is written
    wall = walltime.estimate(cfg, spec, device, amp_dtype, cfg.trainer.steps - plan.start_step)
    walltime.check(cfg, wall)  # days of CPU work (a forgotten _smoke): refused before anything is written
    log.info("estimated wall time: %s", wall.line())
    trackers.check_installed(cfg.logger)  # a chosen tracker's package: before anything is written
    downstream = Downstream(cfg)  # lm-eval and its tasks (downstream.tasks): before anything is written
    data = build_data(cfg, spec.vocab_size, device=device, world_size=dist_env.world_size)
    try:
        plan.check_data(data, data.info, rank=rank, force=cfg.trainer.force_resume)
        if init is not None:
            init.load_data_cursor(data, rank)  # a branch reads on where its parent stopped
        fsdp = parallel.resolve_strategy(cfg.hardware.strategy, dist_env) == "fsdp"
        sizing.check_fits(cfg, spec, device, dist_env.world_size if fsdp else 1)  # weights, grads, optimizer
    except BaseException:
        data.close()
        raise

    # From here on the config and inputs are valid: write the run's records (rank 0; every rank has read
    # the run directory before it changes).
    distributed.barrier()
    if rank == 0:
        plan.prepare(store)
        records.write_hydra_files(run.path, raw_cfg)
        status.write_status(run.path, status.RUNNING)
        log_handler = records.attach_log_file(run.log, early)
    distributed.barrier()  # (prepare may replace logs/: the other ranks open their files after it)
    if rank != 0:
        log_handler = records.attach_rank_log(run.path, rank, early)
    try:
        with signals.StopSignals(within=cfg.trainer.stop_within, store=store) as stop:
            trainer = Trainer(cfg, raw_cfg, plan, store, data, dist_env, device, amp_dtype, spec, downstream)
            if init is not None:  # the parent's weights (a branch: its optimizer, step and RNG too)
                init.apply(trainer)
            if parent is not None:  # the counting pass, its tables into the model (a resume: checkpoint's)
                parent.apply(trainer, data)
            # run_config.json's init_from, distilled: the parents (a resume keeps the first attempt's record)
            start = init.record() if init else (plan.previous or {}).get("init_from")
            distilled = parent.record() if parent else distillation.keep(plan)
            facts = dataclasses.replace(trainer.facts(), init_from=start, distilled=distilled)
            run_record.announce(facts, cfg, raw_cfg)  # the opening log lines, run_config.json
            with trainer:  # opens metrics.csv, telemetry.csv, the trackers, the profiler
                final = loop(trainer, stop)
        if rank == 0:
            status.write_status(run.path, status.FINISHED, final_eval_loss=final)
        return final
    except signals.Preempted as e:  # a requested stop, checkpoint saved: the rerun resumes
        if rank == 0:
            status.write_status(run.path, signals.PREEMPTED, step=e.step, error=str(e))
        raise
    except BaseException as e:  # the run dir says why it stopped (a sweep report lists it as failed)
        if rank == 0:
            with contextlib.suppress(OSError):  # not even in place: the app's one line is the record
                status.write_status(run.path, status.FAILED, error=status.error_line(e))
        raise
    finally:
        data.close()
        logging.getLogger().removeHandler(log_handler)
        log_handler.close()
