"""A TR-Hash MoE decoder exported by trmoe: trmoe's model math, standalone (torch + transformers only).

    h = embed(t)
    for each layer:  h = h + Attn(RMSNorm(h));  h = h + FFN(RMSNorm(h), t)
    logits = RMSNorm(h) @ embedᵀ                                   (tied head)

    FFN(x, t) = a·g_s·S(x) + b·g_r·Σ_k w_k·E_{r_k(t)}(x)
    S, E_e: SwiGLU (silu(x W_g) ⊙ x W_u) W_d, gate and up fused as w_in = [W_g | W_u]
    r_k(t): expert k of input token id t in the layer's fixed route table ([K, vocab], model.safetensors);
            or, with config.route_key other than "token", the affine hash of the position's route key
            (the previous id, the (previous, current) pair or the position; trmoe/model/context_routing.py
            has the formulas and this file repeats them, standalone):
              base = mix32(x ^ s) mod E, stride = units[mix32(x + (s ^ 0x85EBCA77)) mod |units|],
              r_k = (base + k stride) mod E, s = config.route_salts[layer]
    w_0 = p, w_k = (1 - p)/(K - 1);  g: learnable scalar gates;  a, b: fixed per-layer scales
    config.combine == "learned" (DeepSeek-V4's gate): w_k = c_{r_k} / Σ_j c_{r_j}, c = sqrt(softplus(x W_cᵀ))
            (fp32), W_c [E, H] the layer's combine_gate; the routes stay the table's
    a layer in config.dense_layers: FFN(x) = a·S'(x), one SwiGLU of width shared_width + K·routed_width/E
            (the routed layers' active width), no routed experts, no gates

Attention: bias-free fused q/k/v, per-head RMSNorm on q and k, rotate-half RoPE over the full head dimension,
causal SDPA with key/value heads shared by groups of query heads. Decoding uses transformers' Cache.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_trmoe import TRMoEConfig

# transformers renamed past_key_values to cache (5.2x); take and return whichever this version uses
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


_M32 = 0xFFFFFFFF
FIRST = 0xFFFFFFFF  # the previous id of position 0


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """x ^= x>>16; x *= 0x7FEB352D; x ^= x>>15; x *= 0x846CA68B; x ^= x>>16 (mod 2^32), int64 tensors."""
    x = x & _M32
    x = _mul32(x ^ (x >> 16), 0x7FEB352D)
    x = _mul32(x ^ (x >> 15), 0x846CA68B)
    return x ^ (x >> 16)


def route_keys(kind: str, ids: torch.Tensor, positions: torch.Tensor, before: torch.Tensor | None):
    """[B, S] route keys: the ids ("token"), the previous id ("prev"; FIRST at position 0), the pair
    mix32(prev ^ 0x27D4EB2F) ^ id ("bigram"), or the position ("position")."""
    if kind == "token":
        return ids
    if kind == "position":
        return positions.expand_as(ids).long()
    first = ids.new_full((ids.shape[0], 1), FIRST) if before is None else before.view(-1, 1)
    prev = torch.where(positions.expand_as(ids) == 0, FIRST, torch.cat([first, ids[:, :-1]], dim=1))
    if kind == "prev":
        return prev
    if kind == "bigram":
        return mix32(prev ^ 0x27D4EB2F) ^ ids
    raise ValueError(f"route_key {kind!r}: this exported model code knows token, prev, bigram, position")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).type_as(x)


def rope(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, 1, S, head_dim] of positions [B, S]."""
    exponents = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    angles = positions.float().unsqueeze(-1) * inv_freq
    angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos.to(x.dtype) + rotated * sin.to(x.dtype)).type_as(x)


def swiglu(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor) -> torch.Tensor:
    gate, up = (x @ w_in).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w_out


class Attention(nn.Module):
    def __init__(self, config: TRMoEConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        d, hq, hkv = self.head_dim, self.num_heads, self.num_kv_heads
        self.qkv = nn.Linear(config.hidden_size, (hq + 2 * hkv) * d, bias=False)
        self.out = nn.Linear(hq * d, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x, cos, sin, mask, cache: Cache | None):
        B, S, _ = x.shape
        d, hq, hkv = self.head_dim, self.num_heads, self.num_kv_heads
        q, k, v = self.qkv(x).split([hq * d, hkv * d, hkv * d], dim=-1)
        q = q.view(B, S, hq, d).transpose(1, 2)
        k = k.view(B, S, hkv, d).transpose(1, 2)
        v = v.view(B, S, hkv, d).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        causal = mask is None and k.shape[2] == S and S > 1
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=hkv != hq)
        return self.out(y.transpose(1, 2).reshape(B, S, hq * d))


class SharedExpert(nn.Module):
    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.w_in = nn.Parameter(torch.empty(hidden, 2 * width))
        self.w_out = nn.Parameter(torch.empty(width, hidden))


class RoutedExperts(nn.Module):
    def __init__(self, config: TRMoEConfig, layer_idx: int):
        super().__init__()
        E, H, W = config.num_experts, config.hidden_size, config.routed_width // config.num_experts
        self.w_in = nn.Parameter(torch.empty(E, H, 2 * W))
        self.w_out = nn.Parameter(torch.empty(E, W, H))
        table_dtype = torch.uint8 if E <= 256 else torch.int16
        self.salt = None
        if config.route_key == "token":
            shape = (config.num_experts_per_tok, config.vocab_size)
            self.register_buffer("route_table", torch.zeros(shape, dtype=table_dtype))
        else:
            self.route_table, self.salt = None, config.route_salts[layer_idx]
            # a plain list: transformers builds the model on the meta device, where a buffer that is not in
            # the weights file would stay unset
            self.units = [u for u in range(1, E) if math.gcd(u, E) == 1] or [0]
        K, p = config.num_experts_per_tok, config.primary_weight
        self.route_weights = [1.0] if K == 1 else [p] + [(1.0 - p) / (K - 1)] * (K - 1)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor, factor, gate=None) -> torch.Tensor:
        """x [N, H], token_ids [N] -> factor · Σ_k w_k E_{r_k(t)}(x): each token through its K experts; the
        w_k from `gate` (the layer's learned combine gate, an nn.Linear) when given, else p."""
        out = torch.zeros_like(x)
        routes = self.routes(token_ids, x.device)
        weights = None
        if gate is not None:  # sqrt(softplus(logits)) of the K routed experts, normalised over them
            logits = gate(x).float()
            g = F.softplus(logits).sqrt().gather(1, routes.t())  # [N, K]
            weights = (g / g.sum(-1, keepdim=True).clamp_min(torch.finfo(g.dtype).tiny)).to(x.dtype)
        for k, weight in enumerate(self.route_weights):
            for e in range(self.w_in.shape[0]):
                rows = (routes[k] == e).nonzero().squeeze(-1)
                if rows.numel():
                    if weights is None:
                        y = swiglu(x[rows], self.w_in[e], self.w_out[e] * (weight * factor))
                    else:
                        y = swiglu(x[rows], self.w_in[e], self.w_out[e] * factor) * weights[rows, k : k + 1]
                    out.index_add_(0, rows, y)
        return out

    def routes(self, token_ids: torch.Tensor, device) -> torch.Tensor:
        """[K, N] expert ids of the route keys token_ids [N]: the table's, or the hashed key's."""
        if self.salt is None:
            return self.route_table[:, token_ids].long()  # [K, N]
        else:  # token_ids are the route keys here
            base = mix32(token_ids ^ self.salt) % self.w_in.shape[0]
            units = torch.tensor(self.units, device=device)
            stride = units[mix32(token_ids + (self.salt ^ 0x85EBCA77)) % units.shape[0]]
            k = torch.arange(len(self.route_weights), device=device).unsqueeze(1)
            routes = (base + k * stride) % self.w_in.shape[0]
        return routes


class FFN(nn.Module):
    def __init__(self, config: TRMoEConfig, layer_idx: int):
        super().__init__()
        dense = layer_idx in config.dense_layers  # the shared SwiGLU widened by K experts' width, no routes
        width = config.shared_width
        if dense:
            width += config.num_experts_per_tok * (config.routed_width // config.num_experts)
        self.shared = SharedExpert(config.hidden_size, width) if width > 0 else None
        self.routed = RoutedExperts(config, layer_idx) if config.routed_width > 0 and not dense else None
        learned = config.combine == "learned" and self.routed is not None and config.num_experts > 1
        self.combine_gate = nn.Linear(config.hidden_size, config.num_experts, bias=False) if learned else None
        gated = config.gates and self.shared is not None and self.routed is not None
        self.shared_gate = nn.Parameter(torch.ones(())) if gated else None
        self.routed_gate = nn.Parameter(torch.ones(())) if gated else None
        self.shared_scale = config.shared_scales[layer_idx]
        self.routed_scale = config.routed_scales[layer_idx]

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x, token_ids = x.reshape(-1, shape[-1]), token_ids.reshape(-1)
        y = torch.zeros_like(x)
        if self.shared is not None:
            factor = self.shared_scale * (1.0 if self.shared_gate is None else self.shared_gate.to(x.dtype))
            y = y + swiglu(x, self.shared.w_in, self.shared.w_out * factor)
        if self.routed is not None:
            factor = self.routed_scale * (1.0 if self.routed_gate is None else self.routed_gate.to(x.dtype))
            y = y + self.routed(x, token_ids, factor, self.combine_gate)
        return y.reshape(shape)


class Block(nn.Module):
    def __init__(self, config: TRMoEConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, layer_idx)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn = FFN(config, layer_idx)

    def forward(self, h, token_ids, cos, sin, mask, cache):
        h = h + self.attn(self.attn_norm(h), cos, sin, mask, cache)
        return h + self.ffn(self.ffn_norm(h), token_ids)


class TRMoEPreTrainedModel(PreTrainedModel):
    config_class = TRMoEConfig
    base_model_prefix = "model"
    _no_split_modules = ["Block"]
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        # only for weights a checkpoint lacks (a fresh model): N(0, 0.02), norms and gates 1
        for p in module.parameters(recurse=False):
            if p.ndim >= 2:
                nn.init.normal_(p, 0.0, 0.02)
            else:
                nn.init.ones_(p)


class TRMoEModel(TRMoEPreTrainedModel):
    def __init__(self, config: TRMoEConfig):
        super().__init__(config)
        self.embed = nn.Embedding(config.embedding_rows, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache: Cache | None = None):
        B, S = input_ids.shape
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            if attention_mask is not None:  # left padding: each row's real tokens start at position 0
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)[:, -S:]
            else:
                position_ids = torch.arange(past, past + S, device=input_ids.device).expand(B, S)
        cos, sin = rope(
            position_ids, self.config.hidden_size // self.config.num_attention_heads, self.config.rope_theta
        )
        mask = None
        if (attention_mask is not None and not bool(attention_mask.all())) or (past > 0 and S > 1):
            query = torch.arange(past, past + S, device=input_ids.device).view(1, 1, S, 1)
            key = torch.arange(past + S, device=input_ids.device).view(1, 1, 1, -1)
            mask = key <= query
            if attention_mask is not None:
                real = attention_mask[:, -(past + S) :].bool().view(B, 1, 1, -1)
                mask = mask & (real | (key == query))
        # a route key reading the previous id takes, at a decoding step, the last id of the call before
        before = getattr(cache, "trmoe_last_ids", None) if past > 0 else None
        keys = route_keys(self.config.route_key, input_ids, position_ids, before)
        if cache is not None:
            cache.trmoe_last_ids = input_ids[:, -1]
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h, keys, cos, sin, mask, cache)
        return self.norm(h)


class TRMoEForCausalLM(TRMoEPreTrainedModel, GenerationMixin):
    def __init__(self, config: TRMoEConfig):
        super().__init__(config)
        self.model = TRMoEModel(config)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        if input_ids is None or inputs_embeds is not None:
            raise ValueError(
                "TR-MoE routes by input token id: pass input_ids (inputs_embeds are not supported)"
            )
        cache = kwargs.pop("past_key_values", None) if cache is None else cache
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache()
        cache = cache if use_cache else None
        hidden = self.model(input_ids, attention_mask, position_ids, cache)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = hidden @ self.model.embed.weight[: self.config.vocab_size].T
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache})
