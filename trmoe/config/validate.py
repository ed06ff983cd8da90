"""Cross-field rules, checked right after composition. OmegaConf already checks keys and types; these
checks catch combinations that compose fine but cannot run. Each failure is one line naming the key,
its value and what is allowed.

Over 400 lines on purpose: every cross-field rule of the schema in one file, so a reader finds
why a combination is refused next to every other refusal (the guide's 'every option in one file').
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import numpy as np

from trmoe.cli import usable_cores
from trmoe.config.optimizers import OPTIMIZERS
from trmoe.config.schema import (
    AttentionKind,
    Config,
    InitState,
    LossBackend,
    ModelInit,
    RoutingStrategy,
    SpikePolicy,
    check_run_name,
)
from trmoe.data.shards import TOKEN_COUNTS_NAME
from trmoe.data.tokenizer import O200K_VOCAB
from trmoe.data.variant import SOURCES, check_exclusive
from trmoe.errors import UserError
from trmoe.model.routing import (
    MAX_EXPERTS,
    MAX_HASH_COUNT,
    MAX_TUPLES,
    REGISTRY,
    STRATEGY_REGISTRY,
    tuple_count,
)
from trmoe.registry import Registry


def _fail(key: str, value: object, allowed: str) -> None:
    raise UserError(f"config error: {key}={value}: {allowed}")


def _positive(section: object, prefix: str, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        if value < 1:
            _fail(f"{prefix}.{name}", value, "must be a positive integer")


def _finite(node: object, prefix: str) -> None:
    """Every float of the config is a finite number: NaN passes any `x <= 0` test, and inf trains to NaN."""
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            _finite(value, f"{f.name}.")
        elif isinstance(value, float) and not math.isfinite(value):
            _fail(f"{prefix}{f.name}", value, "must be a finite number")


INT64_MAX = 2**63 - 1


def _int64(node: object, prefix: str) -> None:
    """Every integer of the config fits int64: a larger one (trainer.steps, model.match_params, a seed)
    composes as a Python int and fails deep inside numpy or torch with a traceback."""
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            _int64(value, f"{prefix}{f.name}.")
        elif isinstance(value, int) and not isinstance(value, bool) and not -INT64_MAX <= value <= INT64_MAX:
            _fail(f"{prefix}{f.name}", value, f"must be an integer of at most {INT64_MAX} (int64)")


# hardware.threads above the cores only oversubscribes (warned when the run starts); far above them it is a
# typo that would start thousands of threads
THREADS_PER_CORE_MAX = 16


def kv_heads(cfg: Config) -> int:
    """Key/value heads actually used (AttentionKind.kv_heads)."""
    return cfg.attention.kind.kv_heads(cfg.model.num_heads, cfg.model.num_kv_heads)


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
    _selected_variants_load(cfg)
    _finite(cfg, "")
    if hw.peak_tflops is not None and hw.peak_tflops <= 0:
        _fail(
            "hardware.peak_tflops",
            hw.peak_tflops,
            "must be a positive number (TFLOP/s of one device) or null",
        )
    dbg = cfg.debug
    for name in ("profile_wait", "profile_warmup"):
        if getattr(dbg, name) < 0:
            _fail(f"debug.{name}", getattr(dbg, name), "must be 0 or more steps")
    _positive(dbg, "debug", "profile_active", "profile_rows")
    _int64(cfg, "")

    _positive(m, "model", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "max_seq_len")
    _positive(m, "model", "num_experts", "vocab_pad_multiple")
    if m.vocab_size < 2:
        _fail("model.vocab_size", m.vocab_size, "must be at least 2")
    if m.hidden_size % (2 * m.num_heads):  # hidden_size = num_heads x an even head_dim (RoPE rotates pairs)
        if m.hidden_size % 2:  # no head count gives an even head_dim: the width is what is wrong
            _fail(
                "model.hidden_size",
                m.hidden_size,
                f"must be model.num_heads={m.num_heads} x an even head_dim (RoPE); "
                f"allowed: a multiple of {2 * m.num_heads}",
            )
        heads = [  # listed for a plausible width only: a huge one would take forever to enumerate
            h
            for h in range(1, m.hidden_size + 1 if m.hidden_size <= 1 << 16 else 1)
            if m.hidden_size % (2 * h) == 0
        ] or "a divisor of it with an even quotient"
        _fail(
            "model.num_heads",
            m.num_heads,
            f"must divide model.hidden_size={m.hidden_size} into an even head_dim (RoPE); allowed: {heads}",
        )
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
    if m.num_experts > MAX_EXPERTS:
        _fail("model.num_experts", m.num_experts, f"must be at most {MAX_EXPERTS}")
    if m.init_std <= 0:
        _fail("model.init_std", m.init_std, "must be > 0")
    if m.norm_eps <= 0:
        _fail("model.norm_eps", m.norm_eps, "must be > 0")
    _validate_mup(cfg)
    if m.match_params is not None and m.match_params < 1:
        _fail("model.match_params", m.match_params, "must be a positive integer, or null for no matching")
    _positive(m, "model", "match_multiple")

    if not 1 <= r.top_k <= m.num_experts:
        _fail("routing.top_k", r.top_k, f"must be between 1 and model.num_experts={m.num_experts}")
    if not 0.0 <= r.primary_weight <= 1.0:
        _fail("routing.primary_weight", r.primary_weight, "must be in [0, 1]")
    if not 1 <= r.hash_count <= MAX_HASH_COUNT:
        _fail("routing.hash_count", r.hash_count, f"must be between 1 and {MAX_HASH_COUNT}")
    _validate_strategy(cfg)

    _positive(t, "trainer", "steps", "micro_batch", "seq_len", "grad_accum", "log_every", "eval_batches")
    if t.seq_len > m.max_seq_len:
        _fail("trainer.seq_len", t.seq_len, f"must be <= model.max_seq_len={m.max_seq_len} (the RoPE range)")
    if not 0 <= t.seed < 2**32:
        _fail("trainer.seed", t.seed, "must be in [0, 2**32) (it seeds numpy too)")
    if cfg.attention.rope_theta <= 1:
        _fail("attention.rope_theta", cfg.attention.rope_theta, "must be > 1 (the RoPE base, e.g. 10000)")
    if t.eval_every < 0:
        _fail("trainer.eval_every", t.eval_every, "must be >= 0 (0 = only at the end)")
    if t.grad_clip < 0:
        _fail("trainer.grad_clip", t.grad_clip, "must be >= 0 (0 = off)")
    if not t.stop_within > 0:  # (not >: NaN too)
        _fail("trainer.stop_within", t.stop_within, "must be > 0 seconds")
    if t.max_hours is not None and not t.max_hours > 0:  # (not >: NaN too)
        _fail("trainer.max_hours", t.max_hours, "must be > 0 hours, or null for no limit")

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
    _validate_data(d)

    if loss.chunk_tokens < 1:
        _fail("loss.chunk_tokens", loss.chunk_tokens, "must be a positive integer")
    if not 0.0 <= loss.label_smoothing < 1.0:
        _fail("loss.label_smoothing", loss.label_smoothing, "must be in [0, 1)")
    if loss.z_loss < 0:
        _fail("loss.z_loss", loss.z_loss, "must be >= 0")
    _validate_training_controls(cfg)

    if hw.threads is not None and hw.threads < 1:
        _fail("hardware.threads", hw.threads, "must be a positive integer or null")
    cores = usable_cores()
    if hw.threads is not None and hw.threads > THREADS_PER_CORE_MAX * cores:
        _fail(
            "hardware.threads",
            hw.threads,
            f"this machine has {cores} usable cores; allowed: 1..{THREADS_PER_CORE_MAX * cores} "
            "(at most the cores is best) or null",
        )
    _validate_reliability(cfg)
    _validate_downstream(cfg)


def _validate_mup(cfg: Config) -> None:
    """model.parametrization=mup: a base shape no larger than the model, and the parts docs/mup.md covers."""
    m = cfg.model
    bases = {
        "mup_base_width": (m.mup_base_width, m.hidden_size, "hidden_size"),
        "mup_base_shared_width": (m.mup_base_shared_width, m.shared_width, "shared_width"),
        "mup_base_routed_width": (m.mup_base_routed_width, m.routed_width, "routed_width"),
    }
    if m.parametrization.value != "mup":
        for name, (base, _, _) in bases.items():
            if base is not None:
                _fail(f"model.{name}", base, "only with model.parametrization=mup; allowed: null")
        return
    if m.mup_base_width is None:
        _fail("model.mup_base_width", None, "required with model.parametrization=mup (the tuned hidden size)")
    for name, (base, size, of) in bases.items():
        if base is None:
            continue
        if size == 0:
            _fail(f"model.{name}", base, f"model.{of}=0 has no width to scale; allowed: null")
        if not 1 <= base <= size:
            _fail(f"model.{name}", base, f"must be in [1, model.{of}={size}] (the base is the smaller model)")
    if m.mup_base_routed_width is not None and m.mup_base_routed_width % m.num_experts:
        # as routed_width itself: the base's expert width is base / E, which must be a whole width
        _fail(
            "model.mup_base_routed_width",
            m.mup_base_routed_width,
            f"must be a multiple of model.num_experts={m.num_experts} (each base expert gets base / E)",
        )
    if m.mup_base_width % m.num_heads:
        _fail(
            "model.mup_base_width",
            m.mup_base_width,
            f"must be a multiple of model.num_heads={m.num_heads} (the base head dim sets the attention "
            "scale)",
        )
    routers = [name for name in layer_strategies(cfg) if REGISTRY[name].learned]
    if routers:
        _fail(
            "model.parametrization",
            "mup",
            f"routing.strategy={routers[0]} is not supported under mup (a router has no muP "
            "rule here); allowed: a fixed route-table strategy, or model.parametrization=sp",
        )
    if cfg.routing.combine.value == "learned":
        _fail(
            "model.parametrization",
            "mup",
            "routing.combine=learned is not supported under mup (its gate has no muP rule here); allowed: "
            "routing.combine=fixed, or model.parametrization=sp",
        )
    if m.init != ModelInit.default:
        _fail(
            "model.parametrization",
            "mup",
            f"model.init={m.init.value} is sp only; allowed: model.init=default",
        )


def _validate_downstream(cfg: Config) -> None:
    """downstream.*: the option values; whether lm-eval and the tasks are there is checked by
    trmoe.train.observe.downstream, also before anything is written."""
    ds = cfg.downstream
    if not ds.tasks:
        return
    for task in ds.tasks:
        if not isinstance(task, str) or not task.strip() or "," in task:
            _fail("downstream.tasks", list(ds.tasks), "allowed: lm-eval task names, e.g. [arc_easy,piqa]")
    if len(set(ds.tasks)) != len(ds.tasks):
        _fail("downstream.tasks", list(ds.tasks), "names a task twice; allowed: each task once")
    if cfg.model.vocab_size != O200K_VOCAB and cfg.tokenizer.name.value != "bpe":
        _fail(
            "downstream.tasks",
            list(ds.tasks),
            f"tasks are text: needs a model that reads o200k_base ids (model.vocab_size={O200K_VOCAB}, "
            f"a text data source) or tokenizer=bpe; this one has model.vocab_size={cfg.model.vocab_size}",
        )
    if ds.every is not None and ds.every < 0:
        _fail("downstream.every", ds.every, "must be >= 0 (0 = at steps 0 and last only) or null")
    if ds.limit is not None and ds.limit < 1:
        _fail("downstream.limit", ds.limit, "must be a positive integer (first N examples) or null")
    _positive(ds, "downstream", "batch_size")
    if ds.include_path is not None and not os.path.isdir(ds.include_path):
        _fail("downstream.include_path", ds.include_path, "not a directory; allowed: a folder of task YAMLs")


def selected_variants(cfg: Config) -> list[tuple[Registry, str]]:
    """Every (registry, variant name) the config selects: its optimizer, its data source and a mixture's
    parts, and its routing strategies (routing.strategy and every routing.layers entry)."""
    d, r = cfg.data, cfg.routing
    sources = dict.fromkeys(v.value for v in (d.source, *(s.source for s in d.sources.values())))
    strategies = dict.fromkeys(v.value for v in (r.strategy, *(e.strategy for e in r.layers)))
    return [
        (OPTIMIZERS, cfg.optimizer.name.value),
        *((SOURCES, name) for name in sources),
        *((STRATEGY_REGISTRY, name) for name in strategies),
    ]


def _selected_variants_load(cfg: Config) -> None:
    """Every variant the config selects is usable: a broken plug-in (its module fails to import, its
    declaration is of the wrong kind, its name or an option clashes) is one line naming it and its fault,
    before anything reads its declaration. Plug-ins the config does not select are never reported."""
    for registry, name in selected_variants(cfg):
        registry.get(name)


def validate_eval_tool(tool) -> None:
    """`python -m trmoe.eval`'s keys (EvalToolConfig), as downstream.* is checked for training; whether the
    device is there is checked by the tool (it needs torch)."""
    if tool.limit is not None and tool.limit < 1:
        _fail("limit", tool.limit, "must be a positive integer (first N examples) or null (all)")
    if tool.num_fewshot is not None and tool.num_fewshot < 0:
        _fail("num_fewshot", tool.num_fewshot, "must be an integer >= 0 or null (each task's default)")
    if tool.batch_size < 1:
        _fail("batch_size", tool.batch_size, "must be a positive integer (requests per forward)")
    if tool.step is not None and tool.step < 0:
        _fail("step", tool.step, "must be an integer >= 0 or null (the newest complete checkpoint)")
    if tool.device not in ("auto", "cpu", "cuda", "mps") and not tool.device.startswith("cuda:"):
        _fail("device", tool.device, "allowed: auto, cpu, cuda, cuda:<n>, mps")
    if tool.dtype not in ("auto", "fp32", "bf16", "fp16"):
        _fail("dtype", tool.dtype, "allowed: auto, fp32, bf16, fp16")


def _validate_data(d) -> None:
    """data.*: the keys every source shares here; the selected source's own rules (its module in
    trmoe/data/sources, a mixture's for each of its sources too); a key only another source reads."""
    source = SOURCES.get(d.source)
    if source.validate is not None:
        source.validate(d, "data")
    check_exclusive(d)
    if not d.text_field:
        _fail("data.text_field", "''", "must name the column that holds the text")
    if d.workers < 0:
        _fail("data.workers", d.workers, "must be >= 0 (0 = tokenize in the background reader thread)")


def _validate_reliability(cfg: Config) -> None:
    """trainer.resume, checkpoint.* and guard.* (docs/reliability.md)."""
    t, c, g = cfg.trainer, cfg.checkpoint, cfg.guard
    check_run_name(cfg.run.name)  # (also where hydra.run.dir resolves it, before Hydra makes the directory)
    if not t.resume.strip():
        _fail("trainer.resume", "''", "allowed: auto, never, or the path of a checkpoint or run directory")
    if t.init_from is not None and not t.init_from.strip():
        _fail("trainer.init_from", "''", "allowed: null, or a run, checkpoint, convert or export directory")
    if t.init_from is not None and t.resume.strip() not in ("auto", "never"):
        _fail(
            "trainer.init_from",
            t.init_from,
            "starts a new run from weights, trainer.resume=<path> continues a checkpoint: use one of them",
        )
    if t.init_from is None and t.init_state != InitState.weights:
        _fail("trainer.init_state", t.init_state.value, "needs trainer.init_from (the run it starts from)")
    if c.every_steps < 0:
        _fail("checkpoint.every_steps", c.every_steps, "must be >= 0 (0 = only at the end)")
    if any(step < 1 for step in c.at_steps):
        _fail("checkpoint.at_steps", list(c.at_steps), "steps >= 1")
    if c.keep_last < 0:
        _fail("checkpoint.keep_last", c.keep_last, "must be >= 0 (0 = keep every checkpoint)")
    _positive(g, "guard", "max_skips")
    if g.spike_factor != 0 and g.spike_factor <= 1:
        _fail("guard.spike_factor", g.spike_factor, "must be > 1 (times the running median), or 0 = off")
    if g.spike_window < 3:
        _fail("guard.spike_window", g.spike_window, "must be >= 3 steps")
    if g.max_rollbacks < 0:
        _fail("guard.max_rollbacks", g.max_rollbacks, "must be >= 0")
    if g.spike_policy == SpikePolicy.rollback:
        if not c.enabled:
            _fail(
                "guard.spike_policy",
                "rollback",
                "reloads the last checkpoint: not with checkpoint.enabled=false (set it true, or "
                "guard.spike_policy=log)",
            )
        if g.spike_factor == 0:
            _fail("guard.spike_policy", "rollback", "needs spike detection: guard.spike_factor > 1")
        if c.every_steps == 0:
            _fail(
                "guard.spike_policy",
                "rollback",
                "reloads the last periodic checkpoint: set checkpoint.every_steps > 0",
            )


def frequencies_path(cfg: Config) -> Path | None:
    """The token-frequency table a frequency strategy reads: routing.frequencies, else the one the data
    source ships (data=tokens: data.path's token_counts.npy); None when neither names one."""
    r, d = cfg.routing, cfg.data
    if r.frequencies:
        path = Path(r.frequencies).expanduser().absolute()
        return path / TOKEN_COUNTS_NAME if path.is_dir() else path
    counts = SOURCES.get(d.source).counts
    return counts(d) if counts is not None else None


def layer_strategies(cfg: Config) -> tuple[str, ...]:
    """Every layer's routing strategy: routing.layers' ranges over routing.strategy. A range outside
    0..model.num_layers-1, with first > last, or sharing a layer with an earlier range is a UserError."""
    layers, r = cfg.model.num_layers, cfg.routing
    out = [r.strategy.value] * layers
    owner: list[int | None] = [None] * layers
    for i, entry in enumerate(r.layers):
        key, value = f"routing.layers[{i}]", f"{{first: {entry.first}, last: {entry.last}}}"
        if not 0 <= entry.first <= entry.last < layers:
            _fail(key, value, f"needs 0 <= first <= last <= {layers - 1} (model.num_layers={layers})")
        for layer in range(entry.first, entry.last + 1):
            if owner[layer] is not None:
                clash = f"overlaps routing.layers[{owner[layer]}] at layer {layer}; allowed: disjoint ranges"
                _fail(key, value, clash)
            owner[layer] = i
            out[layer] = RoutingStrategy(entry.strategy).value
    return tuple(out)


def needs_frequencies(cfg: Config) -> bool:
    """Some layer's strategy reads token counts (routing.frequencies)."""
    return any(REGISTRY[name].needs_frequencies for name in layer_strategies(cfg))


def _validate_embedding(cfg: Config, name: str, needed: bool) -> None:
    """routing.embedding: where the strategy reads it, a readable [V, H] token embedding (the others ignore
    it: one grid sets it for all its arms)."""
    source = cfg.routing.embedding
    if not needed:
        return
    allowed = "a [V, H] token embedding: a .npy, .pt or .safetensors file, or a trmoe export dir"
    if not source:
        _fail("routing.embedding", source, f"{name} needs {allowed}")
    try:
        import scipy.cluster.vq  # noqa: F401  (its k-means)
    except ImportError:
        _fail("routing.strategy", name, "needs scipy (pip install 'trmoe[report]')")
    from trmoe.model.embedding_routing import load_embedding

    try:
        load_embedding(Path(source).expanduser().absolute(), cfg.model.vocab_size)
    except ValueError as e:
        _fail("routing.embedding", source, str(e))


def _validate_distill(cfg: Config, names: list[str]) -> None:
    """routing.distill_from / distill_tokens: set for a distilled layer, and only then (the parent itself is
    checked where the run starts: trmoe.distill.resolve)."""
    r = cfg.routing
    distilled = [name for name in names if REGISTRY[name].distilled]
    if not distilled:
        if r.distill_from is not None:
            _fail(
                "routing.distill_from",
                r.distill_from,
                f"only read by routing.strategy=distilled ({names[0]})",
            )
        return
    if r.distill_tokens <= 0:
        _fail("routing.distill_tokens", r.distill_tokens, "must be > 0 (tokens of the counting pass)")
    allowed = "a run directory or checkpoint of a routing=learned or learned_v3 run, or arm:<name> in a sweep"
    if not r.distill_from:
        _fail("routing.distill_from", r.distill_from, f"routing.strategy=distilled needs {allowed}")
    if r.distill_from.startswith("arm:"):
        if not r.distill_from.removeprefix("arm:").strip():
            _fail("routing.distill_from", r.distill_from, f"names no arm; allowed: {allowed}")
    elif not Path(r.distill_from).expanduser().exists():
        _fail("routing.distill_from", r.distill_from, f"no such file or directory; allowed: {allowed}")


def _validate_dense(cfg: Config, names: list[str]) -> None:
    """`dense` layers (routing.layers): the shared expert widened by K routed experts' width, so there must be
    routed experts to take the width from, and some layer that still routes (a model of dense layers only is
    the dense control: model.routed_width=0)."""
    m, r = cfg.model, cfg.routing
    if not any(REGISTRY[name].dense for name in names):
        return
    key = "routing.strategy"
    if r.strategy.value != "dense":
        first = next(i for i, e in enumerate(r.layers) if RoutingStrategy(e.strategy).value == "dense")
        key = f"routing.layers[{first}].strategy"
    value = "dense"
    if all(REGISTRY[name].dense for name in names):
        _fail(
            key,
            value,
            "every layer dense: that is the dense control (model.num_experts=1 routing.top_k=1 "
            "model.routed_width=0); allowed: dense in some layers (routing.layers), routed in the others",
        )
    if m.routed_width == 0 or m.num_experts < 2:
        _fail(
            key,
            value,
            "a dense layer is widened by K routed experts' width: needs model.num_experts >= 2 and "
            f"model.routed_width > 0 (here {m.num_experts} and {m.routed_width})",
        )


def _validate_strategy(cfg: Config) -> None:
    """What the routing strategies of the layers need (trmoe/model/routing.py REGISTRY)."""
    m, r = cfg.model, cfg.routing
    for key in ("aux_weight", "z_weight", "seq_aux_weight", "bias_update"):
        if getattr(r, key) < 0:
            _fail(f"routing.{key}", getattr(r, key), "must be >= 0 (0 = off)")
    names = list(dict.fromkeys(layer_strategies(cfg)))
    _validate_dense(cfg, names)
    if r.combine.value == "learned":
        if not any(REGISTRY[name].fixed_routes for name in names):
            router = next(name for name in names if not REGISTRY[name].dense)
            _fail(
                "routing.combine",
                "learned",
                f"routing.strategy={router} is a router (its combine weights are its own); allowed: "
                "routing.combine=fixed, or a route-table strategy (in some layers: routing.layers)",
            )
        if m.routed_width == 0 or m.num_experts < 2 or r.top_k < 2:
            _fail(
                "routing.combine",
                "learned",
                "a learned combine needs model.num_experts >= 2, model.routed_width > 0 and "
                "routing.top_k >= 2 (one route's normalised weight is 1); allowed: routing.combine=fixed",
            )
    for name in names:
        entry = REGISTRY[name]
        if entry.learned and (m.routed_width == 0 or m.num_experts < 2):
            needs = "a router needs model.num_experts >= 2 and model.routed_width > 0"
            _fail("routing.strategy", name, needs)
        if name == "balanced_hash_all_tuples" and tuple_count(m.num_experts, r.top_k) > MAX_TUPLES:
            _fail("routing.strategy", name, f"E!/(E-K)! ordered tuples must be at most {MAX_TUPLES}")
        if entry.analysis_only and cfg.downstream.tasks:
            _fail(
                "downstream.tasks",
                list(cfg.downstream.tasks),
                f"routing.strategy={name} routes on the target token (analysis only: training and held-out "
                "loss); allowed: [] (no downstream evaluation)",
            )
    _validate_distill(cfg, names)
    embedded = [name for name in names if REGISTRY[name].needs_embedding]
    _validate_embedding(cfg, embedded[0] if embedded else names[0], bool(embedded))
    if r.frequencies and not needs_frequencies(cfg):
        _fail(
            "routing.frequencies",
            r.frequencies,
            f"only read by frequency_balanced_secondary (strategies: {', '.join(names)})",
        )
    if not needs_frequencies(cfg):
        return
    name = next(n for n in names if REGISTRY[n].needs_frequencies)
    path = frequencies_path(cfg)
    if path is None or not path.is_file():
        where = "not found: " + str(path) if path else "none given"
        _fail(
            "routing.frequencies",
            r.frequencies,
            f"{name} needs the token counts of the training split ({where}): python -m trmoe.data.prepare "
            f"writes {TOKEN_COUNTS_NAME} by the shards (data=tokens finds it), or set routing.frequencies",
        )
    try:
        counts = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        _fail("routing.frequencies", str(path), f"not a .npy token-count array ({exc})")
    if counts.shape != (m.vocab_size,) or counts.dtype.kind not in "iu":
        _fail(
            "routing.frequencies",
            str(path),
            f"holds {counts.dtype} {counts.shape}; expected integer counts of shape ({m.vocab_size},)",
        )


def _fraction(value: float, key: str) -> None:
    if not 0.0 <= value <= 1.0:
        _fail(key, value, "must be in [0, 1] (a share of the schedule horizon)")


def _validate_training_controls(cfg: Config) -> None:
    """Loss backends, optimizers, schedules and step controls (docs/training.md, docs/optimizers.md): a
    control that cannot take effect in this configuration is an error, never silently dropped."""
    m, r, o, loss, t = cfg.model, cfg.routing, cfg.optimizer, cfg.loss, cfg.trainer
    if loss.backend == LossBackend.torch:
        for name in ("label_smoothing", "z_loss"):
            if getattr(loss, name) != 0:
                _fail(
                    f"loss.{name}",
                    getattr(loss, name),
                    "loss.backend=torch (linear_cross_entropy's chunked path) has neither z-loss nor label "
                    "smoothing; allowed: 0, or loss.backend=chunked / liger",
                )
    if loss.diversity_weight < 0:
        _fail("loss.diversity_weight", loss.diversity_weight, "must be >= 0 (0 = off)")
    if loss.diversity_weight > 0 and (m.routed_width == 0 or m.num_experts < 2):
        _fail("loss.diversity_weight", loss.diversity_weight, "needs at least 2 routed experts; allowed: 0")
    _fraction(loss.diversity_ramp, "loss.diversity_ramp")

    if o.schedule_offset < 0:
        _fail("optimizer.schedule_offset", o.schedule_offset, "must be >= 0 (1 = the old runner's LambdaLR)")
    if o.decay_steps is not None and o.decay_steps < 1:
        _fail("optimizer.decay_steps", o.decay_steps, "must be a positive integer, or null for trainer.steps")
    _fraction(o.wsd_decay_fraction, "optimizer.wsd_decay_fraction")
    # the selected optimizer's own rules (its module in trmoe/optim/variants, or a plug-in's); a broken
    # plug-in's name stops here with its one line
    OPTIMIZERS.get(o.name).validate(cfg)

    if r.primary_weight_final is not None:
        if r.top_k == 1:
            _fail(
                "routing.primary_weight_final", r.primary_weight_final, "p has no effect with routing.top_k=1"
            )
        if not 0.0 <= r.primary_weight_final <= 1.0:
            _fail("routing.primary_weight_final", r.primary_weight_final, "must be in [0, 1]")
    _fraction(r.primary_weight_ramp, "routing.primary_weight_ramp")
    gated = m.gates and m.shared_width > 0 and m.routed_width > 0  # gates weigh two branches (moe.py)
    for branch in ("shared", "routed"):
        value = getattr(m, f"{branch}_gate_final")
        if value is not None and not gated:
            _fail(
                f"model.{branch}_gate_final",
                value,
                "there are no gates (model.gates=false, or a branch is absent: shared_width or routed_width "
                "is 0); allowed: null",
            )
    _fraction(m.gate_ramp, "model.gate_ramp")

    if t.shared_chunk_tokens < 0:
        _fail("trainer.shared_chunk_tokens", t.shared_chunk_tokens, "must be >= 0 (0 = off)")
    if t.shared_chunk_tokens > 0 and m.shared_width == 0:
        _fail(
            "trainer.shared_chunk_tokens", t.shared_chunk_tokens, "the model has no shared expert; allowed: 0"
        )
    if t.compile and not t.compile_backend:
        _fail("trainer.compile_backend", "''", "must name a torch.compile backend, e.g. inductor")


def validate_ladder(cfg: Config) -> None:
    """ladder.*: at least two rungs of strictly growing width that the rule can shape, budgets that grow,
    and a schedule the cooldown branches can share (wsd, a pinned warmup, nothing else that scales with the
    horizon). Checked before the rung is applied (docs/scaling.md)."""
    lad, o = cfg.ladder, cfg.optimizer
    if lad.name is None:
        return
    if not lad.name.strip():  # '' is not null: it would make a ladder that the report cannot name
        _fail("ladder.name", repr(lad.name), "a name for the ladder (null: not a ladder run)")
    if len(lad.hidden) < 2:
        _fail("ladder.hidden", list(lad.hidden), "a ladder needs at least 2 rungs (3 for a fit)")
    if any(b <= a for a, b in zip(lad.hidden, lad.hidden[1:], strict=False)) or lad.hidden[0] < 1:
        _fail("ladder.hidden", list(lad.hidden), "the rungs' hidden sizes must grow strictly from >= 1")
    _positive(lad, "ladder", "head_dim", "kv_group", "aspect", "min_layers", "num_experts", "top_k")
    if lad.top_k > lad.num_experts:
        _fail("ladder.top_k", lad.top_k, f"allowed: 1..ladder.num_experts={lad.num_experts}")
    if lad.head_dim % 2 or any(h % lad.head_dim for h in lad.hidden):
        _fail(
            "ladder.head_dim",
            lad.head_dim,
            f"must be even and divide every ladder.hidden={list(lad.hidden)} (num_heads = hidden / head_dim)",
        )
    heads = [h // lad.head_dim for h in lad.hidden]
    if any(n % lad.kv_group for n in heads):  # max(1, n // kv_group) would group some rungs otherwise
        _fail(
            "ladder.kv_group",
            lad.kv_group,
            f"must divide every rung's num_heads {heads} (hidden / head_dim), so that every rung groups "
            f"{lad.kv_group} query heads per key/value head",
        )
    if not 0 <= lad.rung < len(lad.hidden):
        _fail("ladder.rung", lad.rung, f"allowed: 0..{len(lad.hidden) - 1} (an index into ladder.hidden)")
    for name in ("shared_ratio", "routed_ratio"):
        if getattr(lad, name) <= 0:
            _fail(f"ladder.{name}", getattr(lad, name), "must be a positive multiple of the hidden size")
    key, budgets = (
        ("ladder.tokens", lad.tokens)
        if lad.tokens is not None
        else ("ladder.tokens_per_param", lad.tokens_per_param)
    )
    if not budgets or any(b <= 0 for b in budgets):
        _fail(key, list(budgets), "one or more positive budgets")
    if any(b <= a for a, b in zip(budgets, budgets[1:], strict=False)):
        _fail(key, list(budgets), "the budgets must grow strictly (each a branch of the one stable run)")
    if o.schedule.value != "wsd":
        _fail(
            "optimizer.schedule",
            o.schedule.value,
            "a ladder branches cooldowns from a stable run; allowed: wsd",
        )
    if o.warmup_steps is None:
        _fail(
            "optimizer.warmup_steps",
            None,
            "a ladder pins the warmup (its default scales with the horizon, which differs per budget); "
            "allowed: a number of steps",
        )
    if cfg.trainer.init_from is not None and cfg.trainer.init_state != InitState.branch:
        _fail("trainer.init_from", cfg.trainer.init_from, "a ladder sets it for its branches; allowed: null")
    horizon = {
        "model.shared_gate_final": cfg.model.shared_gate_final,
        "model.routed_gate_final": cfg.model.routed_gate_final,
        "routing.primary_weight_final": cfg.routing.primary_weight_final,
        "loss.diversity_ramp": cfg.loss.diversity_ramp or None,
    }
    for name, value in horizon.items():
        if value is not None:
            _fail(
                name, value, "scales with the LR horizon, which differs per budget of a ladder; allowed: null"
            )
