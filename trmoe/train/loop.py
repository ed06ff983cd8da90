"""The thin train loop: wire config -> data, model, loss, optimizer, schedule, records; then step."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from trmoe.config.match import solve_match
from trmoe.config.resolve import model_spec, to_config
from trmoe.config.schema import Config, LoggerConfig, Progress, SpikePolicy
from trmoe.data.evalsets import scored_tokens
from trmoe.data.pipeline import (
    Batch,
    build_data,
    global_batch_samples,
    global_batch_tokens,
    micro_batch_samples,
)
from trmoe.errors import RunFailed, UserError
from trmoe.model.flops import flops_per_token
from trmoe.model.transformer import TRMoETransformer, count_parameters
from trmoe.train import (
    distributed,
    env,
    guards,
    meters,
    parallel,
    records,
    resume,
    runlock,
    signals,
    sizing,
    status,
    storage,
    trackers,
)
from trmoe.train.checkpoint import CheckpointStore, checkpoint_dir, read_pointer
from trmoe.train.controls import TrainingControls, check_controls, is_log_step
from trmoe.train.downstream import Downstream
from trmoe.train.loss import chunked_tied_ce
from trmoe.train.optim import build_optimizer
from trmoe.train.profiling import StepProfiler
from trmoe.train.progress import ProgressReporter

log = logging.getLogger("trmoe")


def _ppl(loss: float) -> float:
    return math.exp(min(loss, 50.0))


def _gate_means(model: TRMoETransformer) -> tuple[float | None, float | None]:
    shared = [b.ffn.shared_gate for b in model.blocks if b.ffn.shared_gate is not None]
    routed = [b.ffn.routed_gate for b in model.blocks if b.ffn.routed_gate is not None]

    def mean(gates):
        return torch.stack([g.detach() for g in gates]).mean().item() if gates else None

    return mean(shared), mean(routed)


@torch.no_grad()
def evaluate(model: TRMoETransformer, batches: list[Batch], cfg: Config, device, amp_dtype) -> float:
    """Mean pure cross-entropy over the fixed held-out batches (always the exact chunked path)."""
    model.eval()
    ce = torch.zeros((), dtype=env.sum_dtype(device), device=device)
    tokens = torch.zeros((), dtype=torch.int64, device=device)
    for inputs, targets in batches:
        inputs, targets = inputs.to(device), targets.to(device)
        with env.autocast(device, amp_dtype):
            hidden = model(inputs)
        sums = chunked_tied_ce(hidden, model.head_weight, targets, chunk_tokens=cfg.loss.chunk_tokens)
        ce += sums.ce.to(ce.dtype)
        tokens += sums.tokens
    model.train()
    return (ce / tokens).item()


def _eval_figures(model: TRMoETransformer, data, cfg: Config, device, amp_dtype) -> dict:
    """The evaluation columns of metrics.csv: held-out loss (and ppl, bits per byte) and the loss on a fixed
    stream of the training split; run_config.json["data"]["metric_streams"] names each stream. A mixture
    adds each source's held-out loss and bpb (`data.metric_columns`); its held-out set is theirs together,
    so the overall loss is their token-weighted mean (each batch is scored once)."""
    per_source = {}
    for name, part in data.sources.items():
        loss = evaluate(model, part.eval_set, cfg, device, amp_dtype)
        per_source[f"eval_loss/{name}"], per_source[f"eval_bpb/{name}"] = loss, part.bpb(loss)
    if data.sources:
        tokens = {name: scored_tokens(part.eval_set) for name, part in data.sources.items()}
        eval_loss = sum(per_source[f"eval_loss/{n}"] * k for n, k in tokens.items()) / sum(tokens.values())
    else:
        eval_loss = evaluate(model, data.eval_set, cfg, device, amp_dtype)
    eval_train_loss = evaluate(model, data.eval_train_set, cfg, device, amp_dtype)
    return {
        "eval_train_loss": eval_train_loss,
        "eval_loss": eval_loss,
        "eval_ppl": _ppl(eval_loss),
        "eval_bpb": data.bpb(eval_loss),
        **per_source,
    }


def _run_identity(run_dir: Path, plan, raw_cfg: DictConfig, data_info: dict) -> dict:
    """What names this run in a tracker: its name and directory, trmoe's version, the config hash."""
    import trmoe

    return {
        "run_name": run_dir.name,
        "run_dir": str(run_dir.resolve()),
        "trmoe_version": trmoe.__version__,
        "config_hash": plan.identity(raw_cfg, data_info)["config_hash"],
    }


def checkpoint_store(cfg: Config, run_dir: Path, rank: int = 0, world_size: int = 1) -> CheckpointStore:
    fmt = cfg.checkpoint.format.value
    if fmt == "auto":
        fmt = "dcp" if world_size > 1 else "torch"
    if fmt == "torch" and world_size > 1:
        raise UserError("config error: checkpoint.format=torch: distributed runs use dcp; allowed: auto, dcp")
    return CheckpointStore(
        checkpoint_dir(run_dir),
        keep_last=cfg.checkpoint.keep_last,
        format=fmt,
        rank=rank,
        world_size=world_size,
        every_steps=cfg.checkpoint.every_steps,
        enabled=cfg.checkpoint.enabled,
    )


def train(raw_cfg: DictConfig, run_dir: Path) -> float:
    """Run one training job into run_dir, or continue the run it holds (trainer.resume, docs/reliability.md);
    returns the final held-out loss. Raises UserError on bad input, or on a run directory it must not
    overwrite or continue, before anything is written."""
    early = records.EarlyLog()  # what is logged before train.log may be written goes into it first
    logging.getLogger().addHandler(early)
    try:
        with runlock.hold(run_dir, rank=distributed.detect().rank):  # one live launch per run directory
            return _job(raw_cfg, run_dir, early)
    except OSError as e:  # the run directory cannot be written (full disk, read-only): one line, exit 3
        if not storage.is_storage_error(e, run_dir):
            raise
        raise storage.failure(e, run_dir, read_pointer(checkpoint_dir(run_dir))) from None
    finally:
        logging.getLogger().removeHandler(early)


def _job(raw_cfg: DictConfig, run_dir: Path, early: records.EarlyLog) -> float:
    cfg = to_config(raw_cfg)
    device = env.select_device(cfg.hardware)
    amp_dtype = env.autocast_dtype(cfg.hardware, device)
    spec = model_spec(cfg)
    dist_env, device = distributed.init(device)  # torchrun / submitit ranks; shut down by the app
    world_size, rank = dist_env.world_size, dist_env.rank
    store = checkpoint_store(cfg, run_dir, rank, world_size)
    derived = resume.derived_values(cfg, world_size, amp_dtype)
    view = resume.training_view(resume.config_container(raw_cfg), derived, None)
    plan = resume.plan_run(cfg, view, run_dir, store)  # reads only
    if plan.mode == "complete":
        log.info(
            "%s is complete at step %d (trainer.steps=%d): nothing to do",
            run_dir,
            plan.start_step,
            cfg.trainer.steps,
        )
        recorded = status.read_status(run_dir)
        said = recorded.get("status") if isinstance(recorded, dict) else None
        if rank == 0 and said in (None, status.RUNNING):
            # killed after its final checkpoint, before it could say so (a failure it recorded stays: a guard
            # that stopped the last step also saved it)
            status.write_status(run_dir, status.FINISHED, final_eval_loss=plan.final_eval_loss)
        return plan.final_eval_loss
    check_controls(cfg, device)  # loss backend and compile backend: before anything is written
    trackers.check_installed(cfg.logger)  # a chosen tracker's package: before anything is written
    downstream = Downstream(cfg)  # lm-eval and its tasks (downstream.tasks): before anything is written
    data = build_data(cfg, spec.vocab_size, device=device, world_size=world_size)
    try:
        plan.check_data(data, data.info, rank=rank, force=cfg.trainer.force_resume)
    except BaseException:
        data.close()
        raise

    fsdp = parallel.resolve_strategy(cfg.hardware.strategy, dist_env) == "fsdp"
    try:
        sizing.check_fits(cfg, spec, device, world_size if fsdp else 1)  # before anything is written
    except BaseException:
        data.close()
        raise

    # From here on the config and inputs are valid: write the run's records (rank 0; every rank has read
    # the run directory before it changes).
    distributed.barrier()
    if rank == 0:
        plan.prepare(store)
        records.write_hydra_files(run_dir, raw_cfg)
        status.write_status(run_dir, status.RUNNING)
        log_handler = records.attach_log_file(run_dir / "train.log", early)
    distributed.barrier()  # (prepare may replace logs/: the other ranks open their files after it)
    if rank != 0:
        log_handler = distributed.attach_rank_log(run_dir, rank, early)
    try:
        with signals.StopSignals() as stop, contextlib.ExitStack() as cleanup:
            final = _train(
                cfg, raw_cfg, run_dir, device, amp_dtype, spec, data, plan, store, stop, cleanup, downstream
            )
        if rank == 0:
            status.write_status(run_dir, status.FINISHED, final_eval_loss=final)
        return final
    except signals.Preempted as e:  # a requested stop, checkpoint saved: the rerun resumes
        if rank == 0:
            status.write_status(run_dir, signals.PREEMPTED, step=e.step, error=str(e))
        raise
    except BaseException as e:  # the run dir says why it stopped (a sweep report lists it as failed)
        if rank == 0:
            with contextlib.suppress(OSError):  # not even in place: the app's one line is the record
                status.write_status(run_dir, status.FAILED, error=status.error_line(e))
        raise
    finally:
        data.close()
        logging.getLogger().removeHandler(log_handler)
        log_handler.close()


def _guard_verdict(guard, step: int, ce, objective, tokens: int, grad_norm) -> guards.Verdict:
    if step in guard.dropped:
        guard.drop(step)
        return guards.Verdict(guards.SKIP, "batch dropped by an earlier rollback")
    if not guard.active:
        return guards.Verdict(guards.APPLY)
    # the guard's host sync: one per step
    loss, obj, norm = torch.stack([ce / tokens, objective / tokens, grad_norm.to(ce.dtype)]).tolist()
    return guard.check(step, loss, obj, norm)


def _train(
    cfg: Config,
    raw_cfg: DictConfig,
    run_dir: Path,
    device,
    amp_dtype,
    spec,
    data,
    plan,
    store,
    stop,
    cleanup,
    downstream: Downstream,
) -> float:
    """The run itself; `cleanup` closes what must be closed however it ends (the progress display)."""
    t = cfg.trainer
    env.configure(cfg.hardware, device)
    env.seed_everything(t.seed)
    model = TRMoETransformer(spec).to(device)  # same seed on every rank: identical initial weights
    params = count_parameters(model)
    dist_env = distributed.detect()
    world_size, rank = dist_env.world_size, dist_env.rank
    strategy = parallel.resolve_strategy(cfg.hardware.strategy, dist_env)
    replicated = []  # FSDP: parameters it leaves unsharded (scalar gates); their gradients are averaged here
    if strategy == "fsdp":  # in place, before the optimizer sees the (now sharded) parameters
        replicated = parallel.shard_fsdp(model, amp_dtype)
    controls = TrainingControls(cfg, model, device)  # before the optimizer: scheduled gates are not learned
    optimizer = build_optimizer(model, cfg.optimizer, device, seed=t.seed)
    if strategy == "ddp":  # the training forward goes through DDP; eval, loss head and checkpoints use model
        ddp = parallel.wrap_ddp(model, device)
        controls.train_model = torch.compile(ddp, backend=t.compile_backend) if t.compile else ddp
    else:
        ddp = None
    downstream.attach(model, device, amp_dtype)

    samples_per_step = global_batch_samples(t, world_size)
    tokens_per_step = global_batch_tokens(t, world_size)
    log.info("run directory: %s", run_dir)
    if world_size > 1:
        log.info("%d ranks (%s), strategy %s", world_size, dist_env.source, strategy)
    if plan.mode != "fresh":
        source = plan.checkpoint.path if plan.checkpoint else "no checkpoint"
        log.info("=== %s from step %d (%s) ===", plan.mode, plan.start_step, source)
    log.info(
        "model %s: %s parameters (%s active per token, %s embedding), %d layers, attention %s %d/%d, "
        "FFN shared %d + routed %d x %d (top-%d, %s)",
        cfg.model.name,
        f"{params.total:,}",
        f"{params.active:,}",
        f"{params.embedding:,}",
        spec.num_layers,
        cfg.attention.kind.value,
        spec.num_heads,
        spec.num_kv_heads,
        spec.shared_width,
        spec.num_experts,
        spec.expert_width,
        spec.top_k,
        spec.strategy,
    )
    log.info(
        "tokens per step %s, steps %d, total %s tokens",
        f"{tokens_per_step:,}",
        t.steps,
        f"{tokens_per_step * t.steps:,}",
    )
    if not store.enabled:
        log.warning(
            "checkpoint.enabled=false: no checkpoint is written; this run cannot be resumed (a rerun "
            "starts again at step 0)"
        )
    match = solve_match(cfg)
    if match is not None:
        log.info("parameter match: %s", match.describe())
    if rank == 0:
        git, backend = env.git_commit(), env.backend_metadata(device, amp_dtype)
        records.write_run_config(
            run_dir,
            {
                "run_name": run_dir.name,
                "run_dir": str(run_dir.resolve()),
                "config": OmegaConf.to_container(raw_cfg, resolve=True),
                "model_spec": spec.to_dict(),
                "params": params.to_dict(),
                "git": git,
                "world_size": world_size,
                "strategy": strategy,  # none | ddp | fsdp (hardware.strategy resolved)
                "backend": backend,
                "tokens_per_step": tokens_per_step,
                "total_tokens": tokens_per_step * t.steps,
                "data": data.info,
                "metrics_columns": [*records.METRIC_COLUMNS, *data.metric_columns, *downstream.names],
                "controls": controls.record(optimizer),  # loss backend, optimizer groups, schedules, compile
                "param_match": None if match is None else match.to_dict(),  # model.match_params: solved width
                # config hash, derived values, the attempts of this run (force_resume noted, each one's code)
                **plan.record(git, backend),
            },
        )
    if rank == 0:
        metrics = records.MetricsWriter(
            run_dir / "metrics.csv",
            append=plan.mode == "resume",
            rows=plan.metrics_rows,
            columns=(*records.METRIC_COLUMNS, *data.metric_columns, *downstream.names),
        )
    else:  # ranks > 0 compute the same rows (the reductions are collective) but write nothing
        metrics = distributed.NullMetrics()
    controls.attach(optimizer, run_dir, write_files=rank == 0)
    progress = cleanup.enter_context(
        ProgressReporter(cfg.run.progress if rank == 0 else Progress.log, t.steps, start_step=plan.start_step)
    )
    tracked = cleanup.enter_context(
        trackers.Trackers(
            cfg.logger if rank == 0 else LoggerConfig(),
            run_dir,
            identity=_run_identity(run_dir, plan, raw_cfg, data.info),
            config=OmegaConf.to_container(raw_cfg, resolve=True),
            # a resume continues after its checkpoint; a restart (killed before one) re-logs from step 0
            resume_step={"resume": plan.start_step, "restart": -1}.get(plan.mode),
        )
    )
    efficiency = meters.EfficiencyMeter(
        device,
        flops_per_token(spec, params, t.seq_len),
        *meters.peak_flops(device, amp_dtype, cfg.hardware.peak_tflops),
    )
    profiler = cleanup.enter_context(StepProfiler(cfg.debug, run_dir, device))
    if cfg.debug.anomaly:
        cleanup.enter_context(torch.autograd.set_detect_anomaly(True))
    params_list = [p for p in model.parameters() if p.requires_grad]

    # Running sums between log rows stay on the device: no host sync except at log steps.
    window = records.MetricsWindow(device)
    guard = guards.StepGuard(cfg.guard)
    identity = plan.identity(raw_cfg, data.info)
    train_time, last_saved = 0.0, -1
    save_failure = ""  # why the last save failed, for the run's one line

    def save(step: int) -> bool:
        """Checkpoint `step`; False (reported) if the write failed, the previous checkpoint then stays."""
        nonlocal last_saved, save_failure
        meta = {
            "tokens": step * tokens_per_step,
            "eval_loss": eval_loss,
            "metrics": metrics.sync(),
            **identity,
        }
        state = resume.capture(
            step=step,
            tokens=step * tokens_per_step,
            next_sample=step * samples_per_step,
            data=data,
            window=window,
            window_totals=distributed.window_totals(window),
            telemetry=controls.telemetry.state_dict() if controls.telemetry is not None else None,
            guard=guard,
            train_time=train_time,
            eval_loss=eval_loss,
        )
        try:
            store.save(step, model=model, optimizer=optimizer, local_state=state, meta=meta)
        except OSError as e:
            good = store.newest_good()
            save_failure = (
                f"{e}; the newest complete checkpoint is still {good.path.name if good else 'none'}"
            )
            log.error("checkpoint at step %d failed: %s", step, save_failure)
            return False
        last_saved = step
        return True

    def restore(state: dict, *, load_data: bool) -> None:
        """This rank's train state from a checkpoint: window, guard, telemetry window, RNG (and data)."""
        resume.restore(
            state,
            data=data,
            window=window,
            guard=guard,
            load_data=load_data,
            telemetry=controls.telemetry,
            rank=rank,
            world_size=world_size,
        )

    def rollback(step: int, reason: str) -> int:
        """Back to the newest good checkpoint; the replay skips batch `step`. Returns the checkpoint step."""
        nonlocal train_time, eval_loss, last_saved
        target = store.newest_good()
        if guard.rollbacks >= cfg.guard.max_rollbacks or target is None:
            why = (
                "no checkpoint to roll back to"
                if target is None
                else f"guard.max_rollbacks={cfg.guard.max_rollbacks} reached"
            )
            raise RunFailed(
                f"step {step}: {reason}; {why}; the last good state is {target.path if target else 'lost'}"
            )
        carry = guard.rollback_carry(step)
        state = store.load(target, model=model, optimizer=optimizer)
        optimizer.zero_grad(set_to_none=True)
        controls.rewind(target.step)
        restore(state, load_data=True)
        guard.apply_carry(carry)
        metrics.rewind(target.step)
        train_time, eval_loss, last_saved = state["train_time"], state["eval_loss"], target.step
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
        if not save(target.step):
            raise RunFailed(f"step {step}: the rollback to step {target.step} could not be recorded")
        return target.step

    if plan.mode == "resume":
        state = store.load(plan.checkpoint, model=model, optimizer=optimizer)
        restore(state, load_data=False)  # the data cursor: loaded by plan.check_data
        train_time, eval_loss, last_saved = state["train_time"], state["eval_loss"], plan.start_step
        log.info("resumed at step %d from %s", plan.start_step, plan.checkpoint.path)
        if cfg.guard.spike_policy == SpikePolicy.rollback and plan.external:
            save(plan.start_step)  # continued from another run's checkpoint: something to roll back to here
    else:
        figures = _eval_figures(model, data, cfg, device, amp_dtype)
        eval_loss = figures["eval_loss"]
        first_row = {"step": 0, "tokens": 0, **figures, **downstream.columns(0), "elapsed_s": 0.0}
        metrics.write(first_row)
        tracked.log(first_row)
        log.info("step 0 | eval %.4f | eval_train %.4f", eval_loss, figures["eval_train_loss"])
        if cfg.guard.spike_policy == SpikePolicy.rollback:
            save(0)  # something to roll back to before the first periodic checkpoint

    step_start = time.perf_counter()
    grad_norm = torch.zeros((), device=device)
    sums_dtype = env.sum_dtype(device)
    step = plan.start_step
    while step < t.steps:
        step += 1
        controls.begin_step(step, optimizer)  # LR, p, gates, lambda: pure functions of the step
        micro_batches = [
            data.train.batch(first, count)
            # debug.overfit: the first step's batch at every step
            for first, count in micro_batch_samples(
                1 if cfg.debug.overfit else step, rank, world_size, t.micro_batch, t.grad_accum
            )
        ]
        step_tokens = sum(int(y.numel()) for _, y in micro_batches)
        step_ce = torch.zeros((), dtype=sums_dtype, device=device)
        step_obj = torch.zeros((), dtype=sums_dtype, device=device)
        # a batch that an earlier rollback dropped is read (stream cursors advance) but not learned from
        for a, (inputs, targets) in enumerate(micro_batches if step not in guard.dropped else []):
            inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            last = a == len(micro_batches) - 1
            with distributed.no_sync(ddp, sync=last) if ddp is not None else contextlib.nullcontext():
                with env.autocast(device, amp_dtype):
                    hidden = controls.forward(inputs)
                sums = controls.loss(hidden, targets)
                # Normalise by the tokens of the whole accumulated batch: accumulation equals one larger
                # batch. Every rank has as many tokens, so DDP's gradient mean is the global batch's.
                objective = controls.with_router_loss(sums.total / step_tokens, len(micro_batches))
                penalty = controls.penalty() if last else None  # once per step
                (objective if penalty is None else objective + penalty).backward()
            step_ce += sums.ce.to(sums_dtype)
            step_obj += sums.total.detach().to(sums_dtype)
            del hidden, sums, objective  # the loss's stored dh / dW (4·V·H bytes) must not outlive the step
        parallel.average_gradients(replicated)
        controls.before_clip(is_log_step(step, cfg))
        max_norm = t.grad_clip if t.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(params_list, max_norm, foreach=True)
        grad_norm = parallel.full(grad_norm)  # FSDP: a DTensor norm, the same on every rank
        if world_size > 1 and guard.active:  # every rank must reach the same verdict: the global loss
            g_ce, g_obj = distributed.all_reduce_sum(step_ce, step_obj)
            verdict = _guard_verdict(guard, step, g_ce, g_obj, step_tokens * world_size, grad_norm)
        else:
            verdict = _guard_verdict(guard, step, step_ce, step_obj, step_tokens, grad_norm)
        if verdict.action == guards.ROLLBACK:
            step = rollback(step, verdict.reason)
            continue
        if verdict.action == guards.APPLY:
            optimizer.step()
            window.add(step_ce, step_obj, step_tokens)
        if verdict.reason:
            log.warning(
                "step %d: %s%s", step, verdict.reason, "; skipped" if verdict.action == guards.SKIP else ""
            )
        optimizer.zero_grad(set_to_none=True)
        progress.step()
        profiler.step()

        is_last = step == t.steps
        do_eval = is_last or (t.eval_every > 0 and step % t.eval_every == 0)
        halt = guard.too_many_skips
        if do_eval or halt or step == 1 or step % t.log_every == 0 or downstream.due(step):
            # the host sync of this window (and its one all-reduce: every rank has as many tokens)
            train_ce, train_objective = distributed.window_means(window)
            now = time.perf_counter()
            window.time += now - step_start
            train_time += now - step_start
            row = {
                "step": step,
                "tokens": step * tokens_per_step,
                "train_loss": train_ce,
                "train_ppl": _ppl(train_ce),
                "train_objective": train_objective,
                "grad_norm": grad_norm.item(),
                "tok_s": window.tokens * world_size / max(window.time, 1e-9),
                "elapsed_s": train_time,
                "skipped_steps": guard.skipped,
                "loss_spikes": guard.spikes,
            }
            row["shared_gate"], row["routed_gate"] = _gate_means(model)
            row.update(controls.log_columns(step))  # per-group LRs, p, lambda, telemetry
            row.update(efficiency.columns(row["tok_s"] / world_size))  # MFU, peak memory
            if do_eval:
                row.update(_eval_figures(model, data, cfg, device, amp_dtype))
                eval_loss = row["eval_loss"]
            row.update(downstream.columns(step))
            metrics.write(row)
            tracked.log(row, layers=controls.layer_rows)  # telemetry.csv's rows of this step too
            progress.report(row, t.steps, eta_s=(t.steps - step) * train_time / step)
            window.reset()
            step_start = time.perf_counter()  # evaluation and logging are not training time
        else:
            now = time.perf_counter()
            window.time += now - step_start
            train_time += now - step_start
            step_start = now

        if store.due(step, final=is_last or halt):
            if not save(step) and (is_last or halt):
                raise RunFailed(f"step {step}: the final checkpoint could not be written: {save_failure}")
            step_start = time.perf_counter()
        if halt:
            kept = (
                f"in checkpoint step_{step:08d}" if store.enabled else "not saved (checkpoint.enabled=false)"
            )
            raise RunFailed(
                f"stopped at step {step}: {guard.consecutive_skips} consecutive steps had a non-finite loss "
                f"or gradient (guard.max_skips={cfg.guard.max_skips}); the last good state is {kept}"
            )
        signum = stop.agreed()
        if signum is not None and not is_last:  # SIGUSR2 / SIGTERM: save here, then stop (requeue resumes)
            if store.due(step, final=True) and last_saved != step and not save(step):
                raise RunFailed(
                    f"step {step}: stop signal, but the checkpoint could not be written: {save_failure}"
                )
            progress.close()
            metrics.close()
            controls.close()
            preempted = signals.Preempted(signum, step, stop.previous(signum), saved=store.enabled)
            resumes = " (the requeued job resumes from it)" if store.enabled else ""
            log.warning("%s%s", preempted, resumes)  # in train.log: why it ended
            raise preempted
    progress.close()
    metrics.close()
    controls.close()
    log.info(
        "done: final eval loss %.4f (ppl %.2f), %s tokens in %.1f s",
        eval_loss,
        _ppl(eval_loss),
        f"{t.steps * tokens_per_step:,}",
        train_time,
    )
    return eval_loss
