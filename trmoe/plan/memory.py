"""Memory per GPU of a training step, estimated from the config (no device, no allocation).

Every term is a count of bytes the train loop holds; the total sums them as if all were live at once
(gradients are counted whole although the peak, at the loss or early in the backward, comes before most of
them exist; backward temporaries are not counted). Measured peaks of real steps on one H200 were 0.81-1.22x
the total (docs/distributed.md, bench/plan_memory.py). Not counted: the CUDA context, NCCL buffers and
allocator fragmentation (typically 1-3 GiB per process), Muon's Newton-Schulz temporaries, and evaluation.

Model state (P = trainable parameters; master weights are always fp32, trmoe.runtime.env):

    none/ddp   parameters 4P + gradients 4P + optimizer state; ddp adds its gradient buckets 4P
               (gradient_as_bucket_view=False keeps a flat copy); under bf16/fp16 autocast every GEMM
               weight (all but the tied embedding) is cast once per forward and the cast is kept for the
               backward: 2 x (P - embedding).
    fsdp       parameters, gradients and optimizer state sharded over the world: (4 + 4 + opt) P / world;
               plus what is unsharded at a time, in the compute dtype (bf16/fp16 under the mixed precision
               policy, else fp32): the root unit (tied embedding + final norm, which FSDP2 keeps gathered
               from forward to backward) and two blocks (the one computing and the one prefetched); in the
               backward the root's gradient and one block's gradient (plus its fp32 copy for the
               reduce-scatter).

Optimizer state (trmoe.optim.build.optimizer_state_bytes): what the selected optimizer's variant declares
(trmoe/optim/variants: adamw 8 B per parameter, exp_avg and exp_avg_sq in fp32; stosignsgd 8 B, exp_avg and
max_scale; muon_tr 4 B per Muon matrix parameter, its momentum, and 8 B on the AdamW rest; lion 4 B, exp_avg).

Activations: per micro-batch (micro_batch x seq_len tokens; grad_accum does not add any), the tensors the
autograd graph saves, counted from the model code (`layer_activation_bytes`; checked against the real saved
tensors on CPU in tests/test_plan.py), with flash-style attention (no S x S matrix). With
trainer.activation_checkpointing only each block's fp32 input is kept, and one block is recomputed.

Loss (loss.backend=chunked): one [chunk_tokens, V] fp32 logits block, and the tied head's gradient dW
[V, H] that the loss computes in its forward and holds until the backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from trmoe.config.derived import micro_batch_tokens
from trmoe.config.schema import Config
from trmoe.model.routing import groups_by_tuple
from trmoe.model.transformer import ModelSpec, ParamCounts
from trmoe.optim.build import optimizer_state_bytes

FP32 = 4


def layer_activation_bytes(
    spec: ModelSpec, compute_bytes: int, shared_chunked: bool = False, layer: int = 0
) -> int:
    """Bytes block `layer` saves for its backward, per token (its routing strategy decides how its routed
    rows are grouped). compute_bytes: 2 under bf16/fp16 autocast (GEMM inputs and outputs in that dtype), 4
    in fp32. RMSNorm always works in fp32."""
    a, f = compute_bytes, FP32
    amp = a < FP32
    h = spec.hidden_size
    q = spec.num_heads * spec.head_dim
    kv = spec.num_kv_heads * spec.head_dim
    # attention: the norm's fp32 input and normalised values, the qkv GEMM input, q/k/v, (qk-norm: fp32
    # upcast under autocast and normalised q, k), q/k after RoPE, and the attention output (out GEMM input)
    attn = 2 * f * h + a * h + a * (q + 2 * kv) + a * (q + kv) + a * q
    if spec.qk_norm:
        attn += f * (q + kv) * (2 if amp else 1)
    ffn = 2 * f * h  # the FFN norm
    shared = spec.shared_width_of(layer)  # a dense layer: the widened shared SwiGLU, no routed branch
    if shared:
        if shared_chunked:  # the chunks' inputs (views of the fp32 normed input); each chunk is recomputed
            ffn += f * h
        else:  # GEMM input, SwiGLU [gate | up], silu(gate), silu(gate) * up
            ffn += a * h + 4 * a * shared
    if spec.routed_width_of(layer):
        if spec.num_experts == 1:  # dense control: the plain SwiGLU (its input is the shared one in fp32)
            ffn += (a * h if amp or not spec.shared_width else 0) + 4 * a * spec.routed_width
        elif groups_by_tuple(
            spec.strategy_of(layer),
            spec.vocab_size,
            spec.num_experts,
            spec.top_k,
            spec.route_seed,
            spec.hash_count,
        ):  # by route tuple (trmoe.model.moe): the token rows in tuple order, [gate | up], silu and
            # silu * up of the K experts side by side, and the two int64 row permutations
            ffn += a * h + 4 * a * spec.top_k * spec.expert_width + 2 * 8
        else:  # by expert: K gathered token rows, [gate | up], silu, silu * up, its route-weighted copy
            # (the gate and scale go in there), and the K expert outputs the scatter-add keeps
            ffn += 2 * a * spec.top_k * h + 5 * a * spec.top_k * spec.expert_width
    return attn + ffn


def final_activation_bytes(spec: ModelSpec) -> int:
    """Per token after the last block: the final norm (fp32 input and normalised values), the hidden
    states the loss reads, and the loss's fp32 gradient w.r.t. them (computed in its forward)."""
    return 4 * FP32 * spec.hidden_size


def activation_bytes(spec: ModelSpec, cfg: Config, compute_bytes: int) -> int:
    """Activations of one micro-batch (micro_batch x seq_len tokens) at the start of the backward."""
    t = cfg.trainer
    tokens = micro_batch_tokens(t)
    chunk = t.shared_chunk_tokens
    widest = max(spec.shared_width_of(layer) for layer in range(spec.num_layers))  # a dense layer's, if any
    chunked = bool(widest) and 0 < chunk < tokens
    layers = [layer_activation_bytes(spec, compute_bytes, chunked, layer) for layer in range(spec.num_layers)]
    total = tokens * final_activation_bytes(spec)
    if t.activation_checkpointing:  # block inputs (fp32 residual stream) + one block recomputed (the largest)
        total += tokens * (spec.num_layers * FP32 * spec.hidden_size + max(layers))
    else:
        total += tokens * sum(layers)
    if chunked:  # one shared-expert chunk recomputed in the backward
        total += chunk * (compute_bytes * spec.hidden_size + 4 * compute_bytes * widest)
    return total


@dataclass
class MemoryEstimate:
    strategy: str  # none | ddp | fsdp
    world: int
    items: list[tuple[str, int, str]] = field(default_factory=list)  # (what, bytes, how it is counted)

    @property
    def total(self) -> int:
        return sum(b for _, b, _ in self.items)

    def to_dict(self) -> dict:
        return {
            "strategy": self.strategy,
            "world": self.world,
            "items": [{"what": w, "bytes": b, "note": n} for w, b, n in self.items],
            "total_bytes": self.total,
        }


def estimate_memory(
    model: nn.Module,
    spec: ModelSpec,
    counts: ParamCounts,
    cfg: Config,
    strategy: str,
    world: int,
    compute_dtype: str,
) -> MemoryEstimate:
    """Bytes per GPU of one training step. `model` may live on the meta device; strategy is the resolved
    one (trmoe.runtime.parallel.resolve_strategy: none, ddp or fsdp); compute_dtype bf16, fp16 or fp32."""
    p, emb = counts.total, counts.embedding
    compute_bytes = FP32 if compute_dtype == "fp32" else 2
    amp = compute_bytes < FP32
    opt, opt_text = optimizer_state_bytes(model, cfg)
    t = cfg.trainer
    tokens = micro_batch_tokens(t)
    acts = activation_bytes(spec, cfg, compute_bytes)
    acts_text = f"{t.micro_batch} x {t.seq_len} tokens per micro-batch" + (
        ", activation checkpointing" if t.activation_checkpointing else ""
    )
    chunk = min(cfg.loss.chunk_tokens if cfg.loss.chunk_tokens > 0 else tokens, tokens)
    est = MemoryEstimate(strategy, world)
    if strategy == "fsdp":
        w_bytes = compute_bytes  # the unsharded parameters are in the mixed-precision dtype
        block = sum(q.numel() for q in model.blocks[0].parameters() if q.requires_grad)
        root = p - spec.num_layers * block
        est.items += [
            ("parameters", FP32 * p // world, f"fp32 master weights, 1/{world} shard"),
            ("gradients", FP32 * p // world, f"fp32 (reduce dtype), 1/{world} shard"),
            ("optimizer state", opt // world, f"{opt_text}, 1/{world} shard"),
            (
                "gathered parameters",
                w_bytes * (root + 2 * block),
                f"{compute_dtype}: root (embedding, final norm) {root:,} + 2 blocks x {block:,}",
            ),
            (
                "unsharded gradients",
                w_bytes * root + (w_bytes + (FP32 if amp else 0)) * block,
                "root gradient + one block's" + (" (+ fp32 copy to reduce-scatter)" if amp else ""),
            ),
        ]
    else:
        w_bytes = FP32
        est.items += [
            ("parameters", FP32 * p, "fp32, every rank holds all"),
            ("gradients", FP32 * p, "fp32"),
        ]
        if strategy == "ddp":
            est.items.append(
                ("DDP gradient buckets", FP32 * p, "flat fp32 copy (gradient_as_bucket_view off)")
            )
        est.items.append(("optimizer state", opt, opt_text))
        if amp:
            est.items.append(
                (
                    "low-precision weights",
                    2 * (p - emb),
                    "autocast casts of the GEMM weights, kept for backward",
                )
            )
    est.items.append(("activations", acts, acts_text))
    # dW is accumulated in fp32 while the loss runs; the logits block is fp32 (plus the low-precision GEMM
    # output it is upcast from when the gathered head weight is bf16/fp16)
    logits = chunk * spec.embedding_rows * (FP32 + (2 if w_bytes < FP32 else 0))
    est.items.append(
        (
            "loss buffers",
            FP32 * emb + logits,
            f"fp32 tied-head gradient [V, H] held to the backward + one {chunk} x V logits block",
        )
    )
    return est
