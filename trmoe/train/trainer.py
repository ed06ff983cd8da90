"""The Trainer: one run's stateful components and what the loop does with them (trmoe.train.loop calls it).

Components (attributes, each owning its state):

    model, optimizer          saved by the CheckpointStore (model_optim.pt, or DCP files per rank)
    controls                  schedules, loss backend, penalty, compile (TrainingControls)
    telemetry                 expert telemetry and its open window (MoETelemetry; None when off)
    data                      the data pipeline and its cursor
    guard                     non-finite / spike guard (StepGuard)
    window                    the metrics window behind the next metrics.csv row (MetricsWindow)
    rng                       every random generator (RNG)
    state                     step, training time, last held-out loss (TrainState)
    evaluators                objects returning metrics columns at each evaluation (trmoe.train.evaluation)
    metrics, progress, store  metrics.csv, the console display, the checkpoints and their cadence

A checkpoint is the model and optimizer plus `state_dict()`: the dictionary of the other components' states
(one rank_XXXXX.pt per rank); `load_state_dict` gives each its part back, the RNG last. Extension points
are in docs/architecture.md.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import torch
from omegaconf import DictConfig

from trmoe.config.schema import Config, Progress, SpikePolicy
from trmoe.data.pipeline import DataPipeline, global_batch_samples, global_batch_tokens, micro_batch_samples
from trmoe.errors import RunFailed
from trmoe.model.transformer import TRMoETransformer
from trmoe.train import env, guards, parallel, records, signals
from trmoe.train.checkpoint import CheckpointError, CheckpointStore
from trmoe.train.controls import TrainingControls, is_log_step
from trmoe.train.distributed import DistEnv, all_reduce_sum, no_sync
from trmoe.train.evaluation import Evaluator, HeldOutLoss, ppl
from trmoe.train.launch import Launch
from trmoe.train.metrics import MetricsWindow, NullMetrics
from trmoe.train.optim import build_optimizer
from trmoe.train.progress import ProgressReporter
from trmoe.train.run_record import announce
from trmoe.train.rundir import RunDir
from trmoe.train.state import RNG, TrainState

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
        spec,
    ):
        t = self.t = cfg.trainer
        self.cfg, self.launch, self.store, self.data = cfg, launch, store, data
        self.run: RunDir = launch.run
        self.device, self.amp_dtype, self.dist = device, amp_dtype, dist_env
        env.configure(cfg.hardware, device)
        env.seed_everything(t.seed)
        self.model = model = TRMoETransformer(spec).to(device)  # same seed on every rank: same weights
        self.parallelism = parallel.resolve_strategy(cfg.hardware.strategy, dist_env)
        # FSDP shards in place, before the optimizer sees the parameters; the ones it leaves unsharded
        # (scalar gates) have their gradients averaged here
        self.replicated = parallel.shard_fsdp(model, amp_dtype) if self.parallelism == "fsdp" else []
        self.controls = TrainingControls(cfg, model, device)  # before the optimizer: scheduled gates
        self.telemetry = self.controls.telemetry  # expert telemetry (telemetry.moe; None when off)
        self.optimizer = build_optimizer(model, cfg.optimizer, device, seed=t.seed)
        # the training forward goes through DDP; evaluation, the loss head and checkpoints use the model
        self.ddp = parallel.wrap_ddp(model, device) if self.parallelism == "ddp" else None
        self.controls.set_train_module(self.ddp if self.ddp is not None else model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        world = dist_env.world_size
        self.state = TrainState(global_batch_tokens(t, world), global_batch_samples(t, world))
        self.window = MetricsWindow(device)  # running sums between rows stay on the device
        self.guard = guards.StepGuard(cfg.guard)
        self.rng = RNG()
        self.evaluators: list[Evaluator] = [HeldOutLoss(data, cfg, device, amp_dtype)]
        self.identity = launch.identity(raw_cfg, data.info)  # what every checkpoint's meta.json carries
        announce(self, raw_cfg)  # the opening log lines and run_config.json
        main = dist_env.rank == 0  # ranks > 0 compute the same rows (collectively) but write nothing
        self.metrics = (
            records.MetricsWriter(self.run.metrics, append=launch.mode == "resume", rows=launch.metrics_rows)
            if main
            else NullMetrics()
        )
        self.controls.attach(self.optimizer, self.run.telemetry if main else None)
        self.progress = ProgressReporter(
            cfg.run.progress if main else Progress.log, t.steps, start_step=launch.start_step
        )
        self._clock = time.perf_counter()
        self._grad_norm = torch.zeros((), device=device)

    @property
    def step(self) -> int:
        return self.state.step

    # ------------------------------------------------------------------------------------ components' state

    def state_dict(self) -> dict[str, Any]:
        """This rank's part of a checkpoint besides model and optimizer (collective: the window's and the
        telemetry's totals are sums over ranks)."""
        telemetry = self.telemetry
        return {
            "version": STATE_VERSION,
            **self.state.state_dict(),
            "data": self.data.state_dict(),
            "rng": self.rng.state_dict(),
            **self.window.state_dict(),  # "window" and "window_totals"
            "telemetry": telemetry.state_dict() if telemetry is not None else None,
            "guard": self.guard.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any], *, load_data: bool = True) -> None:
        if state.get("version") != STATE_VERSION:
            raise CheckpointError(
                f"train state version {state.get('version')}; this trmoe reads {STATE_VERSION}"
            )
        self.state.load_state_dict(state)
        if load_data and state.get("data") is not None:
            self.data.load_state_dict(state["data"])
        self.window.load_state_dict(state)
        self.guard.load_state_dict(state["guard"])
        telemetry = self.telemetry
        if telemetry is not None and state.get("telemetry") is not None:  # on then and now: its open window
            telemetry.load_state_dict(state["telemetry"], self.dist.rank)
        self.rng.load_state_dict(state["rng"])  # last: nothing after it may draw

    def _checkpoint(self) -> dict[str, Any]:
        """CheckpointStore.save's arguments for the current step."""
        meta = {
            "tokens": self.state.tokens,
            "eval_loss": self.state.eval_loss,
            "metrics": self.metrics.sync(),
            **self.identity,
        }
        return {
            "model": self.model,
            "optimizer": self.optimizer,
            "local_state": self.state_dict(),
            "meta": meta,
        }

    def _load(self, info, *, load_data: bool) -> None:
        state = self.store.load(info, model=self.model, optimizer=self.optimizer)
        self.load_state_dict(state, load_data=load_data)
        self._clock = time.perf_counter()

    # ------------------------------------------------------------------------------------------- the run

    def start(self) -> None:
        """Resume from the launch's checkpoint, or evaluate step 0 of a fresh run."""
        launch, rollback = self.launch, self.cfg.guard.spike_policy == SpikePolicy.rollback
        if launch.mode == "resume":
            self._load(launch.checkpoint, load_data=False)  # the data cursor: loaded by launch.check_data
            self.store.last_saved = launch.start_step
            log.info("resumed at step %d from %s", launch.start_step, launch.checkpoint.path)
            if rollback and launch.external:  # another run's checkpoint: something to roll back to here
                self.store.try_save(self.step, self._checkpoint)
        else:
            figures = self.evaluate()
            self.metrics.write({"step": 0, "tokens": 0, **figures, "elapsed_s": 0.0})
            log.info("step 0 | eval %.4f | eval_train %.4f", figures["eval_loss"], figures["eval_train_loss"])
            if rollback:
                self.store.try_save(0, self._checkpoint)  # to roll back to before the first periodic one
        self._clock = time.perf_counter()

    def train_step(self, step: int) -> guards.Verdict:
        """Forward, backward, clip and (per the guard's verdict) the optimizer step of `step`."""
        t, device, world = self.t, self.device, self.dist.world_size
        self.state.step = step
        self.controls.begin_step(step, self.optimizer)  # LR, p, gates, lambda: pure functions of the step
        micro_batches = [
            self.data.train.batch(first, count)
            for first, count in micro_batch_samples(step, self.dist.rank, world, t.micro_batch, t.grad_accum)
        ]
        step_tokens = sum(int(y.numel()) for _, y in micro_batches)
        sums_dtype = env.sum_dtype(device)
        step_ce = torch.zeros((), dtype=sums_dtype, device=device)
        step_obj = torch.zeros((), dtype=sums_dtype, device=device)
        # a batch that an earlier rollback dropped is read (stream cursors advance) but not learned from
        for a, (inputs, targets) in enumerate(micro_batches if step not in self.guard.dropped else []):
            inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            last = a == len(micro_batches) - 1
            with no_sync(self.ddp, sync=last) if self.ddp is not None else contextlib.nullcontext():
                objective, sums = self._objective(inputs, targets, step_tokens, len(micro_batches), last)
                objective.backward()
            step_ce += sums.ce.to(sums_dtype)
            step_obj += sums.total.detach().to(sums_dtype)
            del objective, sums  # the loss's stored dh / dW (4·V·H bytes) must not outlive the step
        parallel.average_gradients(self.replicated)
        self.controls.before_clip(is_log_step(step, self.cfg))
        max_norm = t.grad_clip if t.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm, foreach=True)
        self._grad_norm = grad_norm = parallel.full(grad_norm)  # FSDP: a DTensor norm, the same everywhere
        verdict = self._verdict(step, step_ce, step_obj, step_tokens, grad_norm)
        if verdict.action == guards.ROLLBACK:
            return verdict
        if verdict.action == guards.APPLY:
            self.optimizer.step()
            self.window.add(step_ce, step_obj, step_tokens)
        if verdict.reason:
            skipped = "; skipped" if verdict.action == guards.SKIP else ""
            log.warning("step %d: %s%s", step, verdict.reason, skipped)
        self.optimizer.zero_grad(set_to_none=True)
        self.progress.step()
        return verdict

    def _objective(self, inputs, targets, step_tokens: int, micro_batches: int, last: bool):
        """The objective of one micro-batch, and its loss sums. Normalised by the tokens of the whole
        accumulated batch: accumulation equals one larger batch (and every rank has as many tokens, so
        DDP's gradient mean is the global batch's). Loss terms join here: a learned router's auxiliary
        losses on every micro-batch, the penalty once per step, on the last one."""
        with env.autocast(self.device, self.amp_dtype):
            hidden = self.controls.forward(inputs)
        sums = self.controls.loss(hidden, targets)
        objective = self.controls.with_router_loss(sums.total / step_tokens, micro_batches)
        penalty = self.controls.penalty() if last else None
        return (objective if penalty is None else objective + penalty), sums

    def _verdict(self, step: int, ce, objective, tokens: int, grad_norm) -> guards.Verdict:
        guard = self.guard
        if step in guard.dropped:
            guard.drop(step)
            return guards.Verdict(guards.SKIP, "batch dropped by an earlier rollback")
        if not guard.active:
            return guards.Verdict(guards.APPLY)
        if self.dist.world_size > 1:  # every rank must reach the same verdict: on the global loss
            ce, objective = all_reduce_sum(ce, objective)
            tokens *= self.dist.world_size
        # the guard's host sync: one per step
        loss, obj, norm = torch.stack([ce / tokens, objective / tokens, grad_norm.to(ce.dtype)]).tolist()
        return guard.check(step, loss, obj, norm)

    def evaluate(self) -> dict[str, float]:
        """Every evaluator's columns; the held-out loss becomes the run's last eval_loss."""
        figures: dict[str, float] = {}
        for evaluator in self.evaluators:
            figures.update(evaluator.columns(self.model))
        self.state.eval_loss = figures["eval_loss"]
        return figures

    def _tick(self) -> float:
        """Count the time since the last tick as training time."""
        now = time.perf_counter()
        self.window.time += now - self._clock
        self.state.train_time += now - self._clock
        self._clock = now
        return now

    def maybe_log(self, step: int) -> None:
        """The metrics row of a log step (1, every log_every, each evaluation, the last, a halt), with the
        evaluation of an eval step; evaluation and logging are not training time."""
        t = self.t
        halt = self.guard.too_many_skips
        if not (is_log_step(step, self.cfg) or halt):
            self._tick()
            return
        train_ce, train_objective = self.window.means()  # the window's host sync (and all-reduce)
        self._tick()
        row = {
            "step": step,
            "tokens": self.state.tokens,
            "train_loss": train_ce,
            "train_ppl": ppl(train_ce),
            "train_objective": train_objective,
            "grad_norm": self._grad_norm.item(),
            "tok_s": self.window.tokens * self.dist.world_size / max(self.window.time, 1e-9),
            "elapsed_s": self.state.train_time,
            "skipped_steps": self.guard.skipped,
            "loss_spikes": self.guard.spikes,
        }
        row["shared_gate"], row["routed_gate"] = _gate_means(self.model)
        row.update(self.controls.log_columns(step))  # per-group LRs, p, lambda, telemetry
        if step == t.steps or (t.eval_every > 0 and step % t.eval_every == 0):
            row.update(self.evaluate())
        self.metrics.write(row)
        self.progress.report(row, t.steps, eta_s=(t.steps - step) * self.state.train_time / step)
        self.window.reset()
        self._clock = time.perf_counter()

    def maybe_save(self, step: int) -> None:
        """The store's cadence, plus the final step and a halt, whose checkpoint must be written."""
        final = step == self.t.steps or self.guard.too_many_skips
        saved = self.store.maybe_save(step, self._checkpoint, final=final)
        if saved is False and final:
            raise RunFailed(f"step {step}: the final checkpoint could not be written (see the log above)")
        if saved is not None:
            self._clock = time.perf_counter()

    def check_guard(self, step: int) -> None:
        """Stop the run after guard.max_skips consecutive non-finite steps (their checkpoint is saved)."""
        if self.guard.too_many_skips:
            raise RunFailed(
                f"stopped at step {step}: {self.guard.consecutive_skips} consecutive steps had a non-finite "
                f"loss or gradient (guard.max_skips={self.cfg.guard.max_skips}); the last good state is in "
                f"checkpoint step_{step:08d}"
            )

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
        self.controls.rewind(target.step)
        self.load_state_dict(state, load_data=True)
        guard.apply_carry(carry)
        self.metrics.rewind(target.step)
        self.store.last_saved = target.step
        log.warning(
            "step %d: %s; rolled back to %s: steps %d..%d are recomputed, batch %d is skipped",
            step,
            reason,
            target.path.name,
            target.step + 1,
            step - 1,
            step,
        )
        # the same state again, now with the skipped batch in its train state: a kill before the next
        # checkpoint resumes from it and skips that batch too, as the uninterrupted run does
        if not self.store.try_save(target.step, self._checkpoint):
            raise RunFailed(f"step {step}: the rollback to step {target.step} could not be recorded")

    def preempt(self, step: int, stop: signals.StopSignals, signum: int) -> None:
        """A stop signal every rank agreed on: checkpoint this step (unless it just was), close, raise."""
        if self.store.last_saved != step and not self.store.try_save(step, self._checkpoint):
            raise RunFailed(f"step {step}: stop signal, but the checkpoint could not be written")
        self.close()
        preempted = signals.Preempted(signum, step, stop.previous(signum))
        log.warning("%s (the requeued job resumes from it)", preempted)  # in train.log: why it ended
        raise preempted

    def finish(self) -> float:
        self.close()
        log.info(
            "done: final eval loss %.4f (ppl %.2f), %s tokens in %.1f s",
            self.state.eval_loss,
            ppl(self.state.eval_loss),
            f"{self.t.steps * self.state.tokens_per_step:,}",
            self.state.train_time,
        )
        return self.state.eval_loss

    def close(self) -> None:
        """Close the run's files and the display (idempotent: the job closes again however the run ends)."""
        self.progress.close()
        self.metrics.close()
        self.controls.close()


def _gate_means(model: TRMoETransformer) -> tuple[float | None, float | None]:
    shared = [b.ffn.shared_gate for b in model.blocks if b.ffn.shared_gate is not None]
    routed = [b.ffn.routed_gate for b in model.blocks if b.ffn.routed_gate is not None]

    def mean(gates):
        return torch.stack([g.detach() for g in gates]).mean().item() if gates else None

    return mean(shared), mean(routed)
