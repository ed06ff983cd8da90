"""`dispatch`: the routed branch's grouping overhead (sort, gather, scatter) as a share of FFN time.

The same FFN is timed twice, forward+backward: once through the real dispatch, once with its rows already
grouped (the same grouped expert GEMMs and the shared expert alone). The difference is what the dispatch
costs. Rows are grouped as the layer groups them (trmoe/model/moe.py): by route tuple (modulo_cyclic, the
default: N rows, pre-gathered [H, 2KW] tuple weights, so gathering those weights counts as dispatch) or
by expert (K x N rows).
"""

from __future__ import annotations

import functools

import torch

from trmoe.bench.common import LayerBench, layer_args, paired_ratio, record, time_interleaved
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
    weights: tuple[torch.Tensor, torch.Tensor],
    grad: torch.Tensor,
    grad_rows: torch.Tensor,
) -> None:
    ffn.zero_grad(set_to_none=True)
    for w in weights:
        w.grad = None
    routed = grouped_mm(silu_mul(grouped_mm(grouped, weights[0], ends)), weights[1], ends)
    shared = swiglu(x, ffn.shared.w_in, ffn.shared.w_out)
    # dense upstream gradients, as inside a network (and as the real FFN's scatter hands its rows)
    torch.autograd.backward([shared, routed], [grad, grad_rows])


def run(opts: LayerBench) -> list[dict]:
    dev, dt = torch.device(opts.device), getattr(torch, opts.dtype)
    results = []
    for name, (hidden, _, _), ffn, x, ids in layer_cases(opts):
        # The rows each group receives, already contiguous: what an ideal (free) dispatch would hand over.
        routed = ffn.routed
        if routed.route_tuples is not None:  # by route tuple: one row per token, K experts side by side
            groups = routed.tuple_of[ids].long()
            c, k = routed.route_tuples.shape
            w_in, w_out = routed.w_in.shape[2] // 2 * k, routed.w_out.shape[1] * k
            weights = (
                (0.02 * torch.randn(c, hidden, 2 * w_in, device=dev, dtype=dt)).requires_grad_(),
                (0.02 * torch.randn(c, w_out, hidden, device=dev, dtype=dt)).requires_grad_(),
            )
        else:  # by expert: one row per (token, route)
            groups, c, weights = (
                routed.route_table[:, ids].long().reshape(-1),
                opts.experts,
                (routed.w_in, routed.w_out),
            )
        ends = torch.bincount(groups, minlength=c).cumsum(0).to(torch.int32)  # as the dispatch makes them
        grouped = torch.randn(groups.numel(), hidden, device=dev, dtype=dt, requires_grad=True)

        grad = torch.randn_like(x).detach()
        grad_rows = torch.randn_like(grouped).detach()
        cases = {
            "dispatch": functools.partial(_real, ffn, x, ids, grad),
            "pregrouped": functools.partial(_pregrouped, ffn, x, grouped, ends, weights, grad, grad_rows),
        }
        timings = time_interleaved(cases, dev, reps=opts.reps)
        total, ideal = timings["dispatch"]["median_s"], timings["pregrouped"]["median_s"]
        results.append(
            record(
                "dispatch",
                {
                    "layout": name,
                    **opts.fields(),
                    "grouped_by": "route tuple" if routed.route_tuples is not None else "expert",
                    "timings": timings,
                    "overhead_share": (total - ideal) / total,
                    "paired_overhead_share": 1.0 - paired_ratio(timings, "pregrouped", "dispatch"),
                },
            )
        )
    return results


def main(argv: list[str] | None = None) -> None:
    for r in run(layer_args("dispatch", __doc__, argv)):
        print(
            f"{r['layout']:>14}: dispatch (by {r['grouped_by']}) {r['overhead_share']:.1%} of FFN time "
            f"(by round {r['paired_overhead_share']:.1%})"
        )
