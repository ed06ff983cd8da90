"""The token-routed MoE FFN (TR-MoE):

    y = a * g_s * S(x)  +  b * g_r * sum_k w_k * E_{r_k(t)}(x)

S is the always-on shared SwiGLU expert (width shared_width, absent when 0); E_e are the E routed SwiGLU
experts of width routed_width / E; r_k(t) is the k-th expert of token id t in this layer's fixed route table;
w_0 = p and w_k = (1 - p) / (K - 1) for k >= 1; g_s, g_r are optional learnable scalar gates; a, b are fixed
output scales (optionally interpolated over depth by the caller).

Dispatch: each token runs through exactly its K experts. The (token, route) pairs are sorted by expert, each
expert does one matmul over its contiguous slice, and the weighted outputs are scattered back with one
index_add. Work is K x tokens expert rows, never E x tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from trmoe.model.routing import build_route_table


def swiglu(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor) -> torch.Tensor:
    """SwiGLU with the gate and up projections fused in w_in [H, 2W]; w_out [W, H]."""
    gate, up = (x @ w_in).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w_out


def route_weights(top_k: int, primary_weight: float) -> list[float]:
    """Fixed (input-independent) weights of the K routes: p for route 0, the rest split (1-p) evenly."""
    if top_k == 1:
        return [1.0]
    return [primary_weight] + [(1.0 - primary_weight) / (top_k - 1)] * (top_k - 1)


class SharedExpert(nn.Module):
    def __init__(self, hidden_size: int, width: int):
        super().__init__()
        self.w_in = nn.Parameter(torch.empty(hidden_size, 2 * width))  # [gate | up]
        self.w_out = nn.Parameter(torch.empty(width, hidden_size))
        # Memory, not math (trainer.shared_chunk_tokens): run this many tokens at a time, each chunk
        # recomputed in the backward, so its [n, 3W] intermediates never exist for all tokens at once.
        self.chunk_tokens = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.chunk_tokens
        if n <= 0 or x.shape[0] <= n:
            return swiglu(x, self.w_in, self.w_out)
        if not torch.is_grad_enabled():
            return torch.cat([swiglu(c, self.w_in, self.w_out) for c in x.split(n)])
        return torch.cat(
            [checkpoint(swiglu, c, self.w_in, self.w_out, use_reentrant=False) for c in x.split(n)]
        )


class RoutedExperts(nn.Module):
    """E SwiGLU experts stored as stacked tensors, plus this layer's route table [K, vocab]."""

    def __init__(
        self,
        hidden_size: int,
        routed_width: int,
        num_experts: int,
        top_k: int,
        primary_weight: float,
        vocab_size: int,
        layer: int,
        strategy: str,
        seed: int,
        hash_count: int,
    ):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        # The K route weights live in a small buffer (not saved: p is config or a pure function of the
        # step), so a p schedule changes no graph and costs no host-to-device copy per forward.
        self.register_buffer("route_w", torch.tensor(route_weights(top_k, primary_weight)), persistent=False)
        self._primary_weight = float(primary_weight)
        width = routed_width // num_experts
        self.w_in = nn.Parameter(torch.empty(num_experts, hidden_size, 2 * width))
        self.w_out = nn.Parameter(torch.empty(num_experts, width, hidden_size))
        # A persistent buffer: saved in every checkpoint, identical on every rank, never trained.
        if self.w_in.device.type == "meta":
            table = torch.empty(top_k, vocab_size, dtype=torch.uint8, device="meta")
        else:
            table = build_route_table(strategy, vocab_size, num_experts, top_k, layer, seed, hash_count)
        self.register_buffer("route_table", table)

    @property
    def primary_weight(self) -> float:
        """p, a plain float; setting it (a schedule, between steps) updates the route weights."""
        return self._primary_weight

    @primary_weight.setter
    def primary_weight(self, value: float) -> None:
        self._primary_weight = float(value)
        exact = torch.tensor(route_weights(self.top_k, value), dtype=torch.float64)
        with torch.no_grad():
            self.route_w.copy_(exact)  # rounded once, to the buffer's dtype

    def _apply(self, fn, recurse=True):
        # .double() / .to(dtype) would otherwise widen the rounded fp32 weights: rebuild them exactly
        super()._apply(fn, recurse)
        self.primary_weight = self._primary_weight
        return self

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """x [N, H], token_ids [N] -> [N, H]."""
        if self.num_experts == 1:  # dense control: every token to the single expert, weight 1
            return swiglu(x, self.w_in[0], self.w_out[0])
        n = x.shape[0]
        experts = self.route_table[:, token_ids].long().reshape(-1)  # [K*N], index = route * N + token
        order = torch.argsort(experts, stable=True)  # group (token, route) pairs by expert
        counts = torch.bincount(experts, minlength=self.num_experts).tolist()
        token_of, route_of = order % n, order // n
        xs = x.index_select(0, token_of)
        outs = [
            swiglu(rows, self.w_in[e], self.w_out[e]) for e, rows in enumerate(xs.split(counts)) if counts[e]
        ]
        out = torch.cat(outs)
        out = out * self.route_w.to(out.dtype)[route_of].unsqueeze(1)
        return out.new_zeros(n, out.shape[1]).index_add_(0, token_of, out)


class TRMoEFFN(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        shared_width: int,
        routed_width: int,
        num_experts: int,
        top_k: int,
        primary_weight: float,
        gates: bool,
        shared_gate_init: float,
        routed_gate_init: float,
        shared_scale: float,
        routed_scale: float,
        vocab_size: int,
        layer: int,
        strategy: str,
        seed: int,
        hash_count: int,
    ):
        super().__init__()
        self.shared = SharedExpert(hidden_size, shared_width) if shared_width > 0 else None
        self.routed = None
        if routed_width > 0:
            self.routed = RoutedExperts(
                hidden_size,
                routed_width,
                num_experts,
                top_k,
                primary_weight,
                vocab_size,
                layer,
                strategy,
                seed,
                hash_count,
            )
        self.shared_gate = (
            nn.Parameter(torch.tensor(float(shared_gate_init))) if gates and self.shared else None
        )
        self.routed_gate = (
            nn.Parameter(torch.tensor(float(routed_gate_init))) if gates and self.routed else None
        )
        self.shared_scale, self.routed_scale = shared_scale, routed_scale  # fixed, not trained

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x, token_ids = x.reshape(-1, shape[-1]), token_ids.reshape(-1)
        y = None
        if self.shared is not None:
            y = self.shared(x) * self.shared_scale
            if self.shared_gate is not None:
                y = y * self.shared_gate
        if self.routed is not None:
            r = self.routed(x, token_ids) * self.routed_scale
            if self.routed_gate is not None:
                r = r * self.routed_gate
            y = r if y is None else y + r
        return y.reshape(shape)
