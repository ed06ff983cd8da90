"""Every option of trmoe, its type, default and meaning — the single source of truth.

Each config group (`conf/<group>/*.yaml`) extends the dataclass registered here as `<group>/base_<group>`,
so a key that is not in the schema fails at compose time, naming the key. Cross-field rules live in
`trmoe.config.validate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf


class AttentionKind(str, Enum):
    gqa = "gqa"  # grouped-query: model.num_kv_heads key/value heads
    mha = "mha"  # multi-head: one key/value head per query head
    mqa = "mqa"  # multi-query: a single key/value head


class RoutingStrategy(str, Enum):
    modulo_cyclic = "modulo_cyclic"
    random = "random"
    balanced_hash = "balanced_hash"
    affine_hash = "affine_hash"
    multi_hash = "multi_hash"


class DataSource(str, Enum):
    embedded = "embedded"  # the English help texts every CPython ships (pydoc_data), o200k-tokenized
    random = "random"  # uniform random token ids (smoke tests only: nothing to learn)
    text = "text"  # a local UTF-8 file, documents separated by blank lines or data.separator


class SampleOrder(str, Enum):
    sequential = "sequential"
    shuffled = "shuffled"


class Device(str, Enum):
    auto = "auto"  # cuda (or rocm) if available, else mps, else cpu
    cpu = "cpu"
    cuda = "cuda"
    mps = "mps"
    rocm = "rocm"  # AMD GPUs through PyTorch's HIP build (device type "cuda" inside torch)


class Precision(str, Enum):
    auto = "auto"  # bf16 autocast on CUDA/ROCm when supported, fp32 elsewhere
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class LossBackend(str, Enum):
    chunked = "chunked"  # exact tied-head cross-entropy in token chunks; logits never fully materialised


class LRSchedule(str, Enum):
    cosine = "cosine"  # linear warmup, then cosine from lr to lr * min_lr_ratio
    constant = "constant"  # linear warmup, then constant lr


class Progress(str, Enum):
    auto = "auto"  # a live bar on an interactive terminal, plain log lines otherwise
    bar = "bar"
    log = "log"


@dataclass
class ModelConfig:
    """Dimensions of the decoder and its TR-MoE FFN. Profiles: conf/model/*.yaml."""

    name: str = MISSING  # profile name, recorded in run_config.json
    vocab_size: int = 200_019  # o200k_base n_vocab; the tied embedding has this many rows (before padding)
    vocab_pad_multiple: int = 1  # round the embedding rows up to a multiple of this (speed); 1 = no padding
    hidden_size: int = MISSING  # model width H
    num_layers: int = MISSING  # decoder blocks L
    num_heads: int = MISSING  # query heads; head_dim = hidden_size / num_heads
    num_kv_heads: int = MISSING  # key/value heads used by attention=gqa (mha and mqa override it)
    max_seq_len: int = 2048  # RoPE range: the longest sequence the model accepts
    shared_width: int = MISSING  # width of the always-on shared SwiGLU expert; 0 = no shared expert
    routed_width: int = MISSING  # total stored width of the routed experts; each expert has routed_width / E
    num_experts: int = 4  # E; E=1 with routing.top_k=1 is the dense SwiGLU control of width shared+routed
    gates: bool = True  # learnable scalar gates g_s, g_r on the shared and routed branches
    shared_gate_init: float = 1.0  # initial value of g_s
    routed_gate_init: float = 1.0  # initial value of g_r
    shared_scale: float = 1.0  # fixed output scale a of the shared branch (layer 0 when interpolated)
    routed_scale: float = 1.0  # fixed output scale b of the routed branch (layer 0 when interpolated)
    shared_scale_last: float | None = None  # if set, a goes linearly to this value at the last layer
    routed_scale_last: float | None = None  # if set, b goes linearly to this value at the last layer
    init_std: float = 0.02  # N(0, init_std); residual-writing projections use init_std / sqrt(2 * num_layers)
    norm_eps: float = 1e-6  # RMSNorm epsilon


@dataclass
class AttentionConfig:
    kind: AttentionKind = AttentionKind.gqa  # key/value heads: gqa = model.num_kv_heads, mha = all, mqa = 1
    qk_norm: bool = True  # per-head RMSNorm on q and k before RoPE
    rope_theta: float = 10_000.0  # RoPE base over the full head dimension


@dataclass
class RoutingConfig:
    """How token ids pick their K routed experts (a fixed table per layer, no learned router)."""

    strategy: RoutingStrategy = RoutingStrategy.modulo_cyclic  # route-table construction
    top_k: int = 2  # K distinct experts per token
    primary_weight: float = 0.5  # p: weight of route 0; routes 1..K-1 get (1-p)/(K-1); K=1 forces 1
    seed: int = 0  # route tables are a pure function of (strategy, vocab, E, K, layer, seed, hash_count)
    hash_count: int = 2  # multi_hash only: number of hash functions that vote


@dataclass
class OptimizerConfig:
    """AdamW with three parameter groups: routed experts, shared expert, everything else."""

    name: str = "adamw"  # the optimizer
    lr: float = 1e-3  # peak learning rate of the base group
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.95  # AdamW second-moment decay
    eps: float = 1e-8  # AdamW epsilon
    weight_decay: float = 0.1  # matrices only; norms, gates and other 1-D tensors are never decayed
    expert_lr_scale: float = 1.0  # lr multiplier of the routed-expert group
    shared_lr_scale: float = 1.0  # lr multiplier of the shared-expert group
    expert_weight_decay: float | None = None  # None = weight_decay
    shared_weight_decay: float | None = None  # None = weight_decay
    decay_embedding: bool = False  # apply weight_decay to the tied embedding
    schedule: LRSchedule = LRSchedule.cosine  # cosine: warmup then cosine to the floor; constant
    warmup_steps: int | None = None  # linear warmup over these optimizer steps; None = 5% of trainer.steps
    min_lr_ratio: float = 0.1  # cosine floor as a fraction of lr


@dataclass
class DataConfig:
    source: DataSource = DataSource.embedded  # embedded help texts, random ids, or a text file
    text_path: str | None = None  # data=text: UTF-8 file, resolved against the launch directory
    separator: str | None = None  # data=text: document separator; None = one or more blank lines
    eval_fraction: float = 0.1  # share of documents held out (a stable hash of each document decides)
    split_seed: int = 0  # salt of the document hash that assigns train/eval
    order: SampleOrder = SampleOrder.shuffled  # shuffled: a seeded permutation of windows per epoch


@dataclass
class HardwareConfig:
    device: Device = Device.auto  # auto: cuda/rocm if available, else mps, else cpu
    precision: Precision = Precision.auto  # auto: bf16 autocast on GPU, fp32 on CPU
    threads: int | None = None  # torch intra-op threads on CPU; None = torch's default
    deterministic: bool = True  # torch.use_deterministic_algorithms (CPU runs are then bit-reproducible)


@dataclass
class LossConfig:
    backend: LossBackend = LossBackend.chunked  # exact tied-head CE in token chunks
    chunk_tokens: int = 2048  # rows of logits computed at once; memory, not math
    label_smoothing: float = 0.0  # PyTorch semantics: (1-e) CE + e mean(-log p)
    z_loss: float = 0.0  # coefficient of mean(logsumexp^2), added to the objective (reported separately)


@dataclass
class TrainerConfig:
    steps: int = 150  # optimizer steps
    micro_batch: int = 8  # sequences per rank per forward
    seq_len: int = 128  # tokens per sequence (<= model.max_seq_len)
    grad_accum: int = 1  # micro-batches per optimizer step
    grad_clip: float = 1.0  # global grad-norm clip; 0 = off
    seed: int = 42  # model init and data order
    log_every: int = 10  # metrics row cadence (plus step 1 and every eval step)
    eval_every: int = 50  # held-out evaluation cadence in steps (and at the last step); 0 = only at the end
    eval_batches: int = 4  # fixed held-out batches scored at every evaluation
    checkpoint_every: int = 0  # 0 = only the final checkpoint


@dataclass
class RunConfig:
    name: str | None = None  # runs/<name>/ outside --multirun; None = <model>-<attention>-<routing>-<time>
    progress: Progress = Progress.auto  # a live bar on a terminal, log lines otherwise


@dataclass
class Config:
    model: ModelConfig = MISSING
    attention: AttentionConfig = MISSING
    routing: RoutingConfig = MISSING
    optimizer: OptimizerConfig = MISSING
    data: DataConfig = MISSING
    hardware: HardwareConfig = MISSING
    loss: LossConfig = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    run: RunConfig = field(default_factory=RunConfig)


GROUPS: dict[str, Any] = {
    "model": ModelConfig,
    "attention": AttentionConfig,
    "routing": RoutingConfig,
    "optimizer": OptimizerConfig,
    "data": DataConfig,
    "hardware": HardwareConfig,
    "loss": LossConfig,
}


def _run_name(name: str | None, *parts: str) -> str:
    return name if name else "-".join(str(p) for p in parts)


def register() -> None:
    """Register the schemas so YAML files can extend them (`defaults: [base_<group>]`), and the
    `trmoe.run_name` resolver used by hydra.run.dir."""
    OmegaConf.register_new_resolver("trmoe.run_name", _run_name, replace=True)
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for group, node in GROUPS.items():
        cs.store(group=group, name=f"base_{group}", node=node)


register()
