"""`lrtransfer`: does the best learning rate move with width? LR sweeps at several widths.

Data: the embedded corpus (CPython's help topics, o200k-tokenized, its own train/held-out split), relabelled
to a compact vocabulary: the --vocab - 1 most frequent training tokens keep their own ids (0..V-2, by
frequency), every other token becomes one shared id V-1 (at V=2048: 92% of the training tokens keep theirs).
Model: the coordcheck shape (trmoe.bench.coordcheck.overrides: 4 heads, shared 2H, routed H over E=4, K=2,
--layers layers) at each hidden size of --widths; mup runs take the smallest width as the base shape.
Training: AdamW (optimizer defaults: betas 0.9/0.95, weight decay 0.1) with the per-group lrs of
trmoe.optim.build, linear warmup over 10% of --steps then cosine to 10%, grad-norm clip 1, --batch windows of
--seq tokens per step drawn at random (seeded) from the training tokens. Result: the final held-out loss
(mean over every full --seq window of the held-out split), per (parametrization, width, lr, seed); the best
lr per width (seed-mean loss) and whether it moves, printed and written to --out (JSON) and --plot (PNG).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from trmoe.bench.common import Parser, figure, positive_int, record, save_figure, sorted_list
from trmoe.bench.coordcheck import PARAMETRIZATIONS, overrides, widths_arg
from trmoe.durable import json_text, write_file


def compact_corpus(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) token ids of the embedded corpus in a `vocab`-id relabelling (module docstring)."""
    from trmoe.data.corpus import load_corpus

    corpus = load_corpus("embedded")
    ids, counts = np.unique(corpus.train.tokens, return_counts=True)
    keep = ids[np.argsort(-counts, kind="stable")][: vocab - 1]
    table = np.full(int(max(corpus.train.tokens.max(), corpus.eval.tokens.max())) + 1, vocab - 1, np.int64)
    table[keep] = np.arange(len(keep))
    return torch.from_numpy(table[corpus.train.tokens]), torch.from_numpy(table[corpus.eval.tokens])


def arm(parametrization: str, width: int, base: int, *, vocab: int, layers: int, seq: int):
    """The validated config and model spec of one (parametrization, width), composed once for all its lrs."""
    from trmoe.bench.step import compose_arm

    return compose_arm(
        [
            *overrides(parametrization, width, base, layers, 1e-3),
            f"model.vocab_size={vocab}",
            f"model.max_seq_len={seq}",
            f"trainer.seq_len={seq}",
        ]
    )


def train_one(
    cfg,
    spec,
    lr: float,
    seed: int,
    data: tuple[torch.Tensor, torch.Tensor],
    *,
    steps: int,
    batch: int,
    seq: int,
) -> float:
    """The final held-out loss of one run of `arm`'s model at optimizer.lr = `lr` (module docstring)."""
    from trmoe.model.transformer import TRMoETransformer
    from trmoe.optim.build import build_optimizer

    torch.manual_seed(seed)
    model = TRMoETransformer(spec)
    optimizer = build_optimizer(model, replace(cfg.optimizer, lr=lr), torch.device("cpu"))
    warmup = max(1, steps // 10)

    def multiplier(step: int) -> float:  # of the step about to run (0-based)
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
    train, held_out = data
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, train.numel() - seq - 1, (batch,), generator=gen)
        windows = torch.stack([train[s : s + seq + 1] for s in starts.tolist()])
        logits = model.logits(model(windows[:, :-1]))
        loss = F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
    if not math.isfinite(loss.item()):
        return math.nan
    n = (held_out.numel() - 1) // seq
    inputs = held_out[: n * seq].view(n, seq)
    targets = held_out[1 : n * seq + 1].view(n, seq)
    with torch.no_grad():
        logits = model.logits(model(inputs))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()


def best_lrs(
    results: list[dict], parametrization: str, widths: list[int], lrs: list[float]
) -> dict[int, float]:
    """Width -> the lr of the lowest seed-mean held-out loss."""
    out = {}
    for width in widths:
        means = [mean_loss(results, parametrization, width, lr) for lr in lrs]
        finite = [(m, lr) for m, lr in zip(means, lrs, strict=True) if math.isfinite(m)]
        out[width] = min(finite)[1] if finite else math.nan
    return out


def mean_loss(results: list[dict], parametrization: str, width: int, lr: float) -> float:
    losses = [
        r["loss"]
        for r in results
        if (r["parametrization"], r["width"], r["lr"]) == (parametrization, width, lr)
    ]
    return float(np.mean(losses)) if losses else math.nan


def plot(
    results: list[dict], parametrizations: list[str], widths: list[int], lrs: list[float], path: Path
) -> None:
    from matplotlib import colormaps

    fig, axes = figure("lrtransfer", 1, len(parametrizations), (5 * len(parametrizations), 3.8))
    cmap = colormaps["viridis"]
    for ax, p in zip(axes[0], parametrizations, strict=True):
        best = best_lrs(results, p, widths, lrs)
        for i, width in enumerate(widths):
            color = cmap(i / max(len(widths) - 1, 1))
            ax.plot(
                lrs, [mean_loss(results, p, width, lr) for lr in lrs], "o-", color=color, label=f"H={width}"
            )
            ax.plot(
                [best[width]], [mean_loss(results, p, width, best[width])], "*", color=color, markersize=12
            )
        ax.set_xscale("log", base=2)
        ax.set_xticks(lrs, [f"{lr:g}" for lr in lrs], fontsize=7)
        ax.set_xlabel("lr (optimizer.lr)")
        ax.set_ylabel("final held-out loss (nats/token)")
        ax.set_title(f"{p}: best lr per width (stars)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, path)


lrs_arg = sorted_list(float, lambda v: 0 < v < math.inf, "positive numbers")


def main(argv: list[str] | None = None) -> None:
    parser = Parser(prog="python -m trmoe.bench lrtransfer", description=__doc__)
    parser.add_argument("--widths", type=widths_arg, default=[16, 32, 64, 128])
    parser.add_argument(
        "--lrs", type=lrs_arg, default=[1e-3 * 2**k for k in range(6)], help="default: 1e-3 x 2^k, k = 0..5"
    )
    parser.add_argument("--seeds", type=positive_int, default=2)
    parser.add_argument("--steps", type=positive_int, default=100)
    parser.add_argument("--batch", type=positive_int, default=4)
    parser.add_argument("--seq", type=positive_int, default=64)
    parser.add_argument("--layers", type=positive_int, default=2)
    parser.add_argument("--vocab", type=positive_int, default=2048)
    parser.add_argument(
        "--parametrization", choices=PARAMETRIZATIONS, nargs="+", default=list(PARAMETRIZATIONS)
    )
    parser.add_argument("--out", type=Path, help="write the results here (JSON)")
    parser.add_argument("--plot", type=Path, help="write the PNG here")
    args = parser.parse_args(argv)
    if args.vocab < 2:
        parser.error(f"--vocab: got {args.vocab}; allowed: a whole number >= 2")
    torch.set_num_threads(1)
    data = compact_corpus(args.vocab)
    results = []
    start = time.perf_counter()
    for p in args.parametrization:
        for width in args.widths:
            cfg, spec = arm(p, width, args.widths[0], vocab=args.vocab, layers=args.layers, seq=args.seq)
            for lr in args.lrs:
                for seed in range(args.seeds):
                    loss = train_one(
                        cfg, spec, lr, seed, data, steps=args.steps, batch=args.batch, seq=args.seq
                    )
                    results.append(
                        {"parametrization": p, "width": width, "lr": lr, "seed": seed, "loss": loss}
                    )
                    print(f"{p} H={width} lr={lr:g} seed={seed}: {loss:.4f}", flush=True)
    wall = time.perf_counter() - start
    summary = {}
    for p in args.parametrization:
        best = best_lrs(results, p, args.widths, args.lrs)
        index = [args.lrs.index(best[w]) for w in args.widths]
        summary[p] = {
            "best_lr": {str(w): best[w] for w in args.widths},
            "moves_grid_steps": max(index) - min(index),
        }
        print(f"{p}: best lr per width {best}; the optimum spans {max(index) - min(index)} grid step(s)")
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    payload = {"settings": settings, "wall_s": wall, "results": results, "summary": summary}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_file(args.out, json_text(payload, indent=1) + "\n")  # a diverged lr's loss: "NaN", valid JSON
    if args.plot:
        plot(results, args.parametrization, args.widths, args.lrs, args.plot)
    record("lrtransfer", payload)
    print(f"wall: {wall:.0f} s")
