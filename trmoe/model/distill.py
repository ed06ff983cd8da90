"""routing=distilled: a fixed route table distilled from a trained router (Grouter, arXiv 2603.06626, 2026:
derive a fixed assignment from a trained MoE's router and train a new model with it frozen). It asks whether a
learned router is just a better table: the distilled arm keeps what the router chose per token id and drops
everything context-dependent.

One pass of the parent model (a run of routing=learned or learned_v3, in eval mode, no gradient) over M tokens
of the training split counts, per distilled layer l, token id t and expert e,

    c_l[t, e] = #{positions n of the pass with input id t at which parent layer l's router put e among its K}

and the child's table is, for the K route slots k = 0..K-1,

    seen t   (sum_e c_l[t, e] > 0):  r_k(t) = the (k+1)-th expert of t in the order
                                     (c_l[t, e] descending, then e ascending)   -- ties: the lower expert id
    unseen t:                        r_k(t) = balanced_hash's r_k(t) of layer l (routing.seed)

Slot 0 (the primary route, weight p) is the expert chosen most often. The K routes of a seen id are distinct:
each occurrence adds 1 to K distinct experts, so a seen id has at least K experts with a count >= 1, and the
order above is a strict total order over the E experts. The result is a route table like any other ([K, V],
ids in 0..E-1, checked by trmoe.model.routing.build_route_table) and is saved with the model's weights.

Here are the counting and the table (model and tensors only); finding the parent, the pass over the run's
data and the record are trmoe/distill.py's.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from trmoe.model.routing import DISTILL_FALLBACK, build_route_table

__all__ = ["count_routes", "distilled_table"]


@torch.no_grad()
def count_routes(
    model: torch.nn.Module, batches: Iterable[torch.Tensor], layers: Iterable[int]
) -> dict[int, torch.Tensor]:
    """c_l [V, E] (int64, on the model's device) of each router layer in `layers`: the parent `model`'s
    routes over `batches` (input ids [B, S] each). The model must route those layers by a router."""
    spec = model.spec
    vocab, experts = spec.vocab_size, spec.num_experts
    layers = list(layers)
    device = next(model.parameters()).device
    counts = {layer: torch.zeros(vocab * experts, dtype=torch.int64, device=device) for layer in layers}
    was_training = model.training
    model.eval()
    try:
        for ids in batches:
            ids = ids.to(device)
            model(ids)
            model.router_losses()  # the routers' loss terms of this forward: not needed, cleared
            flat = ids.reshape(-1).to(torch.int64)
            for layer in layers:
                routes = model.blocks[layer].ffn.routed._last_routes  # [K, N] of this forward
                if routes is None:
                    raise ValueError(f"layer {layer} of the parent routes by no router")
                code = flat[None, :] * experts + routes.to(torch.int64)  # (t, e) as one index
                counts[layer] += torch.bincount(code.reshape(-1), minlength=vocab * experts)
    finally:
        model.train(was_training)
    return {layer: c.view(vocab, experts) for layer, c in counts.items()}


def distilled_table(counts: torch.Tensor | np.ndarray, top_k: int, layer: int, seed: int) -> torch.Tensor:
    """Layer `layer`'s distilled table [K, V] from its counts c [V, E] (the module docstring's rule; the
    fallback is DISTILL_FALLBACK's table of (layer, seed)), checked and typed as every route table."""
    c = np.asarray(counts.cpu() if isinstance(counts, torch.Tensor) else counts, dtype=np.int64)
    vocab, experts = c.shape
    # a stable sort of -c keeps equal counts in expert order: the lower id first
    order = np.argsort(-c, axis=1, kind="stable")[:, :top_k].T  # [K, V]
    fallback = build_route_table(DISTILL_FALLBACK, vocab, experts, top_k, layer, seed).numpy()
    seen = c.sum(axis=1) > 0
    routes = np.where(seen[None, :], order, fallback)
    return build_route_table("distilled", vocab, experts, top_k, layer, seed, routes=routes)
