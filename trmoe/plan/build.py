"""The plan of one run: compose and validate the config as `python -m trmoe.train` does, then count.

    world            hydra.launcher nodes x tasks_per_node for a submitit preset (hardware=slurm_*), else
                     --world (torchrun), else 1
    tokens_per_step  micro_batch x seq_len x world x grad_accum (trmoe.config.derived.global_batch_tokens,
                     the function the train loop uses)
    steps            ceil(target tokens / tokens_per_step), or trainer.steps without a target
    FLOPs            trmoe.model.flops (forward + backward, per token) x tokens
    memory per GPU   trmoe.plan.memory for hardware.strategy resolved at this world size
    ETA              tokens / throughput (given as tok/s of the job, per GPU, or an MFU x peak)

Nothing is written and no device is touched: the model is built on the meta device.
"""

from __future__ import annotations

import math
from dataclasses import astuple, dataclass
from decimal import Decimal, DecimalException

from omegaconf import DictConfig, OmegaConf, open_dict

from trmoe.config.resolve import compose_packaged
from trmoe.config.schema import Config, Device, Precision
from trmoe.data.variant import SOURCES
from trmoe.errors import UserError

SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


def parse_count(option: str, text: str, examples: str = "20e9, 20B, 500M", upper: int = 10**18) -> int:
    """'20e9', '20B', '500M', '2.5T', '1_000_000' -> a positive integer (K/M/B(=G)/T are powers of 1000) up to
    `upper`, which keeps every figure derived from it (FLOPs, bytes, seconds) within float range."""
    raw = text.strip().replace("_", "").replace(",", "")
    scale = SUFFIXES.get(raw[-1:].upper(), 1) if raw else 1
    if scale != 1:
        raw = raw[:-1]
    try:
        value = Decimal(raw) * scale
    except DecimalException:  # not a number, or an exponent beyond Decimal's range
        value = None
    if value is None or not value.is_finite() or value <= 0 or value != value.to_integral_value():
        raise UserError(f"{option}: {text!r} is not a positive whole number; allowed: e.g. {examples}")
    if value > upper:
        raise UserError(f"{option}: {text!r} is too large; allowed: at most {upper:.0e}".replace("e+", "e"))
    return int(value)


def parse_positive(option: str, text: str, upper: float | None = None) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0 or (upper is not None and value > upper):
        allowed = f"a number in (0, {upper:g}]" if upper is not None else "a positive number"
        raise UserError(f"{option}: {text!r}; allowed: {allowed}")
    return value


def compose_run_config(overrides: list[str]) -> DictConfig:
    """The primary config with these overrides, hydra node included (hydra.launcher gives the world size),
    composed from the packaged tree exactly as the train app composes it. Writes nothing."""
    return compose_packaged(overrides, hydra_node=True)


@dataclass(frozen=True)
class World:
    size: int
    source: str  # how it was decided, in words
    launcher: str  # basic | submitit_slurm | submitit_local | ...


def launcher_world(cfg: DictConfig) -> tuple[str, int | None, str]:
    """(launcher choice, ranks the launcher starts or None, description) from hydra.launcher."""
    launcher = OmegaConf.select(cfg, "hydra.runtime.choices", default={}).get("hydra/launcher") or "basic"
    if "submitit" not in launcher:
        return launcher, None, ""
    nodes, tasks = (_launcher_count(cfg, key) for key in ("nodes", "tasks_per_node"))
    return launcher, nodes * tasks, f"hydra.launcher: {nodes} nodes x {tasks} tasks per node"


def _launcher_count(cfg: DictConfig, key: str) -> int:
    """hydra.launcher.<key>, a count of nodes or of tasks: submitit passes it to SLURM as given, so a value
    below 1 is an error here rather than a plan for a negative or silently changed world."""
    value = OmegaConf.select(cfg, f"hydra.launcher.{key}", default=1)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(
            f"config error: hydra.launcher.{key}={value}: must be a positive integer; allowed: 1, 2, ..."
        )
    return value


def decide_world(cfg: DictConfig, world_option: int | None) -> World:
    launcher, ranks, text = launcher_world(cfg)
    if ranks is not None:
        if world_option is not None and world_option != ranks:
            raise UserError(
                f"--world {world_option}: {launcher} starts {ranks} ranks ({text}); allowed: {ranks}, or set "
                "hydra.launcher.nodes / hydra.launcher.tasks_per_node instead"
            )
        return World(ranks, text, launcher)
    if world_option is not None:
        return World(world_option, "--world (torchrun --nproc_per_node x nodes)", launcher)
    return World(1, "single process (--world N for torchrun)", launcher)


def plan_precision(cfg: Config) -> tuple[str, str]:
    """(compute dtype: bf16 | fp16 | fp32, note) for the run's device, by the rules of
    trmoe.runtime.env.autocast_dtype (master weights stay fp32); hardware.device=auto is planned as a GPU."""
    hw = cfg.hardware
    gpu = hw.device in (Device.cuda, Device.rocm, Device.auto)
    note = "hardware.device=auto planned as a GPU; " if hw.device == Device.auto else ""
    if hw.device == Device.cpu and hw.precision in (Precision.bf16, Precision.fp16):
        raise UserError(
            f"config error: hardware.precision={hw.precision.value}: CPU runs use fp32; allowed: auto, fp32"
        )
    if hw.precision == Precision.fp32 or (hw.precision == Precision.auto and not gpu):
        return "fp32", note + "fp32 compute"
    if hw.precision == Precision.auto:
        return "bf16", note + "precision auto = bf16 autocast (fp16 on GPUs without bf16)"
    return hw.precision.value, note + f"{hw.precision.value} autocast"


def explicit_steps(overrides: list[str]) -> bool:
    return any(_key(o) == "trainer.steps" for o in overrides)


@dataclass(frozen=True)
class Throughput:
    """What was given: tok/s of the whole job, of one GPU, or an MFU (with a peak in FLOP/s per GPU)."""

    tok_s: float | None = None
    tok_s_per_gpu: float | None = None
    mfu: float | None = None
    peak_flops: float | None = None  # per GPU


RATE_OPTIONS = ("--tok-s", "--tok-s-per-gpu", "--mfu", "--peak-tflops")  # the Throughput fields, in order


def make_plan(
    overrides: list[str],
    tokens: int | None = None,
    world: int | None = None,
    throughput: Throughput = Throughput(),
) -> dict:
    """Every figure of the plan, JSON-ready. Raises UserError on bad input."""
    from trmoe.config.resolve import to_config

    if tokens is not None and explicit_steps(overrides):
        raise UserError("--tokens: trainer.steps is set too; allowed: one of --tokens or trainer.steps")
    raw = compose_run_config(overrides)
    w = decide_world(raw, world)
    choices = dict(OmegaConf.select(raw, "hydra.runtime.choices", default={}) or {})
    raw_sweep = OmegaConf.select(raw, "hydra.sweeper", default=None)
    with open_dict(raw):
        del raw["hydra"]  # the run config proper, as the train app sees it
    cfg = to_config(raw)
    # the figures need the model (torch): loaded once the config is known to be valid
    import torch

    from trmoe.config.derived import global_batch_tokens
    from trmoe.config.spec import model_spec
    from trmoe.model.flops import flops_breakdown
    from trmoe.model.transformer import TRMoETransformer, count_parameters
    from trmoe.plan.memory import estimate_memory
    from trmoe.runtime.distributed import DistEnv
    from trmoe.runtime.parallel import resolve_strategy

    t = cfg.trainer
    tokens_per_step = global_batch_tokens(t, w.size)
    if tokens is not None:
        steps = -(-tokens // tokens_per_step)
        with open_dict(raw):
            raw.trainer.steps = steps
        cfg = to_config(raw)  # the run that will be launched: its schedules are checked at these steps
    steps = cfg.trainer.steps
    run_tokens = steps * tokens_per_step

    spec = model_spec(cfg)
    with torch.device("meta"):
        model = TRMoETransformer(spec)
    counts = count_parameters(model)
    flops = flops_breakdown(spec, counts, t.seq_len)
    strategy = resolve_strategy(cfg.hardware.strategy, DistEnv(world_size=w.size))
    dtype, precision_note = plan_precision(cfg)
    memory = estimate_memory(model, spec, counts, cfg, strategy, w.size, dtype)

    mixture = None
    if SOURCES.get(cfg.data.source).composite:  # samples, tokens and epochs of each source over the run
        from trmoe.data.build import build_data

        data = build_data(cfg, spec.vocab_size, world_size=w.size)
        data.close()
        mixture = data.info["plan"]

    ladder = None
    if cfg.ladder.name is not None:  # a ladder: every rung, its counts, budgets, FLOPs and time
        from trmoe.plan.ladder import ladder_view

        sweep = dict(OmegaConf.select(raw_sweep, "params", default={}) or {})
        ladder = ladder_view(cfg, sweep, tokens_per_step, w.size, throughput)

    # a submitit launcher submits from a multirun
    train_command = "python -m trmoe.train" + (" --multirun" if w.launcher.startswith("submitit") else "")
    launch = [train_command, *(o for o in overrides if _key(o) != "trainer.steps"), f"trainer.steps={steps}"]
    return {
        "overrides": list(overrides),
        "model": {
            "name": cfg.model.name,
            "hidden_size": spec.hidden_size,
            "num_layers": spec.num_layers,
            "params": {
                **counts.to_dict(),
                "active_non_embedding": counts.active - counts.embedding,
            },
        },
        "hardware": {
            "preset": choices.get("hardware"),
            "launcher": w.launcher,
            "world": w.size,
            "world_source": w.source,
            "strategy": strategy,
            "compute_dtype": dtype,
            "precision_note": precision_note,
        },
        "batch": {
            "micro_batch": t.micro_batch,
            "seq_len": t.seq_len,
            "grad_accum": t.grad_accum,
            "world": w.size,
            "tokens_per_step": tokens_per_step,
        },
        "run": {
            "target_tokens": tokens,
            "steps": steps,
            "steps_source": "ceil(target tokens / tokens_per_step)"
            if tokens is not None
            else "trainer.steps",
            "tokens": run_tokens,
            "launch": " ".join(launch),
        },
        "flops": {
            "per_token": flops.to_dict(),
            "total": flops.total * run_tokens,
        },
        "memory": memory.to_dict(),
        "routing": routing_plan(cfg, spec),
        "mixture": mixture,
        "ladder": ladder,
        "time": eta(throughput, flops.total, w.size, tokens_per_step, run_tokens)
        or {"tok_s": None, "how_to_measure": how_to_measure(cfg, choices, overrides, train_command)},
    }


def routing_plan(cfg: Config, spec) -> dict:
    """What the run routes on and, for a route table (a function of the token id), the first table layer's
    balance (layer 0's without routing.layers): of token ids per expert, and with a token-count file
    (routing.frequencies, or data.path's token_counts.npy) of token occurrences
    (trmoe.model.routing.balance_stats: max/mean and min/mean, route 0 and all K routes)."""
    from trmoe.config.validate import frequencies_path
    from trmoe.model.routing import REGISTRY, balance_stats, build_route_table, load_token_counts

    # routing.layers: every strategy named once, in layer order; the balance is the first table layer's
    names = list(dict.fromkeys(spec.strategies))
    # a dense layer routes nothing: the first routed layer says what the run routes on
    routed = [i for i, name in enumerate(spec.strategies) if not REGISTRY[name].dense] or [0]
    layer = next((i for i in routed if REGISTRY[spec.strategy_of(i)].has_table), routed[0])
    entry = REGISTRY[spec.strategy_of(layer)]
    dense = [i for i, name in enumerate(spec.strategies) if REGISTRY[name].dense]
    routes_on = "the hidden state (a learned router)" if entry.learned else f"the {entry.key} id"
    if entry.key == "position":
        routes_on = "the position"
    if dense:
        routes_on += f"; layers {_spans(dense)} dense (no routed experts, shared width {spec.dense_width})"
    out = {
        "strategy": ",".join(names),
        "routes_on": routes_on,
        "analysis_only": any(REGISTRY[name].analysis_only for name in names),
        "ids": None,
        "occurrences": None,
    }
    if not entry.has_table or entry.distilled or spec.routed_width == 0 or spec.num_experts < 2:
        return out  # (distilled: its table is counted at the run's start, from its parent: trmoe.distill)
    path = frequencies_path(cfg)
    counts = load_token_counts(str(path)) if path is not None and path.is_file() else None
    if counts is not None and counts.shape != (spec.vocab_size,):
        counts = None  # not this vocabulary's (validation refuses it where a strategy reads it)
    table = build_route_table(
        spec.strategy_of(layer),
        spec.vocab_size,
        spec.num_experts,
        spec.top_k,
        layer,
        spec.route_seed,
        spec.hash_count,
        counts if entry.needs_frequencies else None,
        spec.route_embedding,
    )
    out["ids"] = balance_stats(table, spec.num_experts)
    if counts is not None:
        out["occurrences"] = balance_stats(table, spec.num_experts, counts)
    return out


def _spans(layers: list[int]) -> str:
    """Sorted layer indices as ranges: [0, 1, 2, 5] -> "0-2,5"."""
    spans: list[list[int]] = []
    for layer in layers:
        if spans and spans[-1][1] == layer - 1:
            spans[-1][1] = layer
        else:
            spans.append([layer, layer])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)


MODEL_KEYS = (
    "model",
    "attention",
    "routing",
    "optimizer",
    "loss",
)  # what `trmoe.bench step` takes as overrides


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def how_to_measure(cfg: Config, choices: dict, overrides: list[str], train_command: str) -> str:
    """The two ways to get a throughput for --tok-s / --tok-s-per-gpu."""
    short = [o for o in overrides if _key(o) != "trainer.steps"]
    model_overrides = [o for o in overrides if _key(o).split(".")[0] in MODEL_KEYS and _key(o) != "model"]
    bench = " ".join(
        [
            f"python -m trmoe.bench step --model {choices.get('model') or cfg.model.name}",
            f"--batch {cfg.trainer.micro_batch} --seq {cfg.trainer.seq_len}",
            *model_overrides,
        ]
    )
    run = " ".join([train_command, *short, "trainer.steps=50"])
    return (
        f"a short run of this config ({run}): the tok_s column of its metrics.csv (whole job) -> --tok-s; "
        f"or one GPU without communication ({bench}) -> --tok-s-per-gpu"
    )


def eta(
    given: Throughput,
    flops_per_token: int,
    world: int,
    tokens_per_step: int,
    run_tokens: int,
) -> dict | None:
    """Throughput, step time, ETA and the model FLOP/s (and MFU, given a peak) they imply; None when no
    throughput was given."""
    peak = given.peak_flops
    if given.tok_s is not None:
        total, source = given.tok_s, "--tok-s (whole job)"
    elif given.tok_s_per_gpu is not None:
        total, source = given.tok_s_per_gpu * world, f"--tok-s-per-gpu x {world} ranks"
    elif given.mfu is not None:
        if peak is None:
            raise UserError("--mfu: needs the peak FLOP/s of one GPU; allowed: --peak-tflops T (e.g. 989)")
        total = given.mfu * peak / flops_per_token * world
        source = f"--mfu {given.mfu:g} x {peak / 1e12:g} TFLOP/s per GPU / FLOPs per token x {world} ranks"
    else:
        return None
    per_gpu = total / world
    achieved = flops_per_token * per_gpu
    figures = {
        "tok_s": total,
        "tok_s_per_gpu": per_gpu,
        "step_s": tokens_per_step / total,
        "eta_s": run_tokens / total,
        "model_flops_per_gpu": achieved,
        "mfu": achieved / peak if peak else None,
    }
    # an extreme rate (or peak) overflows or underflows a float: no figure to print, no valid JSON
    if not all(0 < v < math.inf for v in figures.values() if v is not None) or (peak and math.isinf(peak)):
        given_options = [o for o, v in zip(RATE_OPTIONS, astuple(given), strict=True) if v is not None]
        raise UserError(
            f"{', '.join(given_options)}: the step time, ETA or FLOP/s of this run fall outside float range; "
            "allowed: realistic rates, e.g. --tok-s 1e6 or --mfu 0.4 --peak-tflops 989"
        )
    return {**figures, "source": source}
