"""The expert-diversity penalty (loss.diversity_weight > 0): how alike the experts of a layer are.

For each layer and each compared matrix kind (w_out; with loss.diversity_target=all also the gate and
the up half of w_in), every expert's matrix is flattened and L2-normalised, and the penalty is the mean
squared cosine between different experts:

    div_m = sum_{i != j} cos(W_i, W_j)^2 / (E^2 - E)

averaged over matrix kinds and layers. 0 when all experts are mutually orthogonal, 1 when identical (up
to sign). The objective gets lambda(step) * div; it never changes routing. Weights only: every rank
computes the same value, so under DDP the averaged gradient is exactly lambda * d(div)/dW. Under FSDP the
expert weights are sharded DTensors: the penalty is computed from their full tensors (a differentiable
all-gather per matrix, once per step), so it is a plain tensor, the single-process value, and its backward
leaves on each rank the gradient of its own shard, added to FSDP's reduced one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trmoe.config.schema import DiversityTarget


def _mean_sq_offdiag_cosine(w: torch.Tensor) -> torch.Tensor:
    e = w.shape[0]
    v = F.normalize(w.reshape(e, -1).float(), dim=1)
    gram = v @ v.t()
    off = gram.pow(2).sum() - gram.diagonal().pow(2).sum()
    return off / (e * e - e)


def _full(w: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP-sharded DTensor parameter, differentiable (its gradient, the same on every
    rank, goes back to each rank's shard without a reduction); a plain tensor as it is."""
    return w.full_tensor() if hasattr(w, "full_tensor") else w


def expert_diversity(model: nn.Module, target: DiversityTarget = DiversityTarget.w_out) -> torch.Tensor:
    """The penalty of `model` (differentiable, a plain tensor); 0 when no layer has two or more routed
    experts."""
    terms = []
    for block in model.blocks:
        routed = block.ffn.routed
        if routed is None or routed.num_experts < 2:
            continue
        terms.append(_mean_sq_offdiag_cosine(_full(routed.w_out)))
        if target == DiversityTarget.all:
            gate, up = _full(routed.w_in).chunk(2, dim=-1)
            terms += [_mean_sq_offdiag_cosine(gate), _mean_sq_offdiag_cosine(up)]
    if not terms:
        weight = model.embed.weight
        return torch.zeros((), dtype=weight.dtype, device=weight.device)  # plain under FSDP too
    return torch.stack(terms).mean()
