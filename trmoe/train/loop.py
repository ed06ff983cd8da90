"""The thin train loop: wire config -> data, model, loss, optimizer, schedule, records; then step."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from trmoe.config.resolve import model_spec, to_config
from trmoe.config.schema import Config
from trmoe.data.pipeline import Batch, build_data
from trmoe.model.transformer import TRMoETransformer, count_parameters
from trmoe.train import env, records
from trmoe.train.checkpoint import save_checkpoint
from trmoe.train.loss import chunked_tied_ce
from trmoe.train.optim import build_optimizer
from trmoe.train.progress import ProgressReporter
from trmoe.train.schedule import apply_lr, lr_multiplier

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
    ce = torch.zeros((), dtype=torch.float64, device=device)
    tokens = torch.zeros((), dtype=torch.int64, device=device)
    for inputs, targets in batches:
        inputs, targets = inputs.to(device), targets.to(device)
        with env.autocast(device, amp_dtype):
            hidden = model(inputs)
        sums = chunked_tied_ce(hidden, model.head_weight, targets, chunk_tokens=cfg.loss.chunk_tokens)
        ce += sums.ce.double()
        tokens += sums.tokens
    model.train()
    return (ce / tokens).item()


def train(raw_cfg: DictConfig, run_dir: Path) -> float:
    """Run one training job into run_dir; returns the final held-out loss. Raises UserError on bad input
    before anything is written."""
    cfg = to_config(raw_cfg)
    device = env.select_device(cfg.hardware)
    amp_dtype = env.autocast_dtype(cfg.hardware, device)
    spec = model_spec(cfg)
    records.check_fresh(run_dir)
    data = build_data(cfg, spec.vocab_size)

    # From here on the config and inputs are valid: write the run's records.
    run_dir.mkdir(parents=True, exist_ok=True)
    records.write_hydra_files(run_dir, raw_cfg)
    log_handler = records.attach_log_file(run_dir)
    try:
        return _train(cfg, raw_cfg, run_dir, device, amp_dtype, spec, data)
    finally:
        logging.getLogger().removeHandler(log_handler)
        log_handler.close()


def _train(cfg: Config, raw_cfg: DictConfig, run_dir: Path, device, amp_dtype, spec, data) -> float:
    t = cfg.trainer
    env.configure(cfg.hardware, device)
    env.seed_everything(t.seed)
    model = TRMoETransformer(spec).to(device)
    params = count_parameters(model)
    optimizer = build_optimizer(model, cfg.optimizer, device)

    world_size, rank = 1, 0
    samples_per_step = t.micro_batch * t.grad_accum * world_size
    tokens_per_step = samples_per_step * t.seq_len
    log.info("run directory: %s", run_dir)
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
    records.write_run_config(
        run_dir,
        {
            "run_name": run_dir.name,
            "run_dir": str(run_dir.resolve()),
            "config": OmegaConf.to_container(raw_cfg, resolve=True),
            "model_spec": spec.to_dict(),
            "params": params.to_dict(),
            "git": env.git_commit(),
            "world_size": world_size,
            "backend": env.backend_metadata(device, amp_dtype),
            "tokens_per_step": tokens_per_step,
            "total_tokens": tokens_per_step * t.steps,
            "data": data.info,
            "metrics_columns": list(records.METRIC_COLUMNS),
        },
    )
    metrics = records.MetricsWriter(run_dir / "metrics.csv")
    progress = ProgressReporter(cfg.run.progress, t.steps)
    params_list = [p for p in model.parameters() if p.requires_grad]
    loss_kwargs = {
        "chunk_tokens": cfg.loss.chunk_tokens,
        "label_smoothing": cfg.loss.label_smoothing,
        "z_loss": cfg.loss.z_loss,
    }

    eval_loss = evaluate(model, data.eval_set, cfg, device, amp_dtype)
    metrics.write(
        {"step": 0, "tokens": 0, "eval_loss": eval_loss, "eval_ppl": _ppl(eval_loss), "elapsed_s": 0.0}
    )
    log.info("step 0 | eval %.4f", eval_loss)

    # Running sums between log rows stay on the device: no host sync except at log steps.
    window_ce = torch.zeros((), dtype=torch.float64, device=device)
    window_obj = torch.zeros((), dtype=torch.float64, device=device)
    window_tokens = 0
    window_time, train_time = 0.0, 0.0
    step_start = time.perf_counter()
    grad_norm = torch.zeros((), device=device)
    for step in range(1, t.steps + 1):
        lr_mult = lr_multiplier(step, t.steps, cfg.optimizer)
        apply_lr(optimizer, lr_mult)
        first = (step - 1) * samples_per_step + rank * t.micro_batch * t.grad_accum
        micro_batches = [
            data.train.batch(first + a * t.micro_batch, t.micro_batch) for a in range(t.grad_accum)
        ]
        step_tokens = sum(int(y.numel()) for _, y in micro_batches)
        for inputs, targets in micro_batches:
            inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            with env.autocast(device, amp_dtype):
                hidden = model(inputs)
            sums = chunked_tied_ce(hidden, model.head_weight, targets, **loss_kwargs)
            # Normalise by the tokens of the whole accumulated batch: accumulation equals one larger batch.
            (sums.total / step_tokens).backward()
            window_ce += sums.ce.double()
            window_obj += sums.total.detach().double()
        max_norm = t.grad_clip if t.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(params_list, max_norm, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        window_tokens += step_tokens
        progress.step()

        is_last = step == t.steps
        do_eval = is_last or (t.eval_every > 0 and step % t.eval_every == 0)
        if do_eval or step == 1 or step % t.log_every == 0:
            train_ce = (window_ce / window_tokens).item()  # the host sync of this window
            now = time.perf_counter()
            window_time += now - step_start
            train_time += now - step_start
            row = {
                "step": step,
                "tokens": step * tokens_per_step,
                "train_loss": train_ce,
                "train_ppl": _ppl(train_ce),
                "train_objective": (window_obj / window_tokens).item(),
                "lr": cfg.optimizer.lr * lr_mult,
                "grad_norm": grad_norm.item(),
                "tok_s": window_tokens / max(window_time, 1e-9),
                "elapsed_s": train_time,
            }
            row["shared_gate"], row["routed_gate"] = _gate_means(model)
            if do_eval:
                eval_loss = evaluate(model, data.eval_set, cfg, device, amp_dtype)
                row.update(eval_loss=eval_loss, eval_ppl=_ppl(eval_loss))
            metrics.write(row)
            progress.report(row, t.steps, eta_s=(t.steps - step) * train_time / step)
            window_ce.zero_()
            window_obj.zero_()
            window_tokens, window_time = 0, 0.0
            step_start = time.perf_counter()  # evaluation and logging are not training time
        else:
            now = time.perf_counter()
            window_time += now - step_start
            train_time += now - step_start
            step_start = now

        if is_last or (t.checkpoint_every > 0 and step % t.checkpoint_every == 0):
            save_checkpoint(
                run_dir,
                step,
                {
                    "step": step,
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "config": OmegaConf.to_container(raw_cfg, resolve=True),
                    "model_spec": asdict(spec),
                },
            )
            step_start = time.perf_counter()
    progress.close()
    metrics.close()
    log.info(
        "done: final eval loss %.4f (ppl %.2f), %s tokens in %.1f s",
        eval_loss,
        _ppl(eval_loss),
        f"{t.steps * tokens_per_step:,}",
        train_time,
    )
    return eval_loss
