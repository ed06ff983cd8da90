"""Shared benchmark plumbing: machine facts, interleaved timing, JSON-lines results."""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from trmoe.cli import Parser
from trmoe.durable import json_text
from trmoe.errors import UserError
from trmoe.model.routing import STRATEGIES

RESULTS = Path("bench") / "results.jsonl"  # TRMOE_RESULTS=<path> writes elsewhere
DTYPES = ("float32", "bfloat16", "float16")  # what --dtype of the layer benchmarks takes


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"got {text!r}; allowed: a whole number >= 1")
    return value


def sorted_list(
    cast: Callable[[str], float], ok: Callable[[float], bool], allowed: str
) -> Callable[[str], list]:
    """argparse type: 2+ comma-separated values, distinct and sorted, each passing `ok` (--widths 64,128)."""

    def parse(text: str) -> list:
        try:
            values = sorted({cast(v) for v in text.split(",")})
        except ValueError:
            values = []
        if len(values) < 2 or not all(ok(v) for v in values):
            raise argparse.ArgumentTypeError(f"got {text!r}; allowed: 2+ comma-separated {allowed}")
        return values

    return parse


def figure(tool: str, rows: int, cols: int, figsize: tuple[float, float]) -> tuple[Any, Any]:
    """A headless matplotlib figure and its [rows, cols] axes, or one line naming the missing extra."""
    from trmoe.report.plots import available, pyplot

    if not available():
        raise UserError(f"{tool} --plot: needs matplotlib (pip install 'trmoe[report]'); allowed: no --plot")
    return pyplot().subplots(rows, cols, figsize=figsize, squeeze=False)


def save_figure(fig: Any, path: Path) -> None:
    """Write a figure as PNG (its folder made) and free it."""
    from trmoe.report.plots import save

    path.parent.mkdir(parents=True, exist_ok=True)
    save(fig, path, dpi=110)


def devices() -> list[str]:
    """The devices of this machine, as --device takes them: cpu, and cuda (cuda:<i>) where there is one."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return ["cpu", *(["cuda"] if gpus else []), *(f"cuda:{i}" for i in range(gpus))]


def add_device(parser: argparse.ArgumentParser) -> None:
    """--device: one of this machine's devices, cuda by default where there is one."""
    parser.add_argument("--device", choices=devices(), default="cuda" if torch.cuda.is_available() else "cpu")


def machine() -> dict:
    """What the figures were measured on."""
    from trmoe.runtime.env import cpu_name

    info = {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(
    cases: dict[str, Callable[[], object]], device: torch.device, warmup: int = 2, reps: int = 7
) -> dict[str, dict]:
    """Median seconds per call of each case, the cases run round-robin so machine noise hits all alike."""
    for fn in cases.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(reps):
        for name, fn in cases.items():
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            samples[name].append(time.perf_counter() - start)
    return {
        name: {"median_s": statistics.median(s), "min_s": min(s), "reps": len(s), "samples_s": s}
        for name, s in samples.items()
    }


def paired_ratio(timings: dict[str, dict], case: str, baseline: str) -> float:
    """Median over rounds of case / baseline, each pair timed back to back in one round of
    `time_interleaved`: drift between rounds cancels, which the ratio of the two medians does not do."""
    pairs = zip(timings[case]["samples_s"], timings[baseline]["samples_s"], strict=True)
    return statistics.median(a / b for a, b in pairs)


def matmul_peak_flops(device: torch.device, dtype: torch.dtype = torch.float32, n: int = 2048) -> float:
    """Measured throughput of one large square GEMM: the peak a real kernel reaches on this machine now."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    result = time_interleaved({"mm": lambda: a @ b}, device, warmup=2, reps=7)
    return 2 * n**3 / result["mm"]["median_s"]


def results_path() -> Path:
    """Where `record` appends: bench/results.jsonl, or $TRMOE_RESULTS."""
    return Path(os.environ.get("TRMOE_RESULTS", RESULTS))


def record(name: str, payload: dict, out: Path | None = None) -> dict:
    """Append one result line (with the machine it ran on) to bench/results.jsonl and return it."""
    out = out or results_path()
    entry = {"bench": name, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine(), **payload}
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        f.write(json_text(entry) + "\n")
    return entry


@dataclass(frozen=True)
class LayerBench:
    """What the layer benchmarks (ffn, dispatch) run: tokens through each layout's FFN, E experts, top-K,
    timed `reps` rounds, on `device` in `dtype`, with route tables of `strategy`; `compile` (ffn only): every
    layer through `torch.compile`, as `trainer.compile=true` trains."""

    tokens: int
    experts: int = 4
    top_k: int = 2
    reps: int = 7
    device: str = "cpu"
    dtype: str = "float32"
    strategy: str = "modulo_cyclic"
    compile: bool = False

    def fields(self) -> dict:
        """The settings every result line records (all but the repetitions, which `timings` holds)."""
        return {key: value for key, value in asdict(self).items() if key != "reps"}


def layer_args(name: str, doc: str | None, argv: list[str] | None, *, compiles: bool = False) -> LayerBench:
    """The command line of the layer benchmarks (ffn, dispatch): tokens, device, dtype, repetitions, routing
    strategy (and `--compile` where the benchmark `compiles`), with device-dependent defaults filled in."""
    parser = Parser(prog=f"python -m trmoe.bench {name}", description=doc)
    parser.add_argument("--tokens", type=positive_int, help="default: 2x2048 on CPU, 8x2048 on GPU")
    add_device(parser)
    parser.add_argument("--reps", type=positive_int, default=15)
    parser.add_argument("--dtype", choices=DTYPES, help="default: float32 on CPU, bfloat16 on GPU")
    parser.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default="modulo_cyclic",
        help="route tables (the default's E tuples group rows by tuple; hashed ones, e.g. random, by expert)",
    )
    if compiles:
        parser.add_argument(
            "--compile", action="store_true", help="time every layer through torch.compile (default: eager)"
        )
    args = parser.parse_args(argv)
    gpu = args.device.startswith("cuda")
    return LayerBench(
        tokens=(8 * 2048 if gpu else 2 * 2048) if args.tokens is None else args.tokens,
        reps=args.reps,
        device=args.device,
        dtype=("bfloat16" if gpu else "float32") if args.dtype is None else args.dtype,
        strategy=args.strategy,
        compile=getattr(args, "compile", False),
    )
