"""`dispatch`: the routed branch's grouping overhead (sort, gather, scatter) as a share of FFN time.

The same FFN is timed twice, forward+backward: once through the real dispatch, once with the tokens
already grouped by expert (the expert GEMMs and the shared expert alone). The difference is what the
dispatch costs.
"""

from __future__ import annotations

import argparse
import functools

import torch

from trmoe.bench.common import record, time_interleaved
from trmoe.bench.ffn import LAYOUTS, _tr_ffn
from trmoe.model.moe import swiglu


def _real(ffn, x: torch.Tensor, ids: torch.Tensor) -> None:
    ffn.zero_grad(set_to_none=True)
    ffn(x, ids).sum().backward()


def _pregrouped(ffn, x: torch.Tensor, grouped: torch.Tensor, counts: list[int]) -> None:
    ffn.zero_grad(set_to_none=True)
    out = swiglu(x, ffn.shared.w_in, ffn.shared.w_out).sum()
    for e, rows in enumerate(grouped.split(counts)):
        out = out + swiglu(rows, ffn.routed.w_in[e], ffn.routed.w_out[e]).sum()
    out.backward()


def run(tokens: int, experts: int = 4, top_k: int = 2, reps: int = 7, device: str = "cpu") -> list[dict]:
    dev = torch.device(device)
    vocab = 200_019
    torch.manual_seed(0)
    results = []
    for name, (hidden, shared, routed) in LAYOUTS.items():
        ffn = _tr_ffn(hidden, shared, routed, experts, top_k, vocab).to(dev)
        x = torch.randn(tokens, hidden, device=dev, requires_grad=True)
        ids = torch.randint(0, vocab, (tokens,), device=dev)
        # The rows each expert receives, already contiguous: what an ideal (free) dispatch would hand over.
        routes = ffn.routed.route_table[:, ids].long().reshape(-1)
        counts = torch.bincount(routes, minlength=experts).tolist()
        grouped = torch.randn(sum(counts), hidden, device=dev, requires_grad=True)

        cases = {
            "dispatch": functools.partial(_real, ffn, x, ids),
            "pregrouped": functools.partial(_pregrouped, ffn, x, grouped, counts),
        }
        timings = time_interleaved(cases, dev, reps=reps)
        total, ideal = timings["dispatch"]["median_s"], timings["pregrouped"]["median_s"]
        results.append(
            record(
                "dispatch",
                {
                    "layout": name,
                    "device": device,
                    "tokens": tokens,
                    "experts": experts,
                    "top_k": top_k,
                    "timings": timings,
                    "overhead_share": (total - ideal) / total,
                },
            )
        )
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trmoe.bench dispatch", description=__doc__)
    parser.add_argument("--tokens", type=int, default=None, help="default: 2x2048 on CPU, 8x2048 on GPU")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args(argv)
    tokens = args.tokens or (8 * 2048 if args.device == "cuda" else 2 * 2048)
    for r in run(tokens, reps=args.reps, device=args.device):
        print(f"{r['layout']:>14}: dispatch overhead {r['overhead_share']:.1%} of FFN time")
