"""`loss`: peak memory and time of the tied-head loss paths vs full logits, vocab 200,019.

Each case (a loss backend of the train loop, or full logits) runs in its own subprocess so its peak memory
is its own: resident memory (ru_maxrss) on CPU, torch.cuda.max_memory_allocated on GPU. The extra memory
of a case is that peak minus what the process held before the loss (its inputs) and minus the gradients
of h and W, which every path returns. Target: the chunked path's extra peak <= 2 x chunk_tokens x vocab x
4 bytes, independent of the number of tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time

import torch

from trmoe import cli
from trmoe.bench.common import Parser, add_device, positive_int, record
from trmoe.config.schema import LossBackend
from trmoe.data.tokenizer import O200K_VOCAB
from trmoe.durable import json_text

VOCAB = O200K_VOCAB
KINDS = (*(b.value for b in LossBackend), "full")  # the train loop's loss backends, and full logits


def _case(kind: str, tokens: int, hidden: int, chunk: int, device: str) -> dict:
    """One loss path, forward and backward, through the loss backends the train loop uses."""
    from trmoe.config.schema import LossConfig
    from trmoe.loss.backend import resolve_backend, training_loss
    from trmoe.loss.tied import full_logits_ce

    dev = torch.device(device)
    torch.manual_seed(0)
    h = torch.randn(tokens, hidden, device=dev, requires_grad=True)
    w = (torch.randn(VOCAB, hidden, device=dev) * 0.02).requires_grad_()
    y = torch.randint(0, VOCAB, (tokens,), device=dev)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if kind == "full":
        fn, backend = full_logits_ce, "full"
    else:
        cfg = LossConfig(chunk_tokens=chunk, backend=LossBackend(kind))
        backend = resolve_backend(cfg, dev).value  # auto: as a run on this device resolves it
        fn = training_loss(cfg, LossBackend(backend))
    start = time.perf_counter()
    (fn(h, w, y).total / tokens).backward()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    elapsed = time.perf_counter() - start
    # the gradients of h and W are outputs every path must hold: not counted as the loss's extra memory
    grads = h.numel() * h.element_size() + w.numel() * w.element_size()
    return {"seconds": elapsed, "extra_peak_bytes": peak - base - grads, "device": device, "backend": backend}


def run(
    token_counts: list[int], hidden: int, chunk: int, kinds: list[str], max_gb: float, device: str = "cpu"
) -> list[dict]:
    results = []
    for tokens in token_counts:
        for kind in kinds:
            full_bytes = 3 * tokens * VOCAB * 4  # logits, softmax grad, a temporary
            if kind == "full" and full_bytes > max_gb * 2**30:
                results.append(
                    record(
                        "loss",
                        {"kind": kind, "tokens": tokens, "skipped": f"needs ~{full_bytes / 2**30:.0f} GB"},
                    )
                )
                continue
            out = subprocess.run(
                [sys.executable, "-m", "trmoe.bench.loss", "--child", kind, str(tokens), str(hidden)]
                + [str(chunk), device],
                capture_output=True,
                text=True,
            )
            if out.returncode != 0:  # e.g. a backend this torch or machine lacks: say so, go on
                reason = (out.stderr.strip().splitlines() or ["no output"])[-1]
                results.append(record("loss", {"kind": kind, "tokens": tokens, "skipped": reason}))
                continue
            measured = json.loads(out.stdout.strip().splitlines()[-1])
            bound = 2 * chunk * VOCAB * 4
            results.append(
                record(
                    "loss",
                    {
                        "kind": kind,
                        "tokens": tokens,
                        "hidden": hidden,
                        "vocab": VOCAB,
                        "chunk_tokens": chunk if kind == "chunked" else None,
                        **measured,
                        "chunked_bound_bytes": bound if kind == "chunked" else None,
                    },
                )
            )
    return results


def _positive_gb(text: str) -> float:
    """argparse type of --max-gb: a finite number > 0 (nan would never skip, a negative one always)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"got {text!r}; allowed: a finite number > 0, e.g. 12")
    return value


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--child":
        kind, tokens, hidden, chunk, device = argv[1], int(argv[2]), int(argv[3]), int(argv[4]), argv[5]
        print(json_text(_case(kind, tokens, hidden, chunk, device)))
        return
    parser = Parser(prog="python -m trmoe.bench loss", description=__doc__)
    parser.add_argument("--tokens", type=positive_int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--hidden", type=positive_int, default=384)
    parser.add_argument("--chunk", type=positive_int, default=2048)
    parser.add_argument(
        "--kinds", nargs="+", choices=KINDS, help="default: chunked torch full, +liger on GPU"
    )
    add_device(parser)
    parser.add_argument(
        "--max-gb", type=_positive_gb, default=12.0, help="skip full logits needing more than this (GiB, > 0)"
    )
    args = parser.parse_args(argv)
    gpu = args.device.startswith("cuda")
    kinds = ["chunked", "torch", "full", *(["liger"] if gpu else [])] if args.kinds is None else args.kinds
    for r in run(args.tokens, args.hidden, args.chunk, kinds, args.max_gb, args.device):
        if "skipped" in r:
            print(f"{r['kind']:>8} {r['tokens']:>6} tokens: skipped ({r['skipped']})")
        else:
            print(
                f"{r['kind']:>8} {r['tokens']:>6} tokens: {r['seconds']:.2f} s, extra peak "
                f"{r['extra_peak_bytes'] / 2**20:,.0f} MiB"
            )


if __name__ == "__main__":
    sys.exit(cli.run(main))
