"""Cross-field rules, checked right after composition. OmegaConf already checks keys and types; these
checks catch combinations that compose fine but cannot run. Each failure is one line naming the key,
its value and what is allowed."""

from __future__ import annotations

from trmoe.config.schema import AttentionKind, Config, DataSource
from trmoe.errors import UserError


def _fail(key: str, value: object, allowed: str) -> None:
    raise UserError(f"config error: {key}={value}: {allowed}")


def _positive(section: object, prefix: str, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        if value < 1:
            _fail(f"{prefix}.{name}", value, "must be a positive integer")


def kv_heads(cfg: Config) -> int:
    """Key/value heads actually used: gqa takes model.num_kv_heads, mha one per query head, mqa one."""
    kind = cfg.attention.kind
    if kind == AttentionKind.mha:
        return cfg.model.num_heads
    if kind == AttentionKind.mqa:
        return 1
    return cfg.model.num_kv_heads


def validate(cfg: Config) -> None:
    m, r, t, o, d, loss, hw = (
        cfg.model,
        cfg.routing,
        cfg.trainer,
        cfg.optimizer,
        cfg.data,
        cfg.loss,
        cfg.hardware,
    )

    _positive(m, "model", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "max_seq_len")
    _positive(m, "model", "num_experts", "vocab_pad_multiple")
    if m.vocab_size < 2:
        _fail("model.vocab_size", m.vocab_size, "must be at least 2")
    if m.hidden_size % m.num_heads:
        divisors = [
            h for h in range(1, m.hidden_size + 1) if m.hidden_size % h == 0 and (m.hidden_size // h) % 2 == 0
        ]
        _fail(
            "model.num_heads",
            m.num_heads,
            f"must divide model.hidden_size={m.hidden_size}; allowed: {divisors}",
        )
    if (m.hidden_size // m.num_heads) % 2:
        _fail("model.num_heads", m.num_heads, "head_dim = hidden_size / num_heads must be even for RoPE")
    if cfg.attention.kind == AttentionKind.gqa and m.num_heads % m.num_kv_heads:
        allowed = [k for k in range(1, m.num_heads + 1) if m.num_heads % k == 0]
        _fail(
            "model.num_kv_heads",
            m.num_kv_heads,
            f"must divide model.num_heads={m.num_heads}; allowed: {allowed}",
        )
    for name in ("shared_width", "routed_width"):
        if getattr(m, name) < 0:
            _fail(f"model.{name}", getattr(m, name), "must be >= 0 (0 = branch off)")
    if m.shared_width == 0 and m.routed_width == 0:
        _fail("model.routed_width", 0, "model.shared_width and model.routed_width cannot both be 0")
    if m.routed_width and m.routed_width % m.num_experts:
        _fail(
            "model.routed_width",
            m.routed_width,
            f"must be a multiple of model.num_experts={m.num_experts} (each expert gets routed_width / E)",
        )
    if m.num_experts > 32767:
        _fail("model.num_experts", m.num_experts, "must be at most 32767")
    if m.init_std <= 0:
        _fail("model.init_std", m.init_std, "must be > 0")
    if m.norm_eps <= 0:
        _fail("model.norm_eps", m.norm_eps, "must be > 0")

    if not 1 <= r.top_k <= m.num_experts:
        _fail("routing.top_k", r.top_k, f"must be between 1 and model.num_experts={m.num_experts}")
    if not 0.0 <= r.primary_weight <= 1.0:
        _fail("routing.primary_weight", r.primary_weight, "must be in [0, 1]")
    if not 1 <= r.hash_count <= 8:
        _fail("routing.hash_count", r.hash_count, "must be between 1 and 8")

    _positive(t, "trainer", "steps", "micro_batch", "seq_len", "grad_accum", "log_every", "eval_batches")
    if t.seq_len > m.max_seq_len:
        _fail("trainer.seq_len", t.seq_len, f"must be <= model.max_seq_len={m.max_seq_len} (the RoPE range)")
    for name in ("eval_every", "checkpoint_every"):
        if getattr(t, name) < 0:
            _fail(f"trainer.{name}", getattr(t, name), "must be >= 0 (0 = only at the end)")
    if t.grad_clip < 0:
        _fail("trainer.grad_clip", t.grad_clip, "must be >= 0 (0 = off)")

    if o.lr <= 0:
        _fail("optimizer.lr", o.lr, "must be > 0")
    for name in ("beta1", "beta2"):
        if not 0.0 <= getattr(o, name) < 1.0:
            _fail(f"optimizer.{name}", getattr(o, name), "must be in [0, 1)")
    if o.eps <= 0:
        _fail("optimizer.eps", o.eps, "must be > 0")
    for name in ("weight_decay", "expert_weight_decay", "shared_weight_decay"):
        value = getattr(o, name)
        if value is not None and value < 0:
            _fail(f"optimizer.{name}", value, "must be >= 0")
    for name in ("expert_lr_scale", "shared_lr_scale"):
        if getattr(o, name) < 0:
            _fail(f"optimizer.{name}", getattr(o, name), "must be >= 0")
    if o.warmup_steps is not None and o.warmup_steps < 0:
        _fail("optimizer.warmup_steps", o.warmup_steps, "must be >= 0")
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        _fail("optimizer.min_lr_ratio", o.min_lr_ratio, "must be in [0, 1]")

    if not 0.0 < d.eval_fraction < 1.0:
        _fail("data.eval_fraction", d.eval_fraction, "must be in (0, 1)")
    if d.source == DataSource.text and not d.text_path:
        _fail(
            "data.text_path", d.text_path, "data=text needs a UTF-8 file: data.text_path=/path/to/corpus.txt"
        )
    if d.separator == "":
        _fail("data.separator", "''", "must be a non-empty string, or null for blank lines")

    if loss.chunk_tokens < 1:
        _fail("loss.chunk_tokens", loss.chunk_tokens, "must be a positive integer")
    if not 0.0 <= loss.label_smoothing < 1.0:
        _fail("loss.label_smoothing", loss.label_smoothing, "must be in [0, 1)")
    if loss.z_loss < 0:
        _fail("loss.z_loss", loss.z_loss, "must be >= 0")

    if hw.threads is not None and hw.threads < 1:
        _fail("hardware.threads", hw.threads, "must be a positive integer or null")
