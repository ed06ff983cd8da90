"""`step`: full training steps (data, forward, loss, backward, optimizer) — tok/s, the time split, and MFU.

FLOPs per token are counted from the model: 6 x active non-embedding parameters + 6 x L x H x S for causal
attention scores + 6 x H x V for the tied head. The peak is a 2048^3 fp32 GEMM timed after every measured
step on CPU (its median), or the datasheet bf16 peak of the GPU. `--pair` also times the matched dense
control (E=1, K=1, same total parameters) side by side.
"""

from __future__ import annotations

import argparse
import time

import torch

from trmoe.bench.common import matmul_peak_flops, record, sync
from trmoe.model.flops import flops_per_token  # the formula the planner uses too

DATASHEET_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "B200": 2250e12}


def _components(overrides: list[str]):
    from hydra import compose, initialize_config_module

    import trmoe.config.schema  # noqa: F401
    from trmoe.config.resolve import model_spec, to_config

    with initialize_config_module(version_base="1.3", config_module="trmoe.conf"):
        cfg = to_config(compose("config", overrides=overrides))
    return cfg, model_spec(cfg)


def measure(
    overrides: list[str], steps: int, device: torch.device, compile_model: bool = False, probe_n: int = 0
) -> dict:
    """Median seconds of each part of a training step, as the train loop runs it: autocast from
    hardware.precision, the configured loss backend (loss.backend), optionally torch.compile.
    probe_n > 0: after every step, time one probe_n^3 GEMM in the run's dtype: the peak is measured
    between the steps it is compared with (this machine's speed drifts by 10-20% over minutes)."""
    from trmoe.data.pipeline import build_data
    from trmoe.model.transformer import TRMoETransformer, count_parameters
    from trmoe.train import env
    from trmoe.train.loss_backend import resolve_backend, training_loss
    from trmoe.train.optim import build_optimizer

    cfg, spec = _components(overrides)
    t = cfg.trainer
    env.configure(cfg.hardware, device)  # threads; TF32 on CUDA, as the train loop sets them
    torch.manual_seed(0)
    amp = env.autocast_dtype(cfg.hardware, device)
    backend = resolve_backend(cfg.loss, device)
    loss_fn = training_loss(cfg.loss, backend, amp)
    model = TRMoETransformer(spec).to(device)
    forward = torch.compile(model) if compile_model else model
    params = count_parameters(model)
    optimizer = build_optimizer(model, cfg.optimizer, device)
    data = build_data(cfg, spec.vocab_size)
    split = {"data": [], "forward": [], "loss": [], "backward": [], "optimizer": []}
    probe_s = []
    if probe_n:
        a, b = (torch.randn(probe_n, probe_n, device=device) for _ in range(2))
    for step in range(steps + 2):  # two warm-up steps (and torch.compile's compilation)
        marks = [time.perf_counter()]
        inputs, targets = data.train.batch(step * t.micro_batch, t.micro_batch)
        inputs, targets = inputs.to(device), targets.to(device)
        sync(device)
        marks.append(time.perf_counter())
        with env.autocast(device, amp):
            hidden = forward(inputs)
        sync(device)
        marks.append(time.perf_counter())
        # the loss (with its head GEMMs) timed on its own: cut the graph at the final hidden states
        hidden_leaf = hidden.detach().requires_grad_()
        sums = loss_fn(hidden_leaf, model.head_weight, targets)
        (sums.total / targets.numel()).backward()
        sync(device)
        marks.append(time.perf_counter())
        hidden.backward(hidden_leaf.grad)
        sync(device)
        marks.append(time.perf_counter())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        marks.append(time.perf_counter())
        if step >= 2:
            for name, t0, t1 in zip(split, marks, marks[1:], strict=False):
                split[name].append(t1 - t0)
        if probe_n:
            start = time.perf_counter()
            a @ b
            sync(device)
            if step >= 2:
                probe_s.append(time.perf_counter() - start)
    tokens = t.micro_batch * t.seq_len
    seconds = {k: sorted(v)[len(v) // 2] for k, v in split.items()}
    step_s = sum(seconds.values())
    fpt = flops_per_token(spec, params, t.seq_len)
    out = {
        "overrides": overrides,
        "loss_backend": backend.value,
        "autocast": None if amp is None else str(amp).replace("torch.", ""),
        "compile": compile_model,
        "params_total": params.total,
        "params_active": params.active,
        "tokens_per_step": tokens,
        "split_s": seconds,
        "step_s": step_s,
        "tok_s": tokens / step_s,
        "flops_per_token": fpt,
        "achieved_flops": fpt * tokens / step_s,
    }
    if probe_s:
        out["peak_flops"] = 2 * probe_n**3 / sorted(probe_s)[len(probe_s) // 2]
    if device.type == "cuda":
        out["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    del model, forward, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trmoe.bench step", description=__doc__)
    parser.add_argument("--model", nargs="+", default=["tiny", "100m"])
    parser.add_argument("--batch", type=int, default=None, help="micro-batch; default 1 on CPU, 8 on GPU")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--pair", action="store_true", help="also time the matched dense control (E=1, K=1)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (inductor)")
    parser.add_argument("overrides", nargs="*", help="extra config overrides")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    batch = args.batch or (8 if device.type == "cuda" else 1)
    measured_peak = None
    if device.type == "cuda":
        name = torch.cuda.get_device_name()
        peak = next((v for k, v in DATASHEET_BF16.items() if k in name), None)
        peak_source = "datasheet dense bf16"
        measured_peak = matmul_peak_flops(device, torch.bfloat16, n=8192)
    else:  # measured between the steps, per arm (measure(probe_n=...))
        peak, peak_source = None, "fp32 2048^3 GEMM timed after each measured step"
    for model in args.model:
        base = [
            f"model={model}",
            f"trainer.micro_batch={batch}",
            f"trainer.seq_len={args.seq}",
            "data=embedded",
            *(["hardware=cuda"] if device.type == "cuda" else []),
            *args.overrides,
        ]
        arms = {"tr": base}
        if args.pair:
            arms["dense"] = [*base, "model.num_experts=1", "routing.top_k=1"]
        probe_n = 2048 if device.type == "cpu" else 0
        measured = {arm: measure(o, args.steps, device, args.compile, probe_n) for arm, o in arms.items()}
        payload = {"model": model, "device": str(device), "peak_flops": peak, "peak_source": peak_source}
        if measured_peak:
            payload["measured_bf16_gemm_flops"] = measured_peak
        for arm, m in measured.items():
            arm_peak = m.get("peak_flops") or peak
            m["mfu"] = m["achieved_flops"] / arm_peak if arm_peak else None
            payload[arm] = m
        if args.pair:
            payload["tr_over_dense_tok_s"] = measured["tr"]["tok_s"] / measured["dense"]["tok_s"]
        record("step", payload)
        for arm, m in measured.items():
            split = " ".join(f"{k} {v * 1e3:.0f}ms" for k, v in m["split_s"].items())
            mfu = f"{m['mfu']:.1%}" if m["mfu"] else "n/a"
            peak_s = f" of {m['peak_flops'] / 1e9:.0f} GFLOP/s" if m.get("peak_flops") else ""
            print(f"{model:>6} {arm:>5}: {m['tok_s']:8.1f} tok/s  MFU {mfu}{peak_s}  ({split})")
        if args.pair:
            print(f"{model:>6}: TR / dense tok/s = {payload['tr_over_dense_tok_s']:.3f}")
