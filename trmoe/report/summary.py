"""The figures of one run: held-out loss (final, best), bits per byte, train loss, throughput and MFU."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from trmoe.model.flops import datasheet_peak, flops_terms
from trmoe.report.integrity import assess, held_out_changes, value_at
from trmoe.report.runs import Run

# Throughput: the median of the logged tok/s windows after this step (the first steps include allocator and
# cache warm-up), leaving out the rows of evaluation steps.
THROUGHPUT_WARMUP_STEPS = 10


@dataclass
class Summary:
    final_eval: float | None
    best_eval: float | None
    eval_bpb: float | None
    bpb_estimated: bool  # True: from the held-out split's bytes per token; the run has no eval_bpb column
    train_loss: float | None
    median_tok_s: float | None
    tok_s_rows: list[int]  # the steps whose windows the median is taken over
    mfu: float | None
    tokens: int | None  # tokens trained by the final step (its row; None: unknown, the run's notes say why)
    params_total: int | None
    params_active: int | None
    sources: dict[str, tuple[float | None, float | None]] = field(default_factory=dict)  # mixture: final
    # held-out (loss, bpb) of each source (metrics.csv eval_loss/<source>, eval_bpb/<source>)
    accuracies: dict[str, float | None] = field(default_factory=dict)  # downstream.tasks: the final
    # acc/<task> and acc_norm/<task> (metrics.csv columns; higher is better)
    held_out_note: str | None = None  # the held-out set changed on a resume: best_eval covers the last set
    diverged: str | None = None  # why the run counts as diverged (trmoe.report.integrity); None if it did not
    disagreements: list[str] = field(default_factory=list)  # its records contradict each other
    history_gap: str | None = None  # metrics.csv lacks the steps before a resume (resumed without it)


def is_accuracy(column: str) -> bool:
    """A downstream accuracy column of metrics.csv (observe/downstream.py): acc/<task>, acc_norm/<task>."""
    return column.startswith(("acc/", "acc_norm/"))


def throughput_rows(run: Run) -> list[tuple[float, float, float]]:
    """(step, tokens, tok/s) of the rows the throughput median uses: after warm-up, no evaluation rows."""
    evals = {step for step, _, _ in run.series("eval_loss")}
    return [r for r in run.series("tok_s") if r[0] > THROUGHPUT_WARMUP_STEPS and r[0] not in evals]


def flops_per_token(run: Run) -> float | None:
    """Training FLOPs per token: 6 x active non-embedding parameters + 6 x L x S x d_attn (causal attention
    scores) + 6 x H x V (the tied head), the definition of trmoe.model.flops (`trmoe.bench step`, the
    planner)."""
    spec, params = run.record.get("model_spec") or {}, run.record.get("params") or {}
    seq = run.config_value("trainer.seq_len")
    try:
        terms = flops_terms(
            active=params["active"],
            embedding=params["embedding"],
            num_layers=spec["num_layers"],
            num_heads=spec["num_heads"],
            head_dim=spec["head_dim"],
            hidden_size=spec["hidden_size"],
            embedding_rows=spec["embedding_rows"],
            seq_len=seq,
        )
    except (KeyError, TypeError):
        return None
    return terms.total


def peak_flops(run: Run, override: float | None) -> float | None:
    if override:
        return override
    backend = run.record.get("backend") or {}
    if not str(backend.get("device", "")).startswith("cuda"):
        return None
    if backend.get("autocast_dtype") not in ("bfloat16", "float16"):
        return None  # an fp32 run on a GPU: the bf16 peak would understate its MFU's meaning
    return datasheet_peak(str(backend.get("device_name", "")), "bf16")


def summarize(run: Run, peak_override: float | None = None) -> Summary:
    evals = run.series("eval_loss")
    end = assess(run)  # the final step and its figures only (a diverged run's NaN is not skipped)
    final_eval = end.final_eval
    changes = held_out_changes(run)
    since = changes[-1][0] if changes else -math.inf  # evaluations after the last change: the final set
    best_eval = min((v for step, _, v in evals if step > since), default=None)
    note = None
    if changes:
        what = "; ".join(f"at step {step} ({text})" for step, text in changes)
        note = f"held-out set changed on resume {what}: best eval over the steps after {since} only"

    bpb, estimated = value_at(run, end.final_step, "eval_bpb"), False
    bpb = bpb if bpb is not None and math.isfinite(bpb) else None
    split = (run.record.get("data") or {}).get("eval")
    split = split if isinstance(split, dict) else {}  # data=random describes its eval stream in words
    # Estimated only where the run has no eval_bpb column: a recorded NaN (ids that are not text) or rows
    # that disagree stay unknown, and the report's footnote "the run did not record eval_bpb" stays true.
    unrecorded = bpb is None and not run.has_column("eval_bpb")
    if unrecorded and final_eval is not None and split.get("tokens") and split.get("bytes"):
        # nats/token -> bits/byte with the held-out split's tokens per byte (the scored batches are a prefix)
        bpb, estimated = final_eval / math.log(2) * split["tokens"] / split["bytes"], True

    rows = throughput_rows(run)
    median_tok_s = statistics.median(v for _, _, v in rows) if rows else None
    mfu = None
    if run.has_column("mfu") and not peak_override:  # recorded against the run's own peak; an explicit
        # peak (report --peak-tflops) re-derives it from tok/s below
        recorded = [v for s, _, v in run.series("mfu") if s in {r[0] for r in rows}]
        mfu = statistics.median(recorded) if recorded else None
    if mfu is None and median_tok_s is not None:
        flops, peak = flops_per_token(run), peak_flops(run, peak_override)
        world = run.record.get("world_size")
        world = world if isinstance(world, int) and world > 0 else 1  # a garbled record: as one device
        if flops and peak:  # tok/s is the whole job's, the peak one device's
            mfu = median_tok_s / world * flops / peak
    if mfu is not None and mfu > 1:  # above the peak: that peak reads low, the figure is no utilisation
        mfu = None

    tokens = value_at(run, end.final_step, "tokens")
    gap = None
    resumes = run.record.get("resumes")
    for entry in resumes if isinstance(resumes, list) else []:
        kept_rows = entry.get("metrics_rows") if isinstance(entry, dict) else None
        kept, expected = kept_rows if isinstance(kept_rows, list) and len(kept_rows) == 2 else [None, None]
        if isinstance(kept, int) and isinstance(expected, int) and kept < expected:
            gap = (
                f"resumed at step {entry.get('from_step')} with {kept} of the {expected} metrics.csv rows "
                "before it (the others are lost)"
            )
    params = run.record.get("params") or {}
    return Summary(
        final_eval=final_eval,
        best_eval=best_eval,
        eval_bpb=bpb,
        bpb_estimated=estimated,
        train_loss=value_at(run, end.final_step, "train_loss"),
        median_tok_s=median_tok_s,
        tok_s_rows=[int(s) for s, _, _ in rows],
        mfu=mfu,
        tokens=int(tokens) if tokens is not None and math.isfinite(tokens) else None,
        params_total=params.get("total"),
        params_active=params.get("active"),
        sources={
            c.split("/", 1)[1]: (
                value_at(run, end.final_step, c),
                value_at(run, end.final_step, "eval_bpb/" + c.split("/", 1)[1]),
            )
            for c in run.columns
            if c.startswith("eval_loss/")
        },
        accuracies={c: value_at(run, end.final_step, c) for c in run.columns if is_accuracy(c)},
        held_out_note=note,
        diverged=end.diverged,
        disagreements=end.disagreements,
        history_gap=gap,
    )


def resume_warnings(runs: list[Run], summaries: dict[str, Summary]) -> tuple[list[str], str]:
    """The report's warnings of what resumes did to runs' records: a held-out set that changed (also
    returned alone: the checklist's evaluation row repeats it; "" if none) and metrics.csv rows lost."""
    warnings, changed_text = [], ""
    changed = [r for r in runs if summaries[r.name].held_out_note]
    if changed:
        changed_text = (
            f"{len(changed)} run(s) evaluated on different held-out sets over time (no best eval across "
            "them): " + "; ".join(f"{r.name}: {summaries[r.name].held_out_note}" for r in changed)
        )
        warnings.append(changed_text)
    gaps = [r for r in runs if summaries[r.name].history_gap]
    if gaps:
        warnings.append(
            f"{len(gaps)} run(s) whose metrics.csv misses part of the run (curves, best eval and throughput "
            "cover only what it holds): "
            + "; ".join(f"{r.name}: {summaries[r.name].history_gap}" for r in gaps)
        )
    return warnings, changed_text
