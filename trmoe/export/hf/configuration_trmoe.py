"""Configuration of a TR-Hash MoE decoder exported by trmoe (standalone: needs transformers, not trmoe)."""

from __future__ import annotations

from transformers import PretrainedConfig


class TRMoEConfig(PretrainedConfig):
    model_type = "trmoe"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 200019,
        embedding_rows: int = 200019,
        hidden_size: int = 64,
        num_hidden_layers: int = 2,
        num_attention_heads: int = 4,
        num_key_value_heads: int = 2,
        max_position_embeddings: int = 2048,
        qk_norm: bool = True,
        rope_theta: float = 10000.0,
        shared_width: int = 0,
        routed_width: int = 0,
        num_experts: int = 1,
        num_experts_per_tok: int = 1,
        primary_weight: float = 1.0,
        gates: bool = False,
        shared_scales: list[float] | None = None,
        routed_scales: list[float] | None = None,
        routing_strategy: str = "modulo_cyclic",
        route_key: str = "token",
        route_salts: list[int] | None = None,
        combine: str = "fixed",
        dense_layers: list[int] | None = None,
        rms_norm_eps: float = 1e-6,
        use_cache: bool = True,
        bos_token_id: int = 199999,
        eos_token_id: int = 199999,
        pad_token_id: int = 199999,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.embedding_rows = embedding_rows
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.max_position_embeddings = max_position_embeddings
        self.qk_norm = qk_norm
        self.rope_theta = rope_theta
        self.shared_width = shared_width
        self.routed_width = routed_width
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.primary_weight = primary_weight
        self.gates = gates
        self.shared_scales = list(shared_scales or [1.0] * num_hidden_layers)
        self.routed_scales = list(routed_scales or [1.0] * num_hidden_layers)
        self.routing_strategy = routing_strategy  # informative: the route tables themselves are weights
        self.route_key = route_key  # token: the route tables; prev | bigram | position: hashed per batch
        self.route_salts = list(route_salts or [])  # per layer, the hash's salt (route_key other than token)
        self.combine = combine  # fixed: w by p; learned: each routed layer's combine_gate (DeepSeek-V4)
        self.dense_layers = list(dense_layers or [])  # layers without routed experts: a wider shared SwiGLU
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        kwargs["tie_word_embeddings"] = False  # the head reads model.embed.weight directly: nothing to tie
        super().__init__(
            bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id, **kwargs
        )
