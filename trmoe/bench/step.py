"""`step`: full training steps (data, forward, loss, backward, optimizer) — tok/s, the time split, and MFU.

FLOPs per token are counted from the model: 6 x active non-embedding parameters + 6 x L x H x S for causal
attention scores + 6 x H x V for the tied head. The peak is a 2048^3 fp32 GEMM timed after every measured
round on CPU (its median), or the datasheet bf16 peak of the GPU. `--pair` also times the matched dense
control (E=1, K=1, same total parameters), its steps alternating with the TR model's.
"""

from __future__ import annotations

import statistics
import time
from importlib import resources

import torch

from trmoe.bench.common import Parser, add_device, matmul_peak_flops, positive_int, record, sync
from trmoe.config.derived import micro_batch_tokens
from trmoe.config.schema import HardwareConfig
from trmoe.errors import UserError
from trmoe.model.flops import datasheet_peak, flops_per_token  # the formula the planner uses too
from trmoe.runtime import env

PROFILES = resources.files("trmoe.conf") / "model"  # the model profiles --model takes
MODELS = sorted(f.name.removesuffix(".yaml") for f in PROFILES.iterdir() if f.name.endswith(".yaml"))


def compose_arm(overrides: list[str], compile_model: bool = False):
    """The validated config and model spec of one arm, composed as the train app composes it; UserError (one
    line) for a bad override or value."""
    from trmoe.config.resolve import compose_packaged, to_config
    from trmoe.config.spec import model_spec

    cfg = to_config(compose_packaged([*overrides, *(["trainer.compile=true"] if compile_model else [])]))
    return cfg, model_spec(cfg)


PARTS = ("data", "forward", "loss", "backward", "optimizer")


class Arm:
    """One configuration's training step, run by the train loop's own parts: the model prepared as training
    prepares it (trmoe.train.prepare, torch.compile optionally), the schedules applied (Scheduler), the
    training objective (Objective: autocast from hardware.precision, the configured loss backend, a learned
    router's losses, the diversity penalty), clipping and the optimizer step."""

    def __init__(self, overrides: list[str], device: torch.device, compile_model: bool):
        from trmoe.data.build import build_data
        from trmoe.model.transformer import TRMoETransformer, count_parameters
        from trmoe.optim.build import build_optimizer
        from trmoe.optim.schedule import build_schedules
        from trmoe.train.objective import Objective
        from trmoe.train.prepare import compiled, prepare_model
        from trmoe.train.scheduler import Scheduler

        cfg, self.spec = compose_arm(overrides, compile_model)
        self.overrides, self.device, self.compile, self.t = overrides, device, compile_model, cfg.trainer
        env.configure(cfg.hardware, device)  # threads; TF32 on CUDA, as the train loop sets them
        torch.manual_seed(0)
        self.amp = env.autocast_dtype(cfg.hardware, device)
        self.model = TRMoETransformer(self.spec).to(device)
        schedules = build_schedules(cfg)
        prepare_model(self.model, self.t, device, schedules)
        self.objective = Objective(cfg, self.model, device, self.amp)
        self.objective.train_model = compiled(self.model, self.t)
        self.backend = self.objective.loss_backend
        self.params = count_parameters(self.model)
        self.optimizer = build_optimizer(self.model, cfg.optimizer, device)
        self.scheduler = Scheduler(schedules, self.model, self.optimizer, cfg.routing.bias_update)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.data = build_data(cfg, self.spec.vocab_size)
        self.split: dict[str, list[float]] = {k: [] for k in PARTS}

    def step(self, index: int, record: bool) -> None:
        t, device, objective = self.t, self.device, self.objective
        values = self.scheduler.begin_step(min(index + 1, t.steps))
        objective.begin_step(values["diversity"])
        marks = [time.perf_counter()]
        inputs, targets = self.data.train.batch(index * t.micro_batch, t.micro_batch)
        inputs, targets = inputs.to(device), targets.to(device)
        sync(device)
        marks.append(time.perf_counter())
        hidden = objective.forward(inputs)
        sync(device)
        marks.append(time.perf_counter())
        # the loss (with its head GEMMs) timed on its own: cut the graph at the final hidden states
        hidden_leaf = hidden.detach().requires_grad_()
        sums = objective.loss(hidden_leaf, targets)
        (sums.total / targets.numel()).backward()
        sync(device)
        marks.append(time.perf_counter())
        # the rest of the objective (router losses, penalty) joins the backward through the model
        terms = objective.terms(micro_batches=1, last=True)
        if terms is None:
            hidden.backward(hidden_leaf.grad)
        else:
            torch.autograd.backward([hidden, terms], [hidden_leaf.grad, torch.ones_like(terms)])
        sync(device)
        marks.append(time.perf_counter())
        max_norm = t.grad_clip if t.grad_clip > 0 else float("inf")
        torch.nn.utils.clip_grad_norm_(self.trainable, max_norm, foreach=True)
        self.optimizer.step()
        self.scheduler.end_step()  # learned_v3's bias update: part of its step's cost
        self.optimizer.zero_grad(set_to_none=True)
        sync(device)
        marks.append(time.perf_counter())
        if record:
            for name, t0, t1 in zip(PARTS, marks, marks[1:], strict=False):
                self.split[name].append(t1 - t0)

    def result(self) -> dict:
        t = self.t
        tokens = micro_batch_tokens(t)
        seconds = {k: statistics.median(v) for k, v in self.split.items()}
        step_s = sum(seconds.values())
        each = [sum(parts) for parts in zip(*self.split.values(), strict=True)]  # every measured step
        fpt = flops_per_token(self.spec, self.params, t.seq_len)
        out = {
            "overrides": self.overrides,
            "loss_backend": self.backend.value,
            "autocast": None if self.amp is None else str(self.amp).replace("torch.", ""),
            "compile": self.compile,
            "params_total": self.params.total,
            "params_active": self.params.active,
            "tokens_per_step": tokens,
            "split_s": seconds,
            "step_s": step_s,
            "step_s_each": each,
            "tok_s": tokens / step_s,
            "flops_per_token": fpt,
            "achieved_flops": fpt * tokens / step_s,
        }
        if self.device.type == "cuda":
            out["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return out


def measure(
    arms: dict[str, list[str]],
    steps: int,
    device: torch.device,
    compile_model: bool = False,
    probe_n: int = 0,
) -> tuple[dict[str, dict], float | None]:
    """Median step split of each arm, the arms stepped in alternation (TR, dense, dense, TR, ...) so that
    the machine's drift and any first-in-a-round effect hit them alike; two warm-up steps each (and
    torch.compile's compilation).
    probe_n > 0: a probe_n^3 fp32 GEMM timed after every round: the peak, measured between the steps it
    is compared with (this machine's speed drifts by 10-20% over minutes). Returns (results, peak)."""
    if device.type == "cuda":  # max_memory_allocated: this call's arms only (all of them, when paired)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    built = {name: Arm(overrides, device, compile_model) for name, overrides in arms.items()}
    if probe_n:
        a, b = (torch.randn(probe_n, probe_n, device=device) for _ in range(2))
    probe_s = []
    order = list(built.values())
    for index in range(steps + 2):
        for arm in order if index % 2 == 0 else order[::-1]:  # ABBA: neither arm always goes first
            arm.step(index, record=index >= 2)
        if probe_n:
            start = time.perf_counter()
            a @ b
            sync(device)
            if index >= 2:
                probe_s.append(time.perf_counter() - start)
    peak = 2 * probe_n**3 / statistics.median(probe_s) if probe_s else None
    return {name: arm.result() for name, arm in built.items()}, peak


def hardware_preset(device: torch.device) -> str:
    """The hardware option whose runs use `device` (ROCm builds of torch name their GPUs cuda too)."""
    if device.type == "cuda":
        return "rocm" if torch.version.hip is not None else "cuda"
    return device.type


def check_device(hw: HardwareConfig, device: torch.device) -> None:
    """The train app's device selection and precision check for an arm's config (a device this machine lacks
    is its one-line UserError); the selected device must be the one measured, since the result line records
    the overrides as what ran."""
    selected = env.select_device(hw)
    if selected.type != device.type:
        raise UserError(
            f"config error: hardware.device={hw.device.value} selects {selected.type}, not the --device "
            f"{device} bench step measures; allowed: hardware={hardware_preset(device)}, "
            f"or --device {selected.type}"
        )
    env.autocast_dtype(hw, device)


def main(argv: list[str] | None = None) -> None:
    parser = Parser(prog="python -m trmoe.bench step", description=__doc__)
    parser.add_argument(
        "--model", nargs="+", choices=MODELS, default=["tiny", "100m"], metavar="NAME", help=", ".join(MODELS)
    )
    parser.add_argument("--batch", type=positive_int, help="micro-batch; default 1 on CPU, 8 on GPU")
    parser.add_argument("--seq", type=positive_int, default=2048)
    parser.add_argument("--steps", type=positive_int, default=5)
    parser.add_argument("--pair", action="store_true", help="also time the matched dense control (E=1, K=1)")
    add_device(parser)
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (inductor)")
    parser.add_argument(
        "overrides", nargs="*", help="extra config overrides, key=value (not right after --model's names)"
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    batch = (8 if device.type == "cuda" else 1) if args.batch is None else args.batch
    runs: dict[str, dict[str, list[str]]] = {}  # model: {arm: its overrides}
    for model in args.model:
        base = [
            f"model={model}",
            f"trainer.micro_batch={batch}",
            f"trainer.seq_len={args.seq}",
            "data=embedded",
            f"hardware={hardware_preset(device)}",
            *args.overrides,
        ]
        runs[model] = {"tr": base}
        if args.pair:
            runs[model]["dense"] = [*base, "model.num_experts=1", "routing.top_k=1"]
    for arms in runs.values():  # every arm's config checked before any work starts or anything is recorded
        for overrides in arms.values():
            check_device(compose_arm(overrides, args.compile)[0].hardware, device)
    measured_peak = None
    if device.type == "cuda":
        name = torch.cuda.get_device_name()
        peak = datasheet_peak(name, "bf16")
        peak_source = "datasheet dense bf16"
        measured_peak = matmul_peak_flops(device, torch.bfloat16, n=8192)
    else:  # measured between the steps (measure(probe_n=...))
        peak, peak_source = None, "fp32 2048^3 GEMM timed after each measured step"
    for model, arms in runs.items():
        probe_n = 2048 if device.type == "cpu" else 0
        measured, probed = measure(arms, args.steps, device, args.compile, probe_n)
        model_peak = probed or peak
        payload = {
            "model": model,
            "device": str(device),
            "peak_flops": model_peak,
            "peak_source": peak_source,
        }
        if measured_peak:
            payload["measured_bf16_gemm_flops"] = measured_peak
        for arm, m in measured.items():
            m["mfu"] = m["achieved_flops"] / model_peak if model_peak else None
            payload[arm] = m
        if args.pair:
            payload["tr_over_dense_tok_s"] = measured["tr"]["tok_s"] / measured["dense"]["tok_s"]
            # the same ratio round by round (each round steps both arms back to back): its spread is the noise
            tr_each, dense_each = measured["tr"]["step_s_each"], measured["dense"]["step_s_each"]
            rounds = [d / t for t, d in zip(tr_each, dense_each, strict=True)]
            payload["tr_over_dense_rounds"] = sorted(rounds)
        record("step", payload)
        for arm, m in measured.items():
            split = " ".join(f"{k} {v * 1e3:.0f}ms" for k, v in m["split_s"].items())
            mfu = f"{m['mfu']:.1%}" if m["mfu"] else "n/a"
            peak_s = f" of {model_peak / 1e9:.0f} GFLOP/s" if model_peak else ""
            print(f"{model:>6} {arm:>5}: {m['tok_s']:8.1f} tok/s  MFU {mfu}{peak_s}  ({split})")
        if args.pair:
            rounds = payload["tr_over_dense_rounds"]
            print(
                f"{model:>6}: TR / dense tok/s = {payload['tr_over_dense_tok_s']:.3f} "
                f"(by round: median {statistics.median(rounds):.3f}, {rounds[0]:.3f} to {rounds[-1]:.3f})"
            )
