"""`ffn`: forward+backward of the TR-MoE FFN vs dense SwiGLUs of the same stored and the same active width.

The widths are the 100m profile's, the matched pilot's (TR-GQA vs dense 1,648) and the routing ablations'
(panel A: 768 + 4 x 192). Target: TR time <= 1.0x the stored-width dense layer and <= 1.10x the
active-width one. `--compile` times all three through `torch.compile` (inductor), as training with
`trainer.compile=true` runs them: on a GPU that fuses the small elementwise kernels these launch-bound layers
spend much of their time in.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch

from trmoe.bench.common import LayerBench, layer_args, paired_ratio, record, time_interleaved
from trmoe.config.schema import HardwareConfig
from trmoe.data.tokenizer import O200K_VOCAB
from trmoe.model.moe import SharedExpert, TRMoEFFN
from trmoe.model.spec import ffn_spec
from trmoe.runtime import env

LAYOUTS = {  # name: (hidden, shared width, routed width)
    "100m": (384, 1536, 128),
    "matched_pilot": (384, 1392, 256),
    "panel_a": (384, 768, 768),
}


def tr_ffn(
    hidden: int,
    shared: int,
    routed: int,
    experts: int,
    top_k: int,
    vocab: int,
    *,
    strategy: str = "modulo_cyclic",
    std: float = 0.02,
) -> TRMoEFFN:
    """A TR-MoE FFN with gates on (p = 0.5), its matrices drawn from N(0, std)."""
    spec = ffn_spec(
        hidden_size=hidden,
        shared_width=shared,
        routed_width=routed,
        num_experts=experts,
        top_k=top_k,
        primary_weight=0.5,
        gates=True,
        vocab_size=vocab,
        strategy=strategy,
    )
    ffn = TRMoEFFN(spec, layer=0)
    for p in ffn.parameters():
        if p.ndim >= 2:
            torch.nn.init.normal_(p, 0.0, std)
    return ffn


def _dense(hidden: int, width: int) -> SharedExpert:
    layer = SharedExpert(hidden, width)
    for p in layer.parameters():
        torch.nn.init.normal_(p, 0.0, 0.02)
    return layer


def _fwd_bwd(module: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor, *args: torch.Tensor) -> None:
    """Forward + backward with a dense upstream gradient, as inside a network (the gradient of .sum() is an
    expanded stride-0 tensor, which sends the backward's gathers and GEMMs down slower paths)."""
    module.zero_grad(set_to_none=True)
    x.grad = None
    module(x, *args).backward(grad)


VOCAB = O200K_VOCAB


def layer_cases(
    opts: LayerBench,
) -> Iterator[tuple[str, tuple[int, int, int], TRMoEFFN, torch.Tensor, torch.Tensor]]:
    """For each layout: (name, (hidden, shared, routed), a TR FFN of those widths, inputs x [tokens, hidden]
    that take gradients, token ids), on the device in the dtype of `opts`; seeded, so every benchmark sees
    the same. The process gets the train loop's default hardware settings (deterministic algorithms, host
    memory reuse)."""
    dev, dt = torch.device(opts.device), getattr(torch, opts.dtype)
    env.configure(HardwareConfig(), dev)  # the process as a training run sets it up by default
    torch.manual_seed(0)
    for name, widths in LAYOUTS.items():
        tr = tr_ffn(*widths, opts.experts, opts.top_k, VOCAB, strategy=opts.strategy).to(dev, dt)
        x = torch.randn(opts.tokens, widths[0], device=dev, dtype=dt, requires_grad=True)
        yield name, widths, tr, x, torch.randint(0, VOCAB, (opts.tokens,), device=dev)


def run(opts: LayerBench) -> list[dict]:
    dev, dt = torch.device(opts.device), getattr(torch, opts.dtype)
    results = []
    for name, (hidden, shared, routed), tr, x, ids in layer_cases(opts):
        active = shared + opts.top_k * routed // opts.experts
        dense_stored = _dense(hidden, shared + routed).to(dev, dt)
        dense_active = _dense(hidden, active).to(dev, dt)

        grad = torch.randn_like(x).detach()
        layers = {"tr": tr, "dense_stored": dense_stored, "dense_active": dense_active}
        if opts.compile:  # compiled on the first of the warm-up calls, which are not timed
            layers = {case: torch.compile(layer) for case, layer in layers.items()}
        cases = {
            case: functools.partial(_fwd_bwd, layer, x, grad, *([ids] if case == "tr" else []))
            for case, layer in layers.items()
        }
        timings = time_interleaved(cases, dev, reps=opts.reps)
        tr_s = timings["tr"]["median_s"]
        results.append(
            record(
                "ffn",
                {
                    "layout": name,
                    **opts.fields(),
                    "hidden": hidden,
                    "shared_width": shared,
                    "routed_width": routed,
                    "grouped_by": "route tuple" if tr.routed.route_tuples is not None else "expert",
                    "stored_width": shared + routed,
                    "active_width": active,
                    "ideal_ratio_vs_stored": active / (shared + routed),
                    "timings": timings,
                    "ratio_vs_dense_stored": tr_s / timings["dense_stored"]["median_s"],
                    "ratio_vs_dense_active": tr_s / timings["dense_active"]["median_s"],
                    "paired_ratio_vs_dense_stored": paired_ratio(timings, "tr", "dense_stored"),
                    "paired_ratio_vs_dense_active": paired_ratio(timings, "tr", "dense_active"),
                },
            )
        )
    return results


def main(argv: list[str] | None = None) -> None:
    for r in run(layer_args("ffn", __doc__, argv, compiles=True)):
        stored, active = r["paired_ratio_vs_dense_stored"], r["paired_ratio_vs_dense_active"]
        print(
            f"{r['layout']:>14}: TR {r['timings']['tr']['median_s'] * 1e3:7.2f} ms | "
            f"vs dense stored {r['ratio_vs_dense_stored']:.3f}x (by round {stored:.3f}, "
            f"ideal {r['ideal_ratio_vs_stored']:.3f}) | vs dense active {r['ratio_vs_dense_active']:.3f}x "
            f"(by round {active:.3f})"
        )
