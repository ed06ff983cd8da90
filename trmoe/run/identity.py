"""Whether two attempts of a run are the same experiment: the training view, its critical hash and the diff.

The stored config (in a checkpoint's meta.json, or run_config.json) and a launch's config are flattened to
dotted keys and compared; a key is *volatile* (may change) only if it matches a pattern in VOLATILE_KEYS, so
every other key, including keys added to the schema later, is *training-critical* (a key this trmoe added
since a record was written counts there as its default: `_new_option_at_default`). Derived values join the
comparison: the global batch in tokens and the effective precision are critical (micro_batch, grad_accum,
world size and hardware may change as long as they are kept), and so is the data identity (`data_info.*`,
from the data pipeline's record). The launch decision (trmoe.run.launch) acts on the differences.
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from trmoe.config.derived import eval_windows, global_batch_tokens
from trmoe.config.plugins import selected_plugins
from trmoe.config.schema import GROUPS, AttentionKind, Config

ABSENT = "<absent>"

# Keys that may differ between the attempts of one run (fnmatch patterns over dotted keys). Everything else
# is training-critical. Add a key here only if changing it mid-run cannot change what is learned.
VOLATILE_KEYS = (
    "run.*",  # name, progress display, overwrite
    "trainer.steps",  # extend or shorten a run (the schedules' past must stay the same: see _check_schedules)
    "optimizer.decay_steps",  # pin the old horizon to extend a run: _check_schedules refuses any change
    "optimizer.warmup_steps",  # that would bend the LR of the steps already run
    "trainer.log_every",
    "trainer.eval_every",
    "trainer.eval_batches",
    "trainer.resume",
    "trainer.init_from",  # where the parent is (a moved sweep's branches); its content hash is checked when
    # the run starts from it again (trmoe.train.init_from), a resume reads its own checkpoints only
    "trainer.force_resume",
    "trainer.micro_batch",  # with grad_accum and the world size: how the global batch is split;
    "trainer.grad_accum",  # derived.global_batch_tokens is the critical value
    "trainer.activation_checkpointing",  # memory, not math
    "trainer.shared_chunk_tokens",  # memory, not math
    "trainer.compile",  # execution, not math
    "trainer.compile_backend",
    "trainer.max_hours",  # the launch's wall-time limit, not math
    "trainer.stop_within",  # how soon a stop signal ends the run, not math
    "checkpoint.*",
    "guard.*",
    "telemetry.*",  # observation only
    "logger.*",  # experiment trackers: observation only
    "downstream.every",  # downstream evaluation: observation only (tasks and limit define metrics.csv's
    "downstream.include_path",  # columns and what they mean, so they stay fixed within a run)
    "downstream.batch_size",
    "debug.anomaly",  # checks, not math
    "debug.profile*",
    "hardware.*",  # device, threads, determinism; derived.precision is the critical value
    "loss.chunk_tokens",  # memory, not math
    "data.text_path",  # where the file is; its content hash (data_info.sha256) is critical
    "data.path",  # where the token shards / Parquet files are; their content hashes (data_info) are critical
    "data.eval_path",
    "data.jsonl_eval_path",
    "data.workers",  # reader parallelism
    "data.pin_memory",
    "data.verify",
    "derived.world_size",
    "derived.plugins.*.entry_point",  # where a plug-in lives; its distribution and version are critical
    "derived.eval_windows",  # follows trainer.eval_batches and micro_batch; the report keeps sets apart
    "data_info.path",  # location; the content is identified by its hashes
    "data_info.*.path",  # (nested: data_info.shards.train.path, data_info.stream.path)
    "data_info.*.paths",  # the Parquet files' locations (their hashes: data_info.stream.files)
    "data_info.name",  # a text corpus is named by its file's location ("text:/abs/path")
    "data_info.eval_*",  # the evaluation set's size follows trainer.eval_batches and micro_batch
    "data_info.metric_streams",
    "data.sources.*.text_path",  # data=mixture: as data.text_path, data.path, data.eval_path, per source
    "data.sources.*.path",
    "data.sources.*.eval_path",
    "data_info.sources.*.name",  # a text source is named by its file's location
    "data_info.sources.*.path",
    "data_info.sources.*.eval_*",
    "data_info.sources.*.metric_streams",
    "data_info.plan.*",  # a mixture's samples and epochs per source over trainer.steps (which may change)
    "routing.embedding",  # where the file is; its content hash (derived.route_embedding_sha256) is critical
    "tokenizer.path",  # where the tokenizer.json is; its content hash (tokenizer.sha256) is critical
)


# Keys a newer trmoe records that an older one did not: absent from a stored record, they are no difference
# (a resume across the upgrade continues); present in both, they are compared like any other.
ADDED_KEYS = ("data_info.*sample_sha256", "derived.route_embedding_sha256")


def _added_later(key: str, old: Any) -> bool:
    return old == ABSENT and any(fnmatch.fnmatchcase(key, pattern) for pattern in ADDED_KEYS)


@functools.cache
def schema_defaults() -> dict[str, Any]:
    """Every config key of this trmoe's schema with its default (dotted keys, enums as their names): the
    groups' classes (built-in and plug-in options included) and the top-level sections."""
    container = OmegaConf.to_container(OmegaConf.structured(Config), enum_to_str=True)
    for name, cls in GROUPS.items():
        container[name] = OmegaConf.to_container(OmegaConf.structured(cls), enum_to_str=True)
    return flatten(container)


def _new_option_at_default(key: str, old: Any, new: Any) -> bool:
    """A config key an older trmoe did not have (a new optimizer's or data source's option, an installed
    plug-in's): absent from the stored record and at its default now, it is no difference, since an option
    added later defaults to the behaviour from before it (lion's betas on an adamw run, data.jsonl_eval_path
    on a text run). Set to anything else, it is compared as usual (`<absent> -> value`)."""
    defaults = schema_defaults()
    return old == ABSENT and key in defaults and defaults[key] == new


def _option_no_longer_known(key: str, old: Any, new: Any) -> bool:
    """The reverse: a recorded optimizer.*/data.* key this schema does not have is an option of a variant no
    longer installed (an uninstalled plug-in's, recorded while another variant was selected). A run that
    selected that variant is refused by its name (no such optimizer or source), so the key alone is no
    difference."""
    return new == ABSENT and key.split(".")[0] in ("optimizer", "data") and key not in schema_defaults()


def is_volatile(key: str) -> bool:
    """A pattern names a key or a whole subtree: `data_info.metric_streams` covers its flattened keys
    (`data_info.metric_streams.eval_loss`), which a plain fnmatch of the pattern never matched."""
    return any(
        fnmatch.fnmatchcase(key, pattern) or fnmatch.fnmatchcase(key, f"{pattern}.*")
        for pattern in VOLATILE_KEYS
    )


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists and scalars are leaves."""
    if isinstance(tree, dict) and tree:
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def derived_record(view: dict[str, Any]) -> dict[str, Any]:
    """The derived values of a training view as run_config.json and meta.json keep them: nested as they
    were made (`plugins.<section>.<name>.version`)."""
    return unflatten({k[len("derived.") :]: v for k, v in view.items() if k.startswith("derived.")})


def unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    """{"a.b": 1} -> {"a": {"b": 1}}: flatten's inverse for keys without dots of their own."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def config_container(raw_cfg: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(raw_cfg, resolve=True, enum_to_str=True)  # type: ignore[return-value]


def derived_values(cfg: Config, world_size: int, amp_dtype: torch.dtype | None) -> dict[str, Any]:
    t = cfg.trainer
    plugins = selected_plugins(cfg)
    return {
        "global_batch_tokens": global_batch_tokens(t, world_size),
        "precision": "fp32" if amp_dtype is None else str(amp_dtype).replace("torch.", ""),
        "world_size": world_size,
        # the held-out set: its first eval_batches x micro_batch windows (docs/data.md). Volatile, but an
        # evaluation on another number of windows is another set: the report compares only equal ones
        "eval_windows": eval_windows(t),
        # the selected plug-ins' distributions and versions (critical); only when there are any, so a run
        # without plug-ins records what it recorded before them
        **({"plugins": plugins} if plugins else {}),
        # the routing embedding's content (critical) stands for routing.embedding (its location: volatile),
        # so a file moved with the same bytes resumes and one with other bytes is refused
        **_route_embedding_digest(cfg),
    }


def _route_embedding_digest(cfg: Config) -> dict[str, str]:
    from trmoe.config.spec import route_embedding_sha256  # with the ModelSpec: not for every run/ import

    digest = route_embedding_sha256(cfg)
    return {} if digest is None else {"route_embedding_sha256": digest}


def training_view(config: dict, derived: dict | None, data_info: dict | None) -> dict[str, Any]:
    """The flat key -> value map that two attempts of a run are compared on."""
    view = flatten(config)
    view.update(flatten({"derived": derived or {}}))
    if data_info is not None:
        view.update(flatten({"data_info": json.loads(json.dumps(data_info, default=str))}))
    return view


def _in_effect(view: dict[str, Any]) -> dict[str, Any]:
    """The view with model.num_kv_heads as the attention kind uses it: mha takes one per query head and
    mqa one, whatever the key says (two runs that differ only there build the same model)."""
    kind = view.get("attention.kind")
    if kind in ("mha", "mqa") and "model.num_kv_heads" in view:
        used = AttentionKind(kind).kv_heads(view.get("model.num_heads"), view["model.num_kv_heads"])
        return {**view, "model.num_kv_heads": used}
    return view


def critical_hash(view: dict[str, Any]) -> str:
    """sha256 of the training-critical part of a view: equal hashes, same experiment."""
    critical = {k: v for k, v in _in_effect(view).items() if not is_volatile(k)}
    return hashlib.sha256(json.dumps(critical, sort_keys=True, default=str).encode()).hexdigest()


@dataclass
class ConfigDiff:
    critical: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    volatile: dict[str, tuple[Any, Any]] = field(default_factory=dict)

    def render(self, which: str = "critical") -> str:
        items = self.critical if which == "critical" else self.volatile
        width = max((len(k) for k in items), default=0)
        lines = []
        for key, (old, new) in sorted(items.items()):
            note = _NOTES.get(key, "")
            lines.append(f"  {key:<{width}}  {_show(old)} -> {_show(new)}{note}")
        return "\n".join(lines)

    def as_record(self, which: str = "critical") -> dict[str, list[Any]]:
        items = self.critical if which == "critical" else self.volatile
        return {k: [old, new] for k, (old, new) in sorted(items.items())}


_NOTES = {
    "derived.global_batch_tokens": "  (micro_batch x seq_len x world size x grad_accum)",
    "derived.precision": "  (the autocast dtype hardware.precision resolves to on this device)",
}


def _show(value: Any) -> str:
    return value if value == ABSENT else json.dumps(value, default=str)


def compare(
    old: dict[str, Any], new: dict[str, Any], *, data_only: bool | None = None, derived: bool = True
) -> ConfigDiff:
    """Differences between two views. data_only=True compares only data_info.* keys, False all but them;
    derived=False leaves out the derived.* keys (`old` records none: a launch killed before its record)."""
    diff = ConfigDiff()
    old, new = _in_effect(old), _in_effect(new)
    for key in sorted(set(old) | set(new)):
        if data_only is not None and key.startswith("data_info.") != data_only:
            continue
        if not derived and key.split(".")[0] == "derived":
            continue
        a, b = old.get(key, ABSENT), new.get(key, ABSENT)
        if (
            a == b
            or _added_later(key, a)
            or _new_option_at_default(key, a, b)
            or _option_no_longer_known(key, a, b)
        ):
            continue
        (diff.volatile if is_volatile(key) else diff.critical)[key] = (a, b)
    return diff
