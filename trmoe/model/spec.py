"""The frozen description of a model that every module is built from (nanoGPT passes `config`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace


@dataclass(frozen=True)
class ModelSpec:
    """Everything the model needs, resolved from the config (trmoe.config.spec.model_spec)."""

    vocab_size: int  # token ids the route tables cover
    embedding_rows: int  # vocab_size rounded up to model.vocab_pad_multiple
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_seq_len: int
    qk_norm: bool
    rope_theta: float
    shared_width: int
    routed_width: int
    num_experts: int
    top_k: int
    primary_weight: float
    strategy: str
    route_seed: int
    hash_count: int
    gates: bool
    shared_gate_init: float
    routed_gate_init: float
    shared_scales: tuple[float, ...]  # a per layer
    routed_scales: tuple[float, ...]  # b per layer
    init_std: float
    norm_eps: float
    init: str = (
        "default"  # model.init: default | legacy_kaiming (routed gate/up per expert, see reset_parameters)
    )
    route_frequencies: str | None = None  # token counts file (routing.frequencies) of frequency strategies
    route_embedding: str | None = None  # token embedding source (routing.embedding): clustered/dispersed
    parametrization: str = "sp"  # model.parametrization: sp | mup (trmoe.model.mup)
    mup_width_mult: float = 1.0  # mup: hidden_size / mup_base_width
    mup_shared_mult: float = 1.0  # mup: shared_width / mup_base_shared_width
    mup_routed_mult: float = 1.0  # mup: routed_width / mup_base_routed_width
    mup_base_head_dim: int = 0  # mup: mup_base_width / num_heads (the attention scale's d_0)
    layer_strategies: tuple[str, ...] = ()  # routing.layers resolved: layer l's strategy; () = all `strategy`
    combine: str = "fixed"  # routing.combine: fixed (p) | learned (a gate per fixed-route layer: moe.py)

    def strategy_of(self, layer: int) -> str:
        """The routing strategy of layer `layer` (routing.layers, else routing.strategy)."""
        return self.layer_strategies[layer] if self.layer_strategies else self.strategy

    def is_dense(self, layer: int) -> bool:
        """Layer `layer` is a dense layer (routing.layers' `dense`): no routed experts, the shared expert
        widened to `dense_width`."""
        return self.strategy_of(layer) == "dense"

    @property
    def dense_width(self) -> int:
        """A dense layer's SwiGLU width: shared_width + K x expert_width, the FFN weights a token of a routed
        layer passes through (trmoe/model/moe.py), so both kinds of layer have the same active FFN."""
        return self.shared_width + self.top_k * self.expert_width

    def shared_width_of(self, layer: int) -> int:
        """The width of layer `layer`'s shared SwiGLU: dense_width in a dense layer, else shared_width."""
        return self.dense_width if self.is_dense(layer) else self.shared_width

    def routed_width_of(self, layer: int) -> int:
        """The total routed width of layer `layer`: 0 in a dense layer, else routed_width."""
        return 0 if self.is_dense(layer) else self.routed_width

    @property
    def strategies(self) -> tuple[str, ...]:
        """Every layer's routing strategy, in layer order."""
        return tuple(self.strategy_of(layer) for layer in range(self.num_layers))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def expert_width(self) -> int:
        return self.routed_width // self.num_experts if self.routed_width else 0

    def to_dict(self) -> dict:
        return {**asdict(self), "head_dim": self.head_dim, "expert_width": self.expert_width}


def ffn_spec(**overrides) -> ModelSpec:
    """A one-layer spec for building an FFN on its own (tests, benchmarks): the FFN's fields from
    `overrides`, harmless values elsewhere; `shared_scale`/`routed_scale` set layer 0's scales."""
    base = ModelSpec(
        vocab_size=64,
        embedding_rows=64,
        hidden_size=8,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        max_seq_len=16,
        qk_norm=True,
        rope_theta=10_000.0,
        shared_width=8,
        routed_width=16,
        num_experts=4,
        top_k=2,
        primary_weight=0.5,
        strategy="modulo_cyclic",
        route_seed=0,
        hash_count=2,
        gates=False,
        shared_gate_init=1.0,
        routed_gate_init=1.0,
        shared_scales=(1.0,),
        routed_scales=(1.0,),
        init_std=0.02,
        norm_eps=1e-6,
    )
    scales = {
        f"{b}_scales": (float(overrides.pop(f"{b}_scale")),)
        for b in ("shared", "routed")
        if f"{b}_scale" in overrides
    }
    names = {f.name for f in fields(ModelSpec)}
    unknown = set(overrides) - names
    if unknown:
        raise TypeError(f"ffn_spec: unknown fields {sorted(unknown)}")
    return replace(base, **overrides, **scales)
