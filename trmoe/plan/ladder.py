"""The planner's ladder view (`python -m trmoe.plan experiment=ladder`): every rung's shape, parameter
counts, budgets, tokens, FLOPs and time before anything runs (docs/scaling.md).

Per rung (its reference model, trmoe.config.ladder): total, active and non-embedding active parameters
(N = active - embedding); per budget b its tokens D_b, steps B_b and branch point p_b; the FLOPs of a budget
C_b = F · D_b with F the training FLOPs per token (trmoe.model.flops: 6 × active non-embedding + attention
+ the tied head); κ = F / N = C_b / (N · D_b), 6 where the non-embedding matrix multiplies are all the compute
(a large tied head or long sequences raise it: the fits' N then misses most of C); and what one job trains:
the stable run (p_max steps) plus every decay (B_b - p_b), so

    job tokens = T · (p_max + Σ_b (B_b - p_b))        grid = Σ_rungs job × arms × seeds

Time: with --mfu and --peak-tflops, FLOPs / (mfu × peak × world); with --tok-s, tokens / tok_s (the same
rate at every rung: an upper bound for the small ones); otherwise not estimated.
"""

from __future__ import annotations

from typing import Any

from trmoe.config.ladder import plan as ladder_plan
from trmoe.config.ladder import reference
from trmoe.config.schema import Config


def _count(params: dict, key: str) -> int:
    value = params.get(key)
    return len(str(value).split(",")) if value is not None else 1


def ladder_view(cfg: Config, sweep_params: dict, tokens_per_step: int, world: int, throughput) -> dict:
    """The ladder's figures, JSON-ready (`sweep_params`: the grid's hydra.sweeper.params)."""
    from trmoe.config.spec import model_spec
    from trmoe.model.flops import flops_breakdown
    from trmoe.model.transformer import parameter_counts

    arms, seeds = _count(sweep_params, "arm"), _count(sweep_params, "trainer.seed")
    rungs: list[dict[str, Any]] = []
    for r in range(len(cfg.ladder.hidden)):
        spec = model_spec(reference(cfg, r))
        counts = parameter_counts(spec)
        per_token = flops_breakdown(spec, counts, cfg.trainer.seq_len).total
        lp = ladder_plan(cfg, tokens_per_step, r)
        n = counts.active - counts.embedding
        job_tokens = lp.job_steps * tokens_per_step
        rungs.append(
            {
                "rung": r,
                "label": lp.label,
                "hidden_size": spec.hidden_size,
                "num_layers": spec.num_layers,
                "num_heads": spec.num_heads,
                "params": {**counts.to_dict(), "active_non_embedding": n},
                "flops_per_token": per_token,
                "kappa": per_token / n,  # C / (N D): 6 when the non-embedding GEMMs are all the compute
                "budgets": [
                    {
                        "tokens": b.tokens,
                        "steps": b.steps,
                        "branch_step": b.branch_step,
                        "tokens_per_param": b.tokens / lp.n_reference,
                        "flops": per_token * b.tokens,
                    }
                    for b in lp.budgets
                ],
                "job_tokens": job_tokens,
                "job_flops": per_token * job_tokens,
                "job_seconds": _seconds(throughput, per_token * job_tokens, job_tokens, world),
            }
        )
    jobs = len(rungs) * arms * seeds
    total = sum(r["job_flops"] for r in rungs) * arms * seeds
    seconds = [r["job_seconds"] for r in rungs]
    return {
        "name": cfg.ladder.name,
        "arms": arms,
        "seeds": seeds,
        "jobs": jobs,
        "runs": jobs * (1 + len(cfg.ladder.tokens or cfg.ladder.tokens_per_param)),
        "lr_rule": cfg.ladder.lr_rule.value,
        "rungs": rungs,
        "total_flops": total,
        "total_seconds": None if None in seconds else sum(seconds) * arms * seeds,
    }


def _seconds(throughput, flops: float, tokens: int, world: int) -> float | None:
    if throughput.mfu is not None and throughput.peak_flops is not None:
        return flops / (throughput.mfu * throughput.peak_flops * world)
    if throughput.tok_s is not None:
        return tokens / throughput.tok_s
    if throughput.tok_s_per_gpu is not None:
        return tokens / (throughput.tok_s_per_gpu * world)
    return None


def render_ladder(view: dict, duration) -> list[str]:
    """The ladder's lines for the plan's text form (`duration`: seconds -> words)."""
    plural = "s" if view["seeds"] > 1 else ""
    lines = [
        f"ladder {view['name']}  ({len(view['rungs'])} rungs x {view['arms']} arms x {view['seeds']} "
        f"seed{plural} = "
        f"{view['jobs']} jobs, {view['runs']} runs; lr rule {view['lr_rule']}; per rung its hash-routed "
        "reference model; N = active non-embedding)",
        f"  {'rung':<10}{'layers':>7}{'total':>14}{'active':>14}{'N':>12}{'kappa':>7}  budgets: tokens "
        "(tokens/N, steps, branch step, FLOPs)",
    ]
    for r in view["rungs"]:
        p = r["params"]
        budgets = "; ".join(
            f"{b['tokens']:,} ({b['tokens_per_param']:.3g}, {b['steps']:,}, {b['branch_step']:,}, "
            f"{b['flops']:.2e})"
            for b in r["budgets"]
        )
        lines.append(
            f"  {r['label']:<10}{r['num_layers']:>7}{p['total']:>14,}{p['active']:>14,}"
            f"{p['active_non_embedding']:>12,}{r['kappa']:>7.3g}  {budgets}"
        )
        time = "" if r["job_seconds"] is None else f", {duration(r['job_seconds'])}"
        lines.append(f"  {'':<10}  one job: {r['job_tokens']:,} tokens, {r['job_flops']:.2e} FLOPs{time}")
    total = view["total_seconds"]
    time = (
        "time not estimated: give --mfu with --peak-tflops, or --tok-s"
        if total is None
        else f"{duration(total)} of training"
    )
    lines.append(f"  grid: {view['total_flops']:.3e} FLOPs; {time}")
    return lines
