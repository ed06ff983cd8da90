"""The Trainer: one run's stateful components and what the loop does with them (trmoe.train.loop calls it).

Components (attributes, each owning its state and, where it has one, its cadence):

    model, optimizer          saved by the CheckpointStore (model_optim.pt, or DCP files per rank)
    scheduler                 the per-step schedules applied: LR, p, gates, lambda (Scheduler)
    objective                 forward, loss backend, router losses, diversity penalty (Objective)
    telemetry                 expert telemetry, an observer with its open window (TelemetryObserver; None off)
    data                      the data pipeline and its cursor
    guard                     non-finite / spike guard (StepGuard)
    window                    the metrics window behind the next metrics.csv row (MetricsWindow)
    training                  a row's first columns: step, tokens, losses, tok/s (TrainingColumns)
    rng                       every random generator (RNG)
    state                     step, training time, last held-out loss (TrainState)
    evaluators                held-out loss, downstream tasks: columns on their own cadence (evaluation.py)
    output                    where rows go: metrics.csv, telemetry.csv, trackers, the display (RunOutput)
    store                     the checkpoints and their cadence (CheckpointStore)
    efficiency                the mfu and peak_mem_gib columns (meters.EfficiencyMeter)
    profiler                  torch.profiler over a few steps (debug=profile)

`producers` give a metrics row its columns (trmoe.run.columns: each declares them, metrics.csv's header and
the trackers' names come from the declarations, and returns their values at a log step).

Building a Trainer writes nothing; entering it (a context manager) opens the run's files, the trackers and
the profiler, and leaving it closes them (the trackers told the run's outcome), however the run ends.

A checkpoint is the model and optimizer plus `state_dict()`: the registry of the other components' states
(`components`, one rank_XXXXX.pt per rank). Extension points are in docs/architecture.md.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from trmoe.config.derived import global_batch_samples, global_batch_tokens
from trmoe.config.schema import Config, SpikePolicy
from trmoe.data.pipeline import DataPipeline, micro_batch_samples
from trmoe.errors import RunFailed
from trmoe.model.flops import flops_per_token
from trmoe.model.spec import ModelSpec
from trmoe.model.transformer import TRMoETransformer, count_parameters
from trmoe.optim.build import build_optimizer
from trmoe.optim.schedule import build_schedules
from trmoe.run import columns, signals
from trmoe.run.checkpoint import CheckpointStore
from trmoe.run.launch import Launch
from trmoe.run.profiling import StepProfiler
from trmoe.run.rundir import TELEMETRY, RunDir
from trmoe.runtime import env, parallel, peak
from trmoe.runtime.distributed import DistEnv, no_sync
from trmoe.train import guards
from trmoe.train.objective import Objective
from trmoe.train.observe import meters
from trmoe.train.observe.downstream import Downstream
from trmoe.train.observe.evaluation import Evaluator, HeldOutLoss
from trmoe.train.observe.metrics import MetricsWindow, TrainingColumns, ppl
from trmoe.train.observe.output import RunOutput, log_cadence
from trmoe.train.observe.telemetry import TelemetryObserver
from trmoe.train.prepare import compiled, prepare_model
from trmoe.train.run_record import RunFacts
from trmoe.train.scheduler import Scheduler
from trmoe.train.state import RNG, Components, TrainState

log = logging.getLogger("trmoe")

STATE_VERSION = 1  # of a checkpoint's rank-local state (rank_XXXXX.pt)


class Trainer:
    def __init__(
        self,
        cfg: Config,
        raw_cfg: DictConfig,
        launch: Launch,
        store: CheckpointStore,
        data: DataPipeline,
        dist_env: DistEnv,
        device: torch.device,
        amp_dtype: torch.dtype | None,
        spec: ModelSpec,
        downstream: Downstream,
    ):
        t = self.t = cfg.trainer
        self.cfg, self.raw_cfg, self.launch, self.store, self.data = cfg, raw_cfg, launch, store, data
        self.run: RunDir = launch.run
        self.device, self.amp_dtype, self.dist = device, amp_dtype, dist_env
        env.configure(cfg.hardware, device)
        env.seed_everything(t.seed)
        self.model = model = TRMoETransformer(spec).to(device)  # same seed on every rank: same weights
        self.parallelism = parallel.resolve_strategy(cfg.hardware.strategy, dist_env)
        # FSDP shards in place, before the optimizer sees the parameters; the ones it leaves unsharded
        # (scalar gates) have their gradients averaged here
        self.replicated = parallel.shard_fsdp(model, amp_dtype) if self.parallelism == "fsdp" else []
        schedules = build_schedules(cfg)
        prepare_model(model, t, device, schedules)  # before the optimizer: scheduled gates are not learned
        self.log_cadence = log_cadence(t)  # the metrics rows (and whenever an evaluator is due)
        self.telemetry = (
            TelemetryObserver(model, device, self.log_cadence, dist_env.rank) if cfg.telemetry.moe else None
        )
        self.objective = Objective(cfg, model, device, amp_dtype, self.telemetry)
        self.optimizer = build_optimizer(model, cfg.optimizer, device, seed=t.seed)
        # the training forward goes through DDP; evaluation, the loss head and checkpoints use the model
        self.ddp = parallel.wrap_ddp(model, device) if self.parallelism == "ddp" else None
        self.objective.train_model = compiled(self.ddp if self.ddp is not None else model, t)
        self.scheduler = Scheduler(schedules, model, self.optimizer, cfg.routing.bias_update)
        downstream.attach(model, device, amp_dtype)  # the plain module, not the DDP or compiled wrapper
        self.params = [p for p in model.parameters() if p.requires_grad]
        world = dist_env.world_size
        self.state = TrainState(global_batch_tokens(t, world), global_batch_samples(t, world))
        self.window = MetricsWindow(device)  # running sums between rows stay on the device
        self.guard = guards.StepGuard(cfg.guard)
        self.rng = RNG()
        self.components = Components(STATE_VERSION)  # a checkpoint's rank-local state, in this order
        self.components.register("state", self.state, flat=True)  # step, tokens, next_sample, ...
        self.components.register("data", data)
        self.components.register("rng", self.rng, last=True)  # loaded last: nothing after it may draw
        self.components.register("window", self.window, flat=True)  # window, window_totals
        self.components.register("telemetry", self.telemetry)  # its open window, summed over ranks
        self.components.register("guard", self.guard)
        self.evaluators: list[Evaluator] = [HeldOutLoss(model, data, cfg, device, amp_dtype), downstream]
        self.param_counts = count_parameters(model)
        previous = (self.launch.previous or {}).get("mfu_peak")  # an earlier attempt's measured peak
        self._peak = peak.peak_flops(device, self.amp_dtype, cfg.hardware.peak_tflops, previous)
        flops = flops_per_token(model.spec, self.param_counts, t.seq_len)
        self.efficiency = meters.EfficiencyMeter(device, flops, *self._peak, world_size=world)
        self.training = TrainingColumns(self.window, self.state, world)
        self.training.grad_norm = torch.zeros((), device=device)
        # a metrics row's columns, in the order they are computed (evaluation last: its time is not training
        # time, and peak memory is read before it); metrics.csv orders them by their declarations
        self.producers: list[columns.MetricProducer] = [
            self.training,
            self.scheduler,  # per-group LRs, gates, p, lambda
            self.objective,  # the penalty, the router's losses
            self.telemetry or columns.Declared(TelemetryObserver.COLUMNS),  # nan when telemetry is off
            self.efficiency,  # MFU, peak memory
            self.guard,  # skipped steps, loss spikes
            *self.evaluators,  # held-out losses, downstream accuracies: on their own cadence
        ]
        self.declared = columns.declared(self.producers)
        self.columns = columns.header(self.declared)  # metrics.csv's header
        self.identity = launch.identity(raw_cfg, data.info)  # what every checkpoint's meta.json carries
        self._cleanup = contextlib.ExitStack()  # output, profiler, anomaly mode: closed by close()
        self._outcome: BaseException | None = None  # how the run ended, for the trackers
        self._clock = time.perf_counter()

    def facts(self) -> RunFacts:
        """What run_record.announce says and records about this run."""
        return RunFacts(
            launch=self.launch,
            spec=self.model.spec,
            params=self.param_counts,
            dist=self.dist,
            strategy=self.parallelism,
            device=self.device,
            amp_dtype=self.amp_dtype,
            tokens_per_step=self.state.tokens_per_step,
            checkpoints=self.store.enabled,
            data=self.data.info,
            metrics_columns=self.declared,
            mfu_peak=peak.peak_record(self.device, *self._peak),
            controls={
                "loss_backend": self.objective.loss_backend.value,
                **self.scheduler.record(),  # optimizer groups, schedules
                "compile": {"enabled": self.t.compile, "backend": self.t.compile_backend},
                "telemetry_file": TELEMETRY if self.telemetry is not None else None,
            },
        )

    def __enter__(self) -> Trainer:
        """Open the run's output (metrics.csv, telemetry.csv, the trackers, the display), the MFU meter, the
        profiler and anomaly mode."""
        cfg = self.cfg
        try:
            self.output = RunOutput(
                cfg,
                self.launch,
                rank=self.dist.rank,
                columns=self.declared,
                config_hash=self.identity["config_hash"],
                config=OmegaConf.to_container(self.raw_cfg, resolve=True),
                telemetry_experts=None if self.telemetry is None else self.telemetry.num_experts,
            )
            self._cleanup.callback(lambda: self.output.close(self._outcome))
            self.efficiency.announce()
            self.profiler = self._cleanup.enter_context(StepProfiler(cfg.debug, self.run.path, self.device))
            if cfg.debug.anomaly:
                self._cleanup.enter_context(torch.autograd.set_detect_anomaly(True))
        except BaseException as e:  # close what was opened before a component failed
            self._outcome = e
            self._cleanup.close()
            raise
        self._clock = time.perf_counter()
        return self

    @property
    def step(self) -> int:
        return self.state.step

    # ------------------------------------------------------------------------------------ components' state

    def state_dict(self) -> dict[str, Any]:
        """This rank's part of a checkpoint besides model and optimizer: the registered components' states
        (collective: the window's and the telemetry's totals are sums over ranks)."""
        return self.components.state_dict()

    def load_state_dict(self, state: dict[str, Any], *, load_data: bool = True) -> None:
        self.components.load_state_dict(state, skip=() if load_data else ("data",))

    def _checkpoint(self) -> dict[str, Any]:
        """CheckpointStore.save's arguments for the current step."""
        state, metrics = self.state, self.output.metrics.sync()
        meta = {"tokens": state.tokens, "eval_loss": state.eval_loss, "metrics": metrics, **self.identity}
        meta["halted"] = self.guard.too_many_skips  # a guard's stop: a relaunch must not call it finished
        return dict(model=self.model, optimizer=self.optimizer, local_state=self.state_dict(), meta=meta)

    # ------------------------------------------------------------------------------------------- the run

    def start(self) -> None:
        """Resume from the launch's checkpoint, or evaluate a fresh run's first step (0; a branch
        started by trainer.init_from: its parent's, loaded by the job)."""
        launch, rollback = self.launch, self.cfg.guard.spike_policy == SpikePolicy.rollback
        if launch.mode == "resume":
            state = self.store.load(launch.checkpoint, model=self.model, optimizer=self.optimizer)
            self.load_state_dict(state, load_data=False)  # the data cursor: loaded by launch.check_data
            self.store.last_saved = launch.start_step
            log.info("resumed at step %d from %s", launch.start_step, launch.checkpoint.path)
            if rollback and launch.external:  # another run's checkpoint: something to roll back to here
                self.store.try_save(self.step, self._checkpoint)
        else:
            step, state = self.state.step, self.state
            ev = self._row(step, self.evaluators)  # step 0's held-out figures
            self.output.write({"step": step, "tokens": state.tokens, **ev, "elapsed_s": state.train_time})
            log.info("step %d | eval %.4f | eval_train %.4f", step, ev["eval_loss"], ev["eval_train_loss"])
            if rollback:
                self.store.try_save(step, self._checkpoint)  # to roll back to before the first periodic one
        self._clock = time.perf_counter()

    def train_step(self, step: int, stop: signals.StopSignals) -> guards.Verdict:
        """Forward, backward, clip and (per the guard's verdict) the optimizer step of `step`."""
        t, device, world = self.t, self.device, self.dist.world_size
        self.state.step = step
        values = self.scheduler.begin_step(step)  # LR, p, gates, lambda: pure functions of the step
        self.objective.begin_step(values["diversity"])
        batch_step = 1 if self.cfg.debug.overfit else step  # debug.overfit: the first batch at every step
        micro_batches = [
            self.data.train.batch(first, count)
            for first, count in micro_batch_samples(
                batch_step, self.dist.rank, world, t.micro_batch, t.grad_accum
            )
        ]
        step_tokens = sum(int(y.numel()) for _, y in micro_batches)
        sums_dtype = env.sum_dtype(device)
        step_ce = torch.zeros((), dtype=sums_dtype, device=device)
        step_obj = torch.zeros((), dtype=sums_dtype, device=device)
        # a batch that an earlier rollback dropped is read (stream cursors advance) but not learned from
        for a, (inputs, targets) in enumerate(micro_batches if step not in self.guard.dropped else []):
            inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            last = stop.next_micro_batch(step, a, len(micro_batches))  # (a stop too late for it: Preempted)
            with no_sync(self.ddp, sync=last) if self.ddp is not None else contextlib.nullcontext():
                objective, sums = self.objective(inputs, targets, step_tokens, len(micro_batches), last)
                objective.backward()
            step_ce += sums.ce.to(sums_dtype)
            step_obj += sums.total.detach().to(sums_dtype)
            del objective, sums  # the loss's stored dh / dW (4·V·H bytes) must not outlive the step
        parallel.average_gradients(self.replicated)
        if self.telemetry is not None:
            self.telemetry.before_clip(step)  # the gradient norms of a logged step
        max_norm = t.grad_clip if t.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm, foreach=True)
        self.training.grad_norm = grad_norm = parallel.full(grad_norm)  # FSDP: a DTensor, the same everywhere
        verdict = self.guard.verdict(step, step_ce, step_obj, step_tokens, grad_norm, world)
        if verdict.action == guards.ROLLBACK:
            return verdict
        if verdict.action == guards.APPLY:
            self.optimizer.step()
            self.scheduler.end_step()  # learned_v3's bias, from this step's loads
            self.window.add(step_ce, step_obj, step_tokens)
        if verdict.reason:
            skipped = "; skipped" if verdict.action == guards.SKIP else ""
            log.warning("step %d: %s%s", step, verdict.reason, skipped)
        self.optimizer.zero_grad(set_to_none=True)
        self.output.progress.step()
        self.profiler.step()
        return verdict

    def _row(self, step: int, producers) -> dict[str, Any]:
        """The columns of `producers` at `step`, merged in order (a held-out loss: the run's eval_loss)."""
        row: dict[str, Any] = {}
        for producer in producers:
            row.update(producer.row(step, row))
        if row.get("eval_loss") is not None:
            self.state.eval_loss = row["eval_loss"]
        return row

    def _tick(self) -> None:
        """Count the time since the last tick as training time."""
        now = time.perf_counter()
        self.window.time += now - self._clock
        self.state.train_time += now - self._clock
        self._clock = now

    def maybe_log(self, step: int) -> None:
        """The metrics row of a log step (its cadence, a halt, and every step an evaluator is due at), with
        those evaluations and telemetry's rows; evaluation and logging are not training time."""
        halt = self.guard.too_many_skips
        if not (self.log_cadence.due(step) or halt or any(e.due(step) for e in self.evaluators)):
            self._tick()
            return
        self.training.sync()  # the window's host sync (and all-reduce)
        self._tick()
        row = self._row(step, self.producers)
        layers = self.telemetry.layers if self.telemetry is not None else None
        eta_s = (self.t.steps - step) * self.state.train_time / step
        self.output.write(row, layers=layers, eta_s=eta_s)  # telemetry.csv's rows too
        self.window.reset()
        self._clock = time.perf_counter()

    def maybe_save(self, step: int) -> None:
        """The store's cadence (the last step included), plus a halt; those two must be written."""
        halt = self.guard.too_many_skips
        saved = self.store.maybe_save(step, self._checkpoint, final=halt)
        if saved is False and (halt or step == self.t.steps):
            raise RunFailed(
                f"step {step}: the final checkpoint could not be written: {self.store.last_failure}"
            )
        if saved is not None:
            self._clock = time.perf_counter()

    def check_guard(self, step: int) -> None:
        """Stop the run after guard.max_skips consecutive non-finite steps (their checkpoint is saved)."""
        if self.guard.too_many_skips:
            raise RunFailed(self.guard.halt_reason(step, saved=self.store.enabled))

    def rollback(self, step: int, reason: str) -> None:
        """Back to the newest good checkpoint; the replay skips batch `step`."""
        target, guard, limit = self.store.newest_good(), self.guard, self.cfg.guard.max_rollbacks
        if guard.rollbacks >= limit or target is None:
            why = (
                "no checkpoint to roll back to" if target is None else f"guard.max_rollbacks={limit} reached"
            )
            where = target.path if target else "lost"
            raise RunFailed(f"step {step}: {reason}; {why}; the last good state is {where}")
        carry = guard.rollback_carry(step)
        state = self.store.load(target, model=self.model, optimizer=self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        if self.telemetry is not None:
            self.telemetry.rewind()  # an empty window, should the checkpoint hold none
        self.load_state_dict(state, load_data=True)
        guard.apply_carry(carry)
        self.output.rewind(target.step)
        self.store.last_saved = target.step
        recomputed = guards.rollback_note(target.step, step)
        log.warning("step %d: %s; rolled back to %s: %s", step, reason, target.path.name, recomputed)
        # the same state again, now with the skipped batch in its train state: a kill before the next
        # checkpoint resumes from it and skips that batch too, as the uninterrupted run does
        if not self.store.try_save(target.step, self._checkpoint):
            raise RunFailed(f"step {step}: the rollback to step {target.step} could not be recorded")

    def preempt(self, step: int, stop: signals.StopSignals, signum: int) -> None:
        """A stop signal every rank agreed on: checkpoint this step (unless it just was, or checkpoints are
        off), close the run's files, raise Preempted."""
        store = self.store
        due = store.due(step, final=True) and store.last_saved != step
        if due and not store.try_save(step, self._checkpoint):
            raise RunFailed(
                f"step {step}: stop signal, but the checkpoint could not be written: {store.last_failure}"
            )
        self._close_files()
        preempted = signals.Preempted(signum, step, stop.previous(signum), saved=store.enabled)
        resumes = " (the requeued job resumes from it)" if store.enabled else ""
        log.warning("%s%s", preempted, resumes)  # in train.log: why it ended
        raise preempted

    def finish(self) -> float:
        self._close_files()
        s = self.state
        done = f"{s.eval_loss:.4f} (ppl {ppl(s.eval_loss):.2f}), {self.t.steps * s.tokens_per_step:,} tokens"
        log.info("done: final eval loss %s in %.1f s", done, s.train_time)
        return s.eval_loss

    def _close_files(self) -> None:
        self.output.close_files()
        if self.telemetry is not None:
            self.telemetry.close()

    def close(self, outcome: BaseException | None = None) -> None:
        """Close the run's files and display, then the trackers (told `outcome`: finished, preempted or
        failed) and the profiler. Idempotent: the job closes again however the run ends."""
        self._outcome = outcome
        self._close_files()
        self._cleanup.close()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(exc)
