"""The ModelSpec of a validated config: every model dimension resolved (kv heads, padded embedding rows, the
per-layer branch scales, the token-count file of a frequency strategy).

Its own module so that parameter matching (param_match: counts the parameters of a candidate width) and
resolution (resolve: validates, then solves the match) both build on it without importing each other."""

from __future__ import annotations

from pathlib import Path

from trmoe.config.schema import Config
from trmoe.config.validate import frequencies_path, kv_heads, layer_strategies, needs_frequencies
from trmoe.model.routing import REGISTRY
from trmoe.model.spec import ModelSpec


def depth_scales(first: float, last: float | None, num_layers: int) -> tuple[float, ...]:
    """Fixed branch scale per layer: constant, or linear from `first` (layer 0) to `last` (layer L-1)."""
    if last is None or num_layers == 1:
        return (float(first),) * num_layers
    return tuple(first + (last - first) * layer / (num_layers - 1) for layer in range(num_layers))


def _route_frequencies(cfg: Config) -> str | None:
    if not needs_frequencies(cfg):
        return None
    path = frequencies_path(cfg)
    return str(path) if path is not None else None


def route_embedding(cfg: Config) -> str | None:
    """routing.embedding as an absolute path (read where the model is built), for the strategies that read
    it."""
    reads = any(REGISTRY[name].needs_embedding for name in layer_strategies(cfg))
    if not reads or not cfg.routing.embedding:
        return None
    return str(Path(cfg.routing.embedding).expanduser().absolute())


def route_embedding_sha256(cfg: Config) -> str | None:
    """The sha256 of the routing embedding's file (what a resume compares: its place may change), or None
    when no strategy reads one or the file is not there (refused by name where it is read)."""
    path = route_embedding(cfg)
    if path is None:
        return None
    from trmoe.model.embedding_routing import embedding_digest  # numpy only, and only for these strategies

    try:
        return embedding_digest(path)
    except ValueError:
        return None


def mup_fields(cfg: Config) -> dict:
    """The ModelSpec's muP fields (trmoe.model.mup): the width multipliers over the base shape; the shared
    and routed bases default to their widths scaled by mup_base_width / hidden_size (multiplier m_d)."""
    m = cfg.model
    if m.parametrization.value != "mup":
        return {}
    width = m.hidden_size / m.mup_base_width

    def mult(size: int, base: int | None) -> float:
        return width if base is None or size == 0 else size / base

    return {
        "parametrization": "mup",
        "mup_width_mult": width,
        "mup_shared_mult": mult(m.shared_width, m.mup_base_shared_width),
        "mup_routed_mult": mult(m.routed_width, m.mup_base_routed_width),
        "mup_base_head_dim": m.mup_base_width // m.num_heads,
    }


def model_spec(cfg: Config) -> ModelSpec:
    m, r, a = cfg.model, cfg.routing, cfg.attention
    pad = m.vocab_pad_multiple
    return ModelSpec(
        vocab_size=m.vocab_size,
        embedding_rows=-(-m.vocab_size // pad) * pad,
        hidden_size=m.hidden_size,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        num_kv_heads=kv_heads(cfg),
        max_seq_len=m.max_seq_len,
        qk_norm=a.qk_norm,
        rope_theta=a.rope_theta,
        shared_width=m.shared_width,
        routed_width=m.routed_width,
        num_experts=m.num_experts,
        top_k=r.top_k,
        primary_weight=1.0 if r.top_k == 1 else r.primary_weight,
        strategy=r.strategy.value,
        route_seed=r.seed,
        hash_count=r.hash_count,
        gates=m.gates,
        shared_gate_init=m.shared_gate_init,
        routed_gate_init=m.routed_gate_init,
        shared_scales=depth_scales(m.shared_scale, m.shared_scale_last, m.num_layers),
        routed_scales=depth_scales(m.routed_scale, m.routed_scale_last, m.num_layers),
        init_std=m.init_std,
        norm_eps=m.norm_eps,
        init=m.init.value,
        route_frequencies=_route_frequencies(cfg),
        route_embedding=route_embedding(cfg),
        layer_strategies=layer_strategies(cfg) if cfg.routing.layers else (),
        combine=r.combine.value,
        **mup_fields(cfg),
    )
