"""`python -m trmoe.plan [OPTIONS] [OVERRIDE ...]`: parameters, tokens per step, steps, FLOPs, memory per GPU
and ETA of a run, from the same Hydra overrides `python -m trmoe.train` takes. Writes nothing.

    python -m trmoe.plan model=1b hardware=slurm_4node_8gpu --tokens 20e9
    python -m trmoe.plan model=8b hardware=slurm_4node_8gpu hardware.strategy=fsdp trainer.micro_batch=1 \\
        trainer.seq_len=2048 trainer.activation_checkpointing=true --tokens 200B --mfu 0.35 --peak-tflops 989
    python -m trmoe.plan model=100m hardware=cuda --world 8 --tokens 2B --tok-s-per-gpu 150000 --json

Bad input (an unknown key, a bad value, a negative or huge token count, a launcher count below 1) is one
line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import sys

from trmoe.cli import Parser, run
from trmoe.durable import json_text
from trmoe.errors import UserError
from trmoe.plan.walltime import duration as _duration


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m trmoe.plan",
        description="Plan a run from its config: parameters, tokens per step, steps, FLOPs per token, "
        "memory per GPU, ETA. Nothing is written.",
    )
    p.add_argument("overrides", nargs="*", help="Hydra overrides, as for python -m trmoe.train")
    p.add_argument("--tokens", help="target training tokens (20e9, 20B, 500M; at most 1e18); sets the steps")
    p.add_argument(
        "--world", "--gpus", dest="world", help="ranks for torchrun (SLURM presets give their own)"
    )
    p.add_argument("--tok-s", help="throughput of the whole job, tokens/s")
    p.add_argument("--tok-s-per-gpu", help="throughput of one rank, tokens/s (e.g. from trmoe.bench step)")
    p.add_argument("--mfu", help="assumed model FLOPs utilisation in (0, 1]; needs --peak-tflops")
    p.add_argument("--peak-tflops", help="peak TFLOP/s of one GPU (bf16 dense: H100/H200 989, A100 312)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def parse(argv: list[str] | None):
    """(overrides, tokens, world, Throughput, as_json) from the command line; UserError on bad input."""
    from trmoe.plan.build import Throughput, parse_count, parse_positive

    args = build_parser().parse_intermixed_args(argv)  # options before, between or after the overrides
    bad = [o for o in args.overrides if o.startswith("-")]
    if bad:
        raise UserError(f"plan: unknown option {bad[0]}; allowed: see python -m trmoe.plan --help")
    tokens = parse_count("--tokens", args.tokens) if args.tokens is not None else None
    world = parse_count("--world", args.world, "8, 64") if args.world is not None else None
    rates = [n for n in ("tok_s", "tok_s_per_gpu", "mfu") if getattr(args, n) is not None]
    if len(rates) > 1:
        given = ", ".join("--" + n.replace("_", "-") for n in rates)
        raise UserError(f"plan: {given}: give one throughput; allowed: --tok-s, --tok-s-per-gpu or --mfu")
    throughput = Throughput(
        tok_s=parse_positive("--tok-s", args.tok_s) if args.tok_s is not None else None,
        tok_s_per_gpu=(
            parse_positive("--tok-s-per-gpu", args.tok_s_per_gpu) if args.tok_s_per_gpu is not None else None
        ),
        mfu=parse_positive("--mfu", args.mfu, upper=1.0) if args.mfu is not None else None,
        peak_flops=(
            parse_positive("--peak-tflops", args.peak_tflops) * 1e12 if args.peak_tflops is not None else None
        ),
    )
    return args.overrides, tokens, world, throughput, args.json


def _bytes(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def _routing_rows(r: dict) -> list:
    """The routing section: what the routes read, and the route table's balance (layer 0)."""
    note = "analysis only: the target token, training and held-out loss alone" if r["analysis_only"] else ""
    rows: list = [f"routing  ({r['strategy']})", ("routes on", "", note or r["routes_on"])]
    for what, stats in (("token ids", r["ids"]), ("token occurrences", r["occurrences"])):
        if stats is not None:
            value = f"{stats['primary_max_over_mean']:.4f} / {stats['primary_min_over_mean']:.4f}"
            how = f"max/mean / min/mean per expert, route 0 (all K: {stats['all_max_over_mean']:.4f})"
            rows.append((f"balance of {what}", value, how))
    return rows


def render(plan: dict) -> str:
    """The plan as an aligned table: section, then (what, value, how) rows."""
    m, hw, b, run, fl, mem, tm = (
        plan[k] for k in ("model", "hardware", "batch", "run", "flops", "memory", "time")
    )
    p = m["params"]
    rows: list[tuple[str, str, str] | str] = []
    rows.append(f"model {m['name']}  ({m['num_layers']} layers, hidden {m['hidden_size']})")
    rows += [
        ("parameters", f"{p['total']:,}", "trainable; the tied embedding counted once"),
        ("active per token", f"{p['active']:,}", "minus the routed experts a token does not visit"),
        ("embedding", f"{p['embedding']:,}", "tied input embedding = output head"),
        ("non-embedding", f"{p['non_embedding']:,}", ""),
        ("active non-embedding", f"{p['active_non_embedding']:,}", "the 6N of the FLOPs"),
    ]
    preset = f"hardware={hw['preset']}, " if hw["preset"] else ""
    rows.append(f"batch  ({preset}{hw['strategy']}, {hw['compute_dtype']})")
    rows += [
        ("world", f"{b['world']:,}", hw["world_source"]),
        (
            "tokens per step",
            f"{b['tokens_per_step']:,}",
            f"micro_batch {b['micro_batch']} x seq_len {b['seq_len']} x world {b['world']} "
            f"x grad_accum {b['grad_accum']}",
        ),
    ]
    rows.append("run")
    if run["target_tokens"] is not None:
        rows.append(("target tokens", f"{run['target_tokens']:,}", "--tokens"))
    rows += [
        ("steps", f"{run['steps']:,}", run["steps_source"]),
        ("tokens", f"{run['tokens']:,}", "steps x tokens per step"),
        ("launch", "", run["launch"]),
    ]
    if plan.get("mixture"):
        rows.append("data mixture  (each source over the run; a source wraps around when it runs out)")
        for name, src in plan["mixture"].items():
            epochs = "a stream: length unknown" if src["epochs"] is None else f"{src['epochs']:.2f} epochs"
            rows.append(
                (
                    f"  {name}",
                    f"{src['tokens']:,}",
                    f"tokens ({src['share']:.1%} of the samples, {src['samples']:,} samples); {epochs}",
                )
            )
    per = fl["per_token"]
    pf_days = fl["total"] / (1e15 * 86400)
    rows.append("compute  (training, forward + backward; trmoe.model.flops)")
    rows += [
        ("FLOPs per token", f"{per['total']:.3e}", "dense + attention + head"),
        ("  dense", f"{per['dense']:.3e}", "6 x active non-embedding parameters"),
        ("  attention", f"{per['attention']:.3e}", "6 x layers x seq_len x d_attn (causal)"),
        ("  tied head", f"{per['head']:.3e}", "6 x hidden x embedding rows"),
        ("total FLOPs", f"{fl['total']:.3e}", f"FLOPs per token x tokens = {pf_days:,.2f} PFLOP/s-days"),
    ]
    rows.append(f"memory per GPU  ({mem['strategy']}, world {mem['world']}; {hw['precision_note']})")
    rows += [(it["what"], _bytes(it["bytes"]), it["note"]) for it in mem["items"]]
    rows.append(
        (
            "total",
            _bytes(mem["total_bytes"]),
            "the terms summed; plus the CUDA context and NCCL, ~1-3 GiB",
        )
    )
    rows += _routing_rows(plan["routing"])
    rows.append("time")
    if tm["tok_s"] is None:
        rows.append(("throughput", "not given", tm["how_to_measure"]))
    else:
        rows += [
            ("throughput", f"{tm['tok_s']:,.0f} tok/s", tm["source"]),
            (
                "per GPU",
                f"{tm['tok_s_per_gpu']:,.0f} tok/s",
                f"{tm['model_flops_per_gpu'] / 1e12:,.1f} TFLOP/s",
            ),
        ]
        if tm["mfu"] is not None:
            rows.append(("MFU", f"{tm['mfu']:.1%}", "model FLOP/s per GPU / --peak-tflops"))
        rows += [
            ("step time", _duration(tm["step_s"]), "tokens per step / throughput"),
            (
                "ETA",
                _duration(tm["eta_s"]),
                f"{tm['eta_s'] / 3600:,.1f} h of training (evaluations excluded)",
            ),
        ]
    if plan.get("ladder"):
        from trmoe.plan.ladder import render_ladder

        rows += render_ladder(plan["ladder"], _duration)
    cells = [r for r in rows if isinstance(r, tuple)]
    w0 = max(len(r[0]) for r in cells) + 2
    w1 = max(len(r[1]) for r in cells)
    lines = []
    for r in rows:
        if isinstance(r, str):
            lines.append(r)
        else:
            lines.append(f"  {r[0]:<{w0}}{r[1]:>{w1}}  {r[2]}".rstrip())
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    return run(_main, argv)


def _main(argv: list[str]) -> int:
    overrides, tokens, world, throughput, as_json = parse(argv)
    from trmoe.plan.build import make_plan

    plan = make_plan(overrides, tokens=tokens, world=world, throughput=throughput)
    print(json_text(plan, indent=2) if as_json else render(plan), end="\n" if as_json else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
