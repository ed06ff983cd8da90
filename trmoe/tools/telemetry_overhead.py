"""Measure what expert telemetry (telemetry.moe=true) costs per training step.

    python -m trmoe.tools.telemetry_overhead [--steps 40] [--log-every 10] [config overrides ...]

Builds the configured model once and times full training steps (forward, loss, backward, grad norms at
log steps, clipping, optimizer step, collection at log steps) in alternating blocks: with telemetry
attached (hooks registered, counters on the device) and detached (no hooks, no counters: what
telemetry.moe=false runs), so that drift of a shared machine hits both alike. Prints the median and mean
step time of each and the relative overhead. No files are written.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from trmoe.bench.common import Parser, positive_int
from trmoe.bench.step import compose_arm
from trmoe.cli import run
from trmoe.config.derived import micro_batch_tokens
from trmoe.data.build import build_data
from trmoe.model.transformer import TRMoETransformer
from trmoe.optim.build import build_optimizer
from trmoe.optim.schedule import build_schedules
from trmoe.run.cadence import Cadence
from trmoe.runtime import env
from trmoe.train.objective import Objective
from trmoe.train.observe.telemetry import TelemetryObserver
from trmoe.train.prepare import prepare_model


def _step(objective: Objective, optimizer, params, inputs, targets, step: int, log: bool) -> None:
    """The training step's parts (trmoe.train.trainer): the objective (telemetry recording when attached),
    backward, telemetry's gradient norms at its cadence, clipping, the optimizer step; at a log step the
    host sync and the collection."""
    tel = objective.telemetry
    loss, _ = objective(inputs, targets, targets.numel(), 1, True)
    loss.backward()
    if tel is not None:
        tel.before_clip(step)
    norm = torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if log:
        norm.item()  # the loop's host sync of a log step
        if tel is not None:
            tel.collect(step)


def measure(argv: list[str]) -> None:
    """Bad options or overrides raise UserError (one line) before anything is built or timed."""
    parser = Parser(prog="python -m trmoe.tools.telemetry_overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=40, help="timed steps per variant")
    parser.add_argument(
        "--log-every", type=positive_int, default=10, help="log cadence (collection, grad norms)"
    )
    parser.add_argument("--block", type=positive_int, default=5, help="steps per alternating block")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. data=random")
    args = parser.parse_args(argv)
    cfg, spec = compose_arm(["hardware=cpu", *args.overrides])  # composed and validated as the train app does
    device = env.select_device(cfg.hardware)
    env.configure(cfg.hardware, device)
    data = build_data(cfg, spec.vocab_size)
    t = cfg.trainer
    torch.manual_seed(t.seed)
    model = TRMoETransformer(spec).to(device)
    prepare_model(model, t, device, build_schedules(cfg))
    amp = env.autocast_dtype(cfg.hardware, device)
    objective = Objective(cfg, model, device, amp)
    optimizer = build_optimizer(model, cfg.optimizer, device)
    params = [p for p in model.parameters() if p.requires_grad]
    cadence = Cadence(args.log_every)
    times: dict[str, list[float]] = {"off": [], "on": []}
    step = 0
    while len(times["on"]) < args.steps:
        for name in ("off", "on"):
            tel = objective.telemetry = TelemetryObserver(model, device, cadence) if name == "on" else None
            for i in range(args.block + 1):  # the first step of a block is a warm-up, not timed
                inputs, targets = data.train.batch(step * t.micro_batch, t.micro_batch)
                inputs, targets = inputs.to(device), targets.to(device)
                log = cadence.due(step)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                _step(objective, optimizer, params, inputs, targets, step, log=log)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if i > 0:
                    times[name].append(time.perf_counter() - start)
                step += 1
            if tel is not None:
                tel.close()
    if hasattr(data, "close"):
        data.close()
    tokens = micro_batch_tokens(t)
    threads = torch.get_num_threads()
    print(f"model {cfg.model.name}, vocab {spec.vocab_size}, {tokens} tokens/step, {device}, {threads} thr.")
    (off_median, off_mean) = (statistics.median(times["off"]), statistics.fmean(times["off"]))
    for name, values in times.items():
        median, mean = statistics.median(values), statistics.fmean(values)
        print(
            f"telemetry {name:3s}: median {median * 1e3:.1f} ms/step ({(median / off_median - 1):+.1%}), "
            f"mean {mean * 1e3:.1f} ms/step ({(mean / off_mean - 1):+.1%})"
        )


def main(argv: list[str] | None = None) -> int:
    """The exit code: 0, or 2 after one line on stderr for bad input."""
    return run(measure, argv)


if __name__ == "__main__":
    sys.exit(main())
