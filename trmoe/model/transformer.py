"""The TR-Hash MoE decoder, top to bottom.

    h = embed(t)
    for each block:  h = h + Attn(RMSNorm(h));  h = h + TRMoEFFN(RMSNorm(h), t)
    h = RMSNorm(h) * c;  logits = h @ embed.weight.T   (tied head; the loss never materialises all logits)

c = 1 under model.parametrization=sp; muP's readout multiplier 1/m_d under mup (trmoe.model.mup, which also
sets the attention logits' scale and the init).

The FFN sees the *input* token id t of each position: that is what its route tables are indexed by. A
strategy that routes on another key of each position (the previous id, the (previous, current) pair, the
position, the target: trmoe.model.context_routing) gets that key instead, computed once per forward.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from trmoe.errors import UserError
from trmoe.model.attention import Attention, RMSNorm, rope_cache
from trmoe.model.context_routing import route_keys
from trmoe.model.kv_cache import KVCache
from trmoe.model.moe import TRMoEFFN
from trmoe.model.mup import attention_scale, fan_in_mult, output_mult
from trmoe.model.spec import ModelSpec

__all__ = ["Block", "ModelSpec", "ParamCounts", "TRMoETransformer", "count_parameters", "parameter_counts"]


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__()
        self.attn_norm = RMSNorm(spec.hidden_size, spec.norm_eps)
        self.attn = Attention(
            spec.hidden_size,
            spec.num_heads,
            spec.num_kv_heads,
            spec.qk_norm,
            spec.norm_eps,
            scale=attention_scale(spec),
        )
        self.ffn_norm = RMSNorm(spec.hidden_size, spec.norm_eps)
        self.ffn = TRMoEFFN(spec, layer)

    def forward(
        self,
        h: torch.Tensor,
        token_ids: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None = None,
        layer: int = 0,
    ):
        h = h + self.attn(self.attn_norm(h), cos, sin, cache, layer)
        return h + self.ffn(self.ffn_norm(h), token_ids)


class TRMoETransformer(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.embed = nn.Embedding(spec.embedding_rows, spec.hidden_size)
        self.blocks = nn.ModuleList(Block(spec, layer) for layer in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.norm_eps)
        self.output_mult = output_mult(spec)  # c above, on the final hidden state: every logit sees it
        cos, sin = rope_cache(spec.max_seq_len, spec.head_dim, spec.rope_theta, self.embed.weight.device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # Memory, not math (trainer.activation_checkpointing): keep only each block's input and recompute
        # the block in the backward.
        self.activation_checkpointing = False
        # Speed, not math (the train loop turns it on for CPU runs): the embedding's gradient as its N sparse
        # rows, which autograd adds in place into the tied head's dense [V, H] gradient. Dense, it is a fresh
        # zero-filled [V, H] tensor (307 MB at 100m) summed into that one: ~2% of a 100m CPU step.
        self.sparse_embedding_grad = False
        # A model on the meta device (parameter counts, the planner, preflight's shapes) has no values to
        # draw: initialising it was most of its build time (the RNG is untouched either way).
        if not self.embed.weight.is_meta:
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """N(0, std) everywhere (the learned router too); projections that write into the residual stream
        (attention out, shared down, expert down) get std / sqrt(2L) so the residual variance does not grow
        with depth; norms 1. model.init=legacy_kaiming (the old runner's published 100M/300M runs) draws the
        routed experts' gate and up halves instead from U(-b, b), b = 1/sqrt(expert width): Kaiming-uniform
        with a = sqrt(5) and the expert width as fan-in, each element independent as in its per-expert draws
        (std 1/sqrt(3 I_e): 0.042 at I_e = 192, twice N(0, 0.02)). Under mup each hidden matrix's std is
        divided by sqrt of its fan-in multiplier (trmoe.model.mup)."""
        std = self.spec.init_std
        residual_std = std / math.sqrt(2 * self.spec.num_layers)
        legacy = self.spec.init == "legacy_kaiming"
        for name, p in self.named_parameters():
            if p.ndim < 2:
                continue  # norm weights (1) and gates (their init values) are set by their modules
            if legacy and name.endswith("routed.w_in"):
                bound = 1.0 / math.sqrt(p.shape[2] // 2)
                nn.init.uniform_(p, -bound, bound)
                continue
            is_residual_writer = name.endswith(("attn.out.weight", "shared.w_out", "routed.w_out"))
            m = fan_in_mult(name, self.spec)
            base = residual_std if is_residual_writer else std
            nn.init.normal_(p, 0.0, base if m == 1 else base / math.sqrt(m))

    def router_losses(self) -> dict[str, torch.Tensor] | None:
        """The routers' loss terms of the last forward, each the mean over the layers that have it: `aux`
        (load balancing) and `z` (router z-loss) of the softmax routers, `seq_aux` (sequence-wise balance) of
        learned_v3's; None without a router. Taking them clears them. A layer with fixed routes never
        carries one (a balance loss would train it on routes it never ran: RuntimeError, a bug)."""
        terms: dict[str, list[torch.Tensor]] = {}
        for layer, block in enumerate(self.blocks):
            ffn = block.ffn
            if ffn.router_terms is None:
                continue
            if not ffn.router_kind:
                raise RuntimeError(f"layer {layer} routes by a table but left router loss terms")
            for name, term in ffn.router_terms.items():
                terms.setdefault(name, []).append(term)
            ffn.router_terms = None
        return {name: torch.stack(ts).mean() for name, ts in terms.items()} if terms else None

    def route_tables(self) -> dict[int, torch.Tensor]:
        """A copy of every layer's route table, by layer (none for a router or a hashed key)."""
        routed = {i: b.ffn.routed for i, b in enumerate(self.blocks) if b.ffn.routed is not None}
        return {i: r.route_table.clone() for i, r in routed.items() if r.route_table is not None}

    def restore_route_tables(self, tables: dict[int, torch.Tensor]) -> list[str]:
        """Set the route tables back to `tables` (route_tables()); the names of those that differed."""
        changed = [i for i, t in tables.items() if not torch.equal(self.blocks[i].ffn.routed.route_table, t)]
        for i in changed:
            self.blocks[i].ffn.routed.set_route_table(tables[i])
        return [f"blocks.{i}.ffn.routed.route_table" for i in changed]

    @property
    def needs_targets(self) -> bool:
        """Some layer routes on the target token (oracle_future_hash): forward needs `targets`."""
        return any(block.ffn.route_key == "target" for block in self.blocks)

    def refuse_analysis_only(self, what: str) -> None:
        """UserError when some layer routes on the target (oracle_future_hash: analysis only): `what`
        (sampling, an export, a downstream evaluation) has no targets to route on."""
        if self.needs_targets:
            raise UserError(
                f"{what}: routing.strategy=oracle_future_hash routes on the target token (analysis only: "
                "training and held-out loss); allowed: a run with another routing.strategy"
            )

    def route_keys(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        before: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """Each layer's route keys [B, S] (trmoe.model.context_routing.route_keys), each kind once."""
        kinds: dict[str, torch.Tensor] = {}
        out = []
        for block in self.blocks:
            kind = block.ffn.route_key
            if kind not in kinds:
                kinds[kind] = route_keys(kind, token_ids, positions, before, targets)
            out.append(kinds[kind])
        return out

    def forward(
        self, token_ids: torch.Tensor, cache: KVCache | None = None, targets: torch.Tensor | None = None
    ) -> torch.Tensor:
        """token_ids [B, S] -> final normalised hidden states [B, S, H] (feed them to the tied-head loss).
        With a cache: token_ids are the next S positions after those it holds (decoding, trmoe.generate).
        `targets` [B, S]: only read by a layer that routes on the target (oracle_future_hash)."""
        if cache is not None:
            return self._forward_cached(token_ids, cache)
        seq = token_ids.shape[1]
        keys = self.route_keys(token_ids, torch.arange(seq, device=token_ids.device), targets=targets)
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        sparse = self.sparse_embedding_grad and not torch.compiler.is_compiling()  # compiled graphs: dense
        h = F.embedding(token_ids, self.embed.weight, sparse=sparse)
        recompute = self.activation_checkpointing and torch.is_grad_enabled()
        for block, key in zip(self.blocks, keys, strict=True):
            if recompute:
                h = checkpoint(block, h, key, cos, sin, use_reentrant=False)
            else:
                h = block(h, key, cos, sin)
        return self._readout(self.norm(h))

    def _forward_cached(self, token_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        new = token_ids.shape[1]
        positions = cache.positions(new)  # [B, S]: per row, as left padding shifts them (< capacity)
        cos, sin = self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1)
        keys = self.route_keys(token_ids, positions, cache.last_ids)
        h = self.embed(token_ids)
        for layer, block in enumerate(self.blocks):
            h = block(h, keys[layer], cos, sin, cache, layer)
        cache.advance(new, token_ids[:, -1])
        return self._readout(self.norm(h))

    def _readout(self, h: torch.Tensor) -> torch.Tensor:
        return h if self.output_mult == 1 else h * self.output_mult

    def new_cache(self, batch: int, capacity: int, pad: torch.Tensor | None = None) -> KVCache:
        """An empty KV cache for `batch` rows of up to `capacity` positions, in the model's dtype and device
        (`pad` [B]: left-padding slots per row)."""
        spec, weight = self.spec, self.embed.weight
        return KVCache(
            spec.num_layers,
            batch,
            spec.num_kv_heads,
            spec.head_dim,
            min(capacity, spec.max_seq_len),
            dtype=weight.dtype,
            device=weight.device,
            pad=pad,
        )

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full logits over the real vocabulary (small inputs only: [.., vocab] floats)."""
        return hidden @ self.embed.weight[: self.spec.vocab_size].T

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed.weight


@dataclass(frozen=True)
class ParamCounts:
    total: int  # trainable parameters, the tied embedding counted once
    active: int  # per token: total minus the routed experts a token does not visit (E - K of E)
    embedding: int
    non_embedding: int

    def to_dict(self) -> dict:
        return asdict(self)


def count_parameters(model: nn.Module) -> ParamCounts:
    spec: ModelSpec = model.spec
    total = sum(p.numel() for p in model.parameters() if p.requires_grad)
    embedding = model.embed.weight.numel()
    idle = 0
    for block in model.blocks:
        routed = block.ffn.routed
        if routed is not None:
            per_expert = (routed.w_in.numel() + routed.w_out.numel()) // spec.num_experts
            idle += per_expert * (spec.num_experts - spec.top_k)
    return ParamCounts(total=total, active=total - idle, embedding=embedding, non_embedding=total - embedding)


def parameter_counts(spec: ModelSpec) -> ParamCounts:
    """Count without allocating: the model is built on the meta device (no storage, no route tables)."""
    with torch.device("meta"):
        model = TRMoETransformer(spec)
    return count_parameters(model)
