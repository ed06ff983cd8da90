"""Routes hashed on the fly from a per-position route key: the context- and content-dependent hashes of Roller
et al. 2021 ("Hash Layers For Large Sparse Models", arXiv 2106.04426), without a table.

A table strategy (trmoe/model/routing.py) looks its routes up by the input token id. The strategies here
route on another integer of each position, its *route key*, hashed once per batch and layer (no ``V^2``
table for a bigram). With ``t_i`` the input id at position ``i`` of a row, ``y_i = t_{i+1}`` its target and
``FIRST = 2^32 - 1`` (no token id):

* ``prev``:      ``p_i = t_{i-1}``, and ``p_i = FIRST`` where the position is 0
* ``bigram``:    ``b_i = mix32(p_i ^ 0x27D4EB2F) ^ t_i``  (distinct over t_i for each p_i, and over p_i for
  each t_i: mix32 is a bijection)
* ``position``:  ``i``, the position in the row (the RoPE position: under left padding a row's first real
  token is position 0)
* ``target``:    ``y_i`` (analysis only: the targets exist on training and held-out loss forwards alone)

The first position rule: position 0 of every row has no previous token, whatever came before the row in the
token stream (a packed row is cut from it at a random place): its previous id is FIRST. Inside a row the
previous id is the stream's, across document boundaries too (the end-of-text separator is then the previous
token of a document's first token, as a BOS would be). The KV-cache decoder keeps each row's last id
(KVCache.last_ids), so a decoded position gets the previous id the full forward gives it.

The K routes of key ``x`` in a layer with salt ``s`` (trmoe.model.routing.layer_salt) are ``affine_hash``'s
formula with the key in place of the token id:

    base = mix32(x ^ s) mod E,   stride = units[mix32((x + (s ^ 0x85EBCA77)) mod 2^32) mod |units|],
    r_k  = (base + k * stride) mod E,

distinct over k (the stride is coprime with E). Balance is statistical. With the key a token id, the
routes are exactly affine_hash's table column (a test checks it).
"""

from __future__ import annotations

import numpy as np
import torch

from trmoe.model.routing import _C1, _C2, _STRIDE_SALT, _units

FIRST = 0xFFFFFFFF  # the previous id of position 0
_M32 = 0xFFFFFFFF
_BIGRAM_SALT = 0x27D4EB2F
# the key kinds (trmoe.model.routing.Strategy.key): token ids index a table, the others are hashed here
KEY_KINDS = ("token", "prev", "bigram", "position", "target")


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for int64 x in [0, 2^32): in two 16-bit halves of c, so that no product leaves int64
    (a signed overflow is not defined behaviour in the kernels)."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def mix32_torch(x: torch.Tensor) -> torch.Tensor:
    """trmoe.model.routing.mix32 on an int64 tensor (values taken mod 2^32), on any device."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = _mul32(x, _C1)
    x = x ^ (x >> 15)
    x = _mul32(x, _C2)
    return x ^ (x >> 16)


def route_keys(
    kind: str,
    token_ids: torch.Tensor,
    positions: torch.Tensor,
    before: torch.Tensor | None = None,
    targets: torch.Tensor | None = None,
) -> torch.Tensor:
    """The route keys [B, S] int64 of `kind` (see the module docstring) for token_ids [B, S] at `positions`
    (broadcastable to [B, S]); `before` [B]: the id just before each row's first column (the KV cache's last
    ids; None: FIRST), `targets` [B, S] for kind "target". Raises ValueError when kind is "target" and there
    are no targets."""
    if kind == "token":
        return token_ids
    if kind == "position":
        return positions.expand_as(token_ids).long()
    if kind == "target":
        if targets is None:
            raise ValueError(
                "routing on the target token (oracle_future_hash) needs the targets: only training and "
                "held-out loss forwards have them"
            )
        return targets.long()
    ids = token_ids.long()
    first = ids.new_full((ids.shape[0], 1), FIRST) if before is None else before.long().view(-1, 1)
    prev = torch.cat([first, ids[:, :-1]], dim=1)
    prev = torch.where(positions.expand_as(ids) == 0, FIRST, prev)
    if kind == "prev":
        return prev
    if kind == "bigram":
        return mix32_torch(prev ^ _BIGRAM_SALT) ^ ids
    raise ValueError(f"unknown route key kind {kind!r}; allowed: {', '.join(KEY_KINDS)}")


def hash_routes(
    keys: torch.Tensor, num_experts: int, top_k: int, salt: int, units: torch.Tensor
) -> torch.Tensor:
    """[K, N] int64 expert ids of keys [N] (int64 in [0, 2^32)): the affine hash above; `units` the integers
    in [1, E) coprime with E ([0] for E = 1), on the keys' device."""
    keys = keys.reshape(-1).long()
    base = mix32_torch(keys ^ salt) % num_experts
    stride = units[mix32_torch(keys + (salt ^ _STRIDE_SALT)) % units.shape[0]]
    k = torch.arange(top_k, device=keys.device).unsqueeze(1)
    return (base.unsqueeze(0) + k * stride.unsqueeze(0)) % num_experts


def units_tensor(num_experts: int) -> torch.Tensor:
    """The integers in [1, E) coprime with E ([0] for E = 1), as hash_routes takes them."""
    return torch.from_numpy(np.asarray(_units(num_experts), dtype=np.int64))
