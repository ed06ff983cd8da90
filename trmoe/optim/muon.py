"""Muon for stacked expert matrices: momentum, orthogonalised per matrix slice by Newton-Schulz.

Not torch.optim.Muon: it refuses every parameter that is not 2-D (the [E, A, B] experts) and cannot split
the fused gate/up halves (tests/test_optimizers.py checks that this still holds).

For a parameter W with gradient G (the gradient already averaged over data-parallel ranks):

    B <- beta * B + (1 - beta) * G                       momentum buffer
    U  = (1 - beta) * G + beta * B    (nesterov)   or   U = B
    O  = NS(U_slice) for every matrix slice of U          see `orthogonalize`
    O  = O * rms * sqrt(max(rows, cols))                  update RMS ~ rms (0.2 ~ AdamW's typical update)
    W <- W * (1 - lr * wd) - lr * O

Slices: a 2-D parameter is one matrix; a 3-D parameter [E, A, B] (the routed experts) is E matrices
[A, B], one per expert, orthogonalised as a batch. A group with `split_gate_up` also splits the last
dimension in two halves (the fused SwiGLU w_in = [gate | up]) and orthogonalises each half on its own,
which is what separate gate and up matrices would get.

Only per-parameter math: no collectives, no internal warmup or decay (the one global schedule sets
`lr` through `base_lr`), no token-count statistics.
"""

from __future__ import annotations

import math

import torch

# Quintic Newton-Schulz coefficients (Keller Jordan's Muon): they push every singular value of a
# Frobenius-normalised matrix into roughly [0.7, 1.2] in five iterations.
NS_COEFFS = (3.4445, -4.7750, 2.0315)


def orthogonalize(u: torch.Tensor, steps: int) -> torch.Tensor:
    """u [..., A, B] -> the nearest semi-orthogonal matrices (approximately U V^T of each SVD), batched
    over the leading dims. bf16 on CUDA (fast, accurate enough for an update direction), fp32 elsewhere."""
    a, b, c = NS_COEFFS
    dtype = torch.bfloat16 if u.is_cuda else torch.float32
    x = u.to(dtype)
    transposed = x.shape[-2] > x.shape[-1]
    if transposed:  # iterate on the wide orientation: X X^T is the smaller Gram matrix
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    if transposed:
        x = x.mT
    return x.to(u.dtype)


def muon_direction(u: torch.Tensor, steps: int, rms: float, split_gate_up: bool) -> torch.Tensor:
    """The scaled orthogonalised update of one parameter (2-D matrix or 3-D stack of matrices)."""
    mats = u if u.dim() == 3 else u.unsqueeze(0)
    parts = mats.chunk(2, dim=-1) if split_gate_up else (mats,)
    out = []
    for part in parts:
        rows, cols = part.shape[-2:]
        out.append(orthogonalize(part, steps) * (rms * math.sqrt(max(rows, cols))))
    o = torch.cat(out, dim=-1) if split_gate_up else out[0]
    return o if u.dim() == 3 else o.squeeze(0)


class Muon(torch.optim.Optimizer):
    """Muon over 2-D / 3-D parameters. Group keys: lr, momentum, nesterov, ns_steps, update_rms,
    weight_decay, split_gate_up."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        update_rms: float = 0.2,
        weight_decay: float = 0.0,
        split_gate_up: bool = False,
    ):
        defaults = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            update_rms=update_rms,
            weight_decay=weight_decay,
            split_gate_up=split_gate_up,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() not in (2, 3):
                    raise ValueError(f"Muon takes matrices or stacks of matrices, got shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                    state["step"] = 0
                buf = state["momentum_buffer"]
                state["step"] += 1
                buf.lerp_(g, 1.0 - beta)  # B = beta B + (1 - beta) G
                u = g.lerp(buf, beta) if group["nesterov"] else buf  # (1 - beta) G + beta B
                o = muon_direction(u, group["ns_steps"], group["update_rms"], group["split_gate_up"])
                if wd != 0.0:
                    p.mul_(1.0 - lr * wd)
                p.add_(o, alpha=-lr)
        return loss
