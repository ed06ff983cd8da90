"""Causal self-attention with RoPE, per-head QK-norm, and GQA / MHA / MQA by key-value head count."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trmoe.model.kv_cache import KVCache


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * w, weight initialised to 1. Computed in fp32 for bf16/fp16/fp32 inputs
    (stability) and in fp64 for fp64 inputs (an fp64 check must not be capped at fp32's rounding)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.to(xf.dtype)).type_as(x)


def rope_cache(
    seq_len: int, head_dim: int, theta: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [seq_len, head_dim] for rotate-half RoPE over the full head dimension."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, S, d]: rotate each (i, i + d/2) pair by its position's angle."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).type_as(x)


class Attention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        qk_norm: bool = True,
        norm_eps: float = 1e-6,
        scale: float | None = None,
    ):
        super().__init__()
        self.scale = (
            scale  # the attention logits' scale; None = SDPA's 1/sqrt(head_dim) (muP: trmoe.model.mup)
        )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = hidden_size // num_heads
        # q, k and v in one GEMM; split after. Bias-free everywhere.
        self.qkv = nn.Linear(hidden_size, (num_heads + 2 * num_kv_heads) * self.head_dim, bias=False)
        self.out = nn.Linear(num_heads * self.head_dim, hidden_size, bias=False)
        # One RMSNorm weight of size head_dim for q and one for k, shared across heads.
        self.q_norm = RMSNorm(self.head_dim, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, norm_eps) if qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        """x [B, S, H] -> [B, S, H]. With a cache (decoding): the S new positions attend to the cached ones
        and to each other causally, and their keys and values join layer `layer`'s part of the cache."""
        B, S, _ = x.shape
        d, hq, hkv = self.head_dim, self.num_heads, self.num_kv_heads
        q, k, v = self.qkv(x).split([hq * d, hkv * d, hkv * d], dim=-1)
        q = q.view(B, S, hq, d).transpose(1, 2)
        k = k.view(B, S, hkv, d).transpose(1, 2)
        v = v.view(B, S, hkv, d).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # GQA/MQA: SDPA broadcasts each key/value head over its group of query heads.
        if cache is None:
            y = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=hkv != hq, scale=self.scale
            )
        else:
            mask = cache.mask(S)
            k, v = cache.append(layer, k, v)
            causal = mask is None and cache.length == 0
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=hkv != hq, scale=self.scale
            )
        return self.out(y.transpose(1, 2).reshape(B, S, hq * d))
