"""`dispatch`: the routed branch's grouping overhead (sort, gather, scatter) as a share of FFN time.

The same FFN is timed twice, forward+backward: once through the real dispatch, once with the tokens
already grouped by expert (the same grouped expert GEMMs and the shared expert alone). The difference is
what the dispatch costs.
"""

from __future__ import annotations

import functools

import torch

from trmoe.bench.common import layer_args, paired_ratio, record, time_interleaved
from trmoe.bench.ffn import layer_cases
from trmoe.model.moe import grouped_mm, silu_mul, swiglu


def _real(ffn, x: torch.Tensor, ids: torch.Tensor, grad: torch.Tensor) -> None:
    ffn.zero_grad(set_to_none=True)
    ffn(x, ids).backward(grad)


def _pregrouped(
    ffn,
    x: torch.Tensor,
    grouped: torch.Tensor,
    ends: torch.Tensor,
    grad: torch.Tensor,
    grad_rows: torch.Tensor,
) -> None:
    ffn.zero_grad(set_to_none=True)
    routed = grouped_mm(silu_mul(grouped_mm(grouped, ffn.routed.w_in, ends)), ffn.routed.w_out, ends)
    shared = swiglu(x, ffn.shared.w_in, ffn.shared.w_out)
    # dense upstream gradients, as inside a network (and as the real FFN's scatter hands its rows)
    torch.autograd.backward([shared, routed], [grad, grad_rows])


def run(
    tokens: int, experts: int = 4, top_k: int = 2, reps: int = 7, device: str = "cpu", dtype: str = "float32"
) -> list[dict]:
    dev, dt = torch.device(device), getattr(torch, dtype)
    results = []
    for name, (hidden, _, _), ffn, x, ids in layer_cases(tokens, experts, top_k, device, dtype):
        # The rows each expert receives, already contiguous: what an ideal (free) dispatch would hand over.
        routes = ffn.routed.route_table[:, ids].long().reshape(-1)
        ends = torch.bincount(routes, minlength=experts).cumsum(0)
        grouped = torch.randn(routes.numel(), hidden, device=dev, dtype=dt, requires_grad=True)

        grad = torch.randn_like(x).detach()
        grad_rows = torch.randn_like(grouped).detach()
        cases = {
            "dispatch": functools.partial(_real, ffn, x, ids, grad),
            "pregrouped": functools.partial(_pregrouped, ffn, x, grouped, ends, grad, grad_rows),
        }
        timings = time_interleaved(cases, dev, reps=reps)
        total, ideal = timings["dispatch"]["median_s"], timings["pregrouped"]["median_s"]
        results.append(
            record(
                "dispatch",
                {
                    "layout": name,
                    "device": device,
                    "dtype": dtype,
                    "tokens": tokens,
                    "experts": experts,
                    "top_k": top_k,
                    "timings": timings,
                    "overhead_share": (total - ideal) / total,
                    "paired_overhead_share": 1.0 - paired_ratio(timings, "pregrouped", "dispatch"),
                },
            )
        )
    return results


def main(argv: list[str] | None = None) -> None:
    args = layer_args("dispatch", __doc__, argv)
    for r in run(args.tokens, reps=args.reps, device=args.device, dtype=args.dtype):
        print(
            f"{r['layout']:>14}: dispatch overhead {r['overhead_share']:.1%} of FFN time "
            f"(by round {r['paired_overhead_share']:.1%})"
        )
