"""The keys and values of the tokens seen so far, for incremental decoding (trmoe.generate).

    step t:  q_t, k_t, v_t = proj(x_t);  K = [K | k_t];  V = [V | v_t];  y_t = softmax(q_t Kᵀ / √d) V

Only attention mixes positions (the FFN, norms and head act on each position alone), so a decoder step needs
the new positions' rows plus every layer's K and V of the earlier ones: one row of work per layer per new
token instead of a full recompute. Keys are stored after QK-norm and RoPE, exactly as the full forward
computes them. Prompts of different lengths share a batch left-padded: row b's first `pad[b]` slots are
padding, its real tokens take positions 0, 1, ... (RoPE) and no real query attends to a padding key. The
cache also keeps each row's last token id: a layer that routes on the previous id (bigram_hash,
prev_token_hash: trmoe.model.context_routing) reads it at the next step.
"""

from __future__ import annotations

import torch


class KVCache:
    """Per layer K and V [B, kv_heads, capacity, head_dim]; `length` slots filled (padding included)."""

    def __init__(
        self,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        pad: torch.Tensor | None = None,
    ):
        shape = (batch, num_kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.capacity = capacity
        self.length = 0
        self.last_ids: torch.Tensor | None = None  # [B]: the id in each row's last filled slot
        self._mask: tuple[tuple[int, int], torch.Tensor] | None = None
        # left padding per row ([B] int64), None when every row starts at slot 0
        self.pad = None if pad is None or not bool(pad.any()) else pad.to(device=device, dtype=torch.long)

    def positions(self, new: int) -> torch.Tensor:
        """RoPE positions [B, new] of the next `new` slots (a row's padding slots get position 0)."""
        device = self.keys[0].device if self.keys else "cpu"
        slots = torch.arange(self.length, self.length + new, device=device).unsqueeze(0)
        if self.pad is None:
            return slots
        return (slots - self.pad.unsqueeze(1)).clamp_min(0)

    def mask(self, new: int) -> torch.Tensor | None:
        """The attention mask [B, 1, new, length + new] (True = attend) of the next `new` queries; None when
        plain causal attention is right (no padding, and either nothing cached or a single query)."""
        if self.pad is None and (self.length == 0 or new == 1):
            return None
        if self._mask is not None and self._mask[0] == (self.length, new):
            return self._mask[1]  # every layer asks for the same one
        device = self.keys[0].device
        query = torch.arange(self.length, self.length + new, device=device).view(1, 1, new, 1)
        key = torch.arange(self.length + new, device=device).view(1, 1, 1, -1)
        allowed = key <= query
        if self.pad is not None:
            real = key >= self.pad.view(-1, 1, 1, 1)
            allowed = allowed & (real | (key == query))  # a padding query sees itself: no empty softmax row
        self._mask = ((self.length, new), allowed)
        return allowed

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, kv_heads, new, d] of `layer` after the filled slots; return its K, V so far."""
        end = self.length + k.shape[2]
        if end > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} positions, {end} requested")
        self.keys[layer][:, :, self.length : end] = k
        self.values[layer][:, :, self.length : end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def advance(self, new: int, last_ids: torch.Tensor | None = None) -> None:
        """The `new` slots every layer appended are now part of the cache; `last_ids` [B] the ids in their
        last slot."""
        self.length += new
        if last_ids is not None:
            self.last_ids = last_ids
