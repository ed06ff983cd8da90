"""The comparability check: are these runs comparable by the reproducible-comparison checklist?

    same tokenizer and vocabulary; same data order and split; same token budget; same parameter count or an
    explicitly reported mismatch; same seed set; same optimizer and schedule; same precision and hardware;
    same telemetry and compile settings; same evaluation checkpoints; throughput over the same interval.

Every recorded fact of every run (the resolved config, the data description, token counts, parameters, the
backend, the code version, the evaluation steps, the throughput rows) is compared across runs. A difference
is *by design* when the sweep made it: the runs share every override except the swept keys. Anything else is
a warning at the top of the report. Token budget, parameter count, evaluation steps and the seed set are
always warnings when they differ, swept or not: final losses are not comparable across them. So are
differences of the machine or code (device name, torch version, git commit), which no override explains.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from trmoe.report.compare import Arm, swept_keys
from trmoe.report.runs import SEED_KEY, Run, is_hidden_key, override_dict
from trmoe.report.summary import THROUGHPUT_WARMUP_STEPS, Summary, resume_warnings
from trmoe.run.status import FAILED, FINISHED

ITEMS = {
    "tokenizer": "Tokenizer and vocabulary",
    "data": "Data, order and split",
    "budget": "Token budget",
    "params": "Parameter count",
    "seeds": "Seed set",
    "optimizer": "Optimizer and schedule",
    "hardware": "Precision and hardware",
    "telemetry": "Telemetry and compile settings",
    "eval": "Evaluation checkpoints",
    "throughput": "Throughput interval",
    "other": "Everything else (model, attention, routing, loss, code version)",
}
CRITICAL = ("total_tokens", "params.total", "params.active", "eval.steps", "derived.eval_windows")
CONFIG_DERIVED_BACKEND = ("backend.device", "backend.autocast_dtype", "backend.deterministic")
BUDGET_KEYS = (
    "total_tokens",
    "tokens_per_step",
    "world_size",
    "derived.global_batch_tokens",
    "derived.world_size",
)
BUDGET_KEYS += tuple(f"config.trainer.{k}" for k in ("steps", "micro_batch", "grad_accum", "seq_len"))
# How a step's tokens are split over micro-batches, accumulation and devices: with the same tokens per step
# and total the runs train on the same budget (the held-out set each scores is its own item, eval).
SPLIT_KEYS = (
    "config.trainer.micro_batch",
    "config.trainer.grad_accum",
    "world_size",
    "derived.world_size",
)


def item_of(key: str) -> str:
    low = key.lower()
    if "telemetry" in low or "compile" in low:
        return "telemetry"
    if key in (
        "data.tokenizer",
        "data.tokenizer_sha256",
        "config.tokenizer.name",
        "config.tokenizer.path",
        "config.tokenizer.sha256",
        "config.model.vocab_size",
        "config.model.vocab_pad_multiple",
    ):
        return "tokenizer"
    if key.startswith(("data.eval_", "data.metric_streams.")):  # what each evaluation scores
        return "eval"
    if key in (
        "eval.steps",
        "config.trainer.eval_every",
        "config.trainer.eval_batches",
        "derived.eval_windows",
    ):
        return "eval"
    if key.startswith(("data.", "config.data.")):
        return "data"
    if key in BUDGET_KEYS:
        return "budget"
    if key in ("params.total", "params.active"):
        return "params"
    if key.startswith(("config.optimizer.", "controls.optimizer_groups", "controls.schedules.")):
        return "optimizer"
    if key == "config.trainer.grad_clip":
        return "optimizer"
    if key.startswith(("config.hardware.", "backend.")) or key == "derived.precision":
        return "hardware"
    if key in ("config.trainer.log_every", "throughput.steps"):
        return "throughput"
    return "other"


def _is_environment(key: str) -> bool:
    """Facts of the machine or the code that no override sets."""
    backend = key.startswith("backend.") and key not in CONFIG_DERIVED_BACKEND
    return backend or key.startswith("git.") or key == "force_resumed"


def _flatten(node: Any, prefix: str, out: dict[str, str]) -> None:
    if isinstance(node, list) and node and all(isinstance(x, dict) and "name" in x for x in node):
        node = {str(x["name"]): {k: v for k, v in x.items() if k != "name"} for x in node}  # named items
    if isinstance(node, dict):
        for k, v in node.items():
            _flatten(v, f"{prefix}.{k}", out)
    else:
        out[prefix] = json.dumps(node, sort_keys=True) if isinstance(node, list) else str(node)


def facts(run: Run, summary: Summary) -> dict[str, str]:
    rec = run.record
    out: dict[str, str] = {}
    # run.name / progress: presentation only; logger: the trackers record the run, they train nothing
    config = {k: v for k, v in run.config.items() if k not in ("run", "logger")}
    _flatten(config, "config", out)
    out.pop(f"config.{SEED_KEY}", None)  # the seed set is its own item
    _flatten(rec.get("data") or {}, "data", out)
    _flatten(rec.get("backend") or {}, "backend", out)
    _flatten(rec.get("git") or {}, "git", out)
    _flatten(rec.get("controls") or {}, "controls", out)  # loss backend, optimizer groups, schedules, compile
    _flatten(rec.get("derived") or {}, "derived", out)  # global batch in tokens, effective precision
    if "force_resumed" in rec:  # continued although training-critical keys differed
        out["force_resumed"] = str(rec["force_resumed"])
    for key in ("total_tokens", "tokens_per_step", "world_size"):
        if key in rec:
            out[key] = str(rec[key])
    # the count the grid matched (model.match_count): a grid matched on active parameters (dense and routed
    # layers, experiment=first_k) differs in its totals by design
    count = (rec.get("param_match") or {}).get("count") or "total"
    if (rec.get("params") or {}).get(count) is not None:
        out[f"params.{count}"] = str(rec["params"][count])
    if run.status == FINISHED:  # an unfinished run has not reached every evaluation yet
        out["eval.steps"] = str([int(s) for s, _, _ in run.series("eval_loss")])
        steps = summary.tok_s_rows
        out["throughput.steps"] = (
            f"{len(steps)} windows, steps {steps[0]}..{steps[-1]}" if steps else "no window after warm-up"
        )
    return out


def _recipe(run: Run, swept: set[str]) -> frozenset[str]:
    """The run's overrides other than the swept ones and the seed (the replicate, checked as the seed set):
    what its launch command fixed."""
    return frozenset(
        f"{k}={v}"
        for k, v in override_dict(run.overrides).items()
        if k not in swept and k != SEED_KEY and not is_hidden_key(k)
    )


# Recorded facts derived from a config section: a swept key in that section explains them.
DERIVED_FROM = {
    "data": ("data.",),
    "hardware": CONFIG_DERIVED_BACKEND + ("derived.precision",),
    "optimizer": ("controls.optimizer_groups", "controls.schedules."),
    "loss": ("controls.loss_backend",),
    "trainer": ("derived.global_batch_tokens", "total_tokens", "tokens_per_step", "controls.compile."),
}


def _explains(swept_key: str, fact: str) -> bool:
    """Whether sweeping swept_key (a key, or a whole group such as `routing`) can make this fact differ."""
    if fact == f"config.{swept_key}" or fact.startswith(f"config.{swept_key}."):
        return True
    return fact.startswith(DERIVED_FROM.get(swept_key.split(".")[0], ()))


def _values_text(by_value: dict[str, list[str]], limit: int = 4, width: int = 60) -> str:
    parts = []
    for value, names in list(by_value.items())[:limit]:
        who = ", ".join(names[:3]) + (f" +{len(names) - 3}" if len(names) > 3 else "")
        shown = value if len(value) <= width else value[: width - 1] + "…"
        parts.append(f"{shown} ({who})")
    more = f"; {len(by_value) - limit} more values" if len(by_value) > limit else ""
    return "; ".join(parts) + more


@dataclass
class CheckItem:
    key: str
    title: str
    status: str  # "same" | "differs by the swept keys" | "DIFFERS" | "UNKNOWN" (a run has no record)
    detail: str


def _warmup(common: dict[str, str]) -> str:
    """optimizer.warmup_steps as the schedule resolves it: None is 5% of the horizon (trmoe.optim.schedule),
    shown as such with its number of steps where the horizon is the same for every run."""
    warmup = common.get("config.optimizer.warmup_steps", "n/a")
    if warmup != "None":
        return warmup if warmup == "n/a" else f"{warmup} steps"
    decay, steps = common.get("config.optimizer.decay_steps"), common.get("config.trainer.steps")
    horizon = decay if decay not in (None, "None") else steps
    if horizon is None or not horizon.isdigit():
        return "5% of the horizon"
    return f"5% of the horizon ({max(1, round(0.05 * int(horizon)))} of {horizon} steps)"


def _same_detail(item: str, common: dict[str, str], arms: list[Arm]) -> str:
    get = common.get
    if item == "tokenizer":
        return f"{get('data.tokenizer', 'n/a')}, vocab {get('config.model.vocab_size', 'n/a')}"
    if item == "data":
        return (
            f"{get('config.data.source', 'n/a')}, order {get('config.data.order', 'n/a')}, eval fraction "
            f"{get('config.data.eval_fraction', 'n/a')}, split seed {get('config.data.split_seed', 'n/a')}"
        )
    if item == "budget":
        total = get("total_tokens")
        return (
            f"{int(total):,} tokens ({get('config.trainer.steps')} steps x {get('tokens_per_step')})"
            if total
            else "n/a"
        )
    if item == "params":
        total, active = get("params.total"), get("params.active")
        return f"{int(total):,}" if total else f"{int(active):,} active" if active else "n/a"
    if item == "optimizer":
        return (
            f"{get('config.optimizer.name', 'n/a')}, lr {get('config.optimizer.lr', 'n/a')}, schedule "
            f"{get('config.optimizer.schedule', 'n/a')}, warmup {_warmup(common)}, clip "
            f"{get('config.trainer.grad_clip', 'n/a')}"
        )
    if item == "hardware":
        return (
            f"{get('backend.device', 'n/a')} ({get('backend.device_name', 'n/a')}), autocast "
            f"{get('backend.autocast_dtype', 'n/a')}, torch {get('backend.torch', 'n/a')}"
        )
    if item == "telemetry":
        keys = [k for k in common if item_of(k) == "telemetry" and k.startswith("config.")]
        return (
            ", ".join(f"{k.removeprefix('config.')}={common[k]}" for k in keys)
            or "none recorded by these runs"
        )
    if item == "eval":
        return f"steps {get('eval.steps', 'n/a')}, {get('data.eval_tokens_scored', 'n/a')} tokens scored each"
    if item == "throughput":
        return (
            f"median of tok/s windows after step {THROUGHPUT_WARMUP_STEPS}, evaluation rows left out; "
            f"log every {get('config.trainer.log_every', 'n/a')} steps ({get('throughput.steps', 'n/a')})"
        )
    return "same"


def check(
    runs: list[Run], arms: list[Arm], summaries: dict[str, Summary]
) -> tuple[list[str], list[CheckItem]]:
    warnings: list[str] = []
    failed = [r for r in runs if r.status == FAILED]
    unfinished = [r for r in runs if r.status not in (FAILED, FINISHED)]
    if failed:
        warnings.append(f"{len(failed)} run(s) failed: " + ", ".join(r.name for r in failed))
    if unfinished:
        warnings.append(
            f"{len(unfinished)} run(s) not finished (running, or stopped without a status): "
            + ", ".join(r.name for r in unfinished)
        )
    diverged = [r for r in runs if summaries[r.name].diverged]
    if diverged:
        warnings.append(
            f"{len(diverged)} run(s) diverged (left out of the paired comparison): "
            + "; ".join(f"{r.name}: {summaries[r.name].diverged}" for r in diverged)
        )
    disagree = [r for r in runs if summaries[r.name].disagreements]
    if disagree:
        warnings.append(
            f"{len(disagree)} run(s) whose records disagree: "
            + "; ".join(f"{r.name}: {', '.join(summaries[r.name].disagreements)}" for r in disagree)
        )
    resumed, changed_text = resume_warnings(runs, summaries)
    warnings += resumed
    unreadable = [r for r in runs if r.unreadable]
    if unreadable:
        warnings.append(
            f"{len(unreadable)} run(s) with unreadable records (what they hold is missing from the tables "
            "and the checklist): " + "; ".join(f"{r.name}: {', '.join(r.unreadable)}" for r in unreadable)
        )

    recorded = [r for r in runs if r.record]
    # A run that trained (it is not a failed launch) but has no run_config.json: its facts are unknown, and an
    # unknown never counts as matching (every item says so instead of "same").
    unknown = [r.name for r in runs if not r.record and r.status != FAILED]
    if unknown:
        warnings.append(
            f"{len(unknown)} run(s) without a readable run_config.json: whether they match the others on the "
            "checklist below is unknown: " + ", ".join(unknown)
        )
    swept = set(swept_keys(runs))
    recipes = {r.name: _recipe(r, swept) for r in recorded}
    recipes_equal = len(set(recipes.values())) <= 1
    if not recipes_equal:
        keys = sorted({o.split("=", 1)[0] for rec in recipes.values() for o in rec})
        diffs = []
        for key in keys:
            by_value: dict[str, list[str]] = {}
            for r in recorded:
                value = override_dict(list(recipes[r.name])).get(key, "(not overridden)")
                by_value.setdefault(value, []).append(r.name)
            if len(by_value) > 1:
                diffs.append(f"`{key}`: {_values_text(by_value)}")
        warnings.append(
            "runs were launched with different overrides beyond the swept keys: " + "; ".join(diffs)
        )

    table = {r.name: facts(r, summaries[r.name]) for r in recorded}
    all_keys = list(dict.fromkeys(k for f in table.values() for k in f))
    differing: dict[str, list[tuple[str, dict[str, list[str]], bool]]] = {k: [] for k in ITEMS}
    common: dict[str, str] = {}
    for key in all_keys:
        by_value: dict[str, list[str]] = {}
        for name, f in table.items():
            if key in f or not key.startswith(("eval.", "throughput.")):
                by_value.setdefault(f.get(key, "(absent)"), []).append(name)
        if len(by_value) <= 1:
            if by_value:
                common[key] = next(iter(by_value))
            continue
        explained = (
            key not in CRITICAL
            and not _is_environment(key)
            and (recipes_equal or any(_explains(s, key) for s in swept))
        )
        differing[item_of(key)].append((key, by_value, explained))
    split = []
    if "tokens_per_step" in common and "total_tokens" in common:
        split = [d for d in differing["budget"] if d[0] in SPLIT_KEYS]
        differing["budget"] = [d for d in differing["budget"] if d[0] not in SPLIT_KEYS]
    items = []
    for item, title in ITEMS.items():
        if item == "seeds":
            seeds = _seed_item(arms, warnings)
            if unknown and seeds.status == "same":  # the seed of a run without its record is unknown
                seeds = CheckItem(
                    item, title, "UNKNOWN", f"{seeds.detail}; not recorded by {', '.join(unknown)}"
                )
            items.append(seeds)
            continue
        diffs = sorted(differing[item], key=lambda d: d[2])  # the unexplained differences first
        if not diffs and unknown:
            items.append(CheckItem(item, title, "UNKNOWN", "not recorded by " + ", ".join(unknown)))
            continue
        if not diffs:
            detail = _same_detail(item, common, arms)
            if item == "budget" and split:
                detail += "; split otherwise: " + "; ".join(f"`{k}`: {_values_text(v)}" for k, v, _ in split)
            if item == "eval" and changed_text:  # one set across runs, but not across a run's own evaluations
                items.append(CheckItem(item, title, "DIFFERS", f"{detail}; but {changed_text}"))
                continue
            items.append(CheckItem(item, title, "same", detail))
            continue
        shown = "; ".join(f"`{k}`: {_values_text(v)}" for k, v, _ in diffs[:3])
        shown += f"; {len(diffs) - 3} more differing key(s)" if len(diffs) > 3 else ""
        if item == "params":
            shown += _match_note(recorded)
        unexplained = [d for d in diffs if not d[2]]
        if unexplained:
            listed = "; ".join(f"`{k}`: {_values_text(v)}" for k, v, _ in unexplained[:3])
            more = f"; {len(unexplained) - 3} more differing key(s)" if len(unexplained) > 3 else ""
            note = _match_note(recorded) if item == "params" else ""
            swept_note = (
                " (swept, but final losses are not comparable across it)"
                if item in ("budget", "params", "eval") and recipes_equal
                else ""
            )
            warnings.append(f"{title} differs{swept_note}: {listed}{more}{note}")
            items.append(CheckItem(item, title, "DIFFERS", shown))
        else:
            items.append(CheckItem(item, title, "differs by the swept keys", shown))
    return warnings, items


def _match_note(runs: list[Run]) -> str:
    notes = []
    for r in runs:
        m = r.record.get("param_match")
        if m and m.get("residual"):
            notes.append(f"{r.name}: match residual {m['residual']:+,}")
    return (" (reported: " + "; ".join(notes[:4]) + ")") if notes else ""


def _seed_item(arms: list[Arm], warnings: list[str]) -> CheckItem:
    title = ITEMS["seeds"]
    # Arms without a finished run are reported as failed already; the others must share one seed set.
    sets = {arm.label: tuple(arm.seeds) for arm in arms if arm.seeds}
    distinct = set(sets.values())
    if len(distinct) <= 1:
        seeds = next(iter(distinct), ())
        note = " (one seed per arm: no confidence interval)" if len(seeds) == 1 else ""
        return CheckItem("seeds", title, "same", f"{list(seeds)} in every arm{note}")
    by_set: dict[str, list[str]] = {}
    for label, seeds in sets.items():
        by_set.setdefault(str(list(seeds)), []).append(label)
    text = _values_text(by_set)
    warnings.append(f"{title} differs between arms (finished runs): {text}")
    return CheckItem("seeds", title, "DIFFERS", text)
