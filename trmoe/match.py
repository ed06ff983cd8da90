"""`python -m trmoe.match [OVERRIDE ...] [--arm "OVERRIDES"] ...`: solved widths and parameter counts of every
arm of a grid, before anything is launched.

The arms are every combination of the grid's `hydra.sweeper.params` (from `experiment=<name>`) and of the
comma-separated sweep overrides on the command line (`attention=gqa,mha`), each extended by every `--arm`
(a quoted list of overrides, split as a shell splits a command line: `--arm "data.text_path='my corpus.txt'"`)
when some are given. Each arm is composed and resolved exactly as `python -m trmoe.train` would do it, so
`model.match_params` is solved per arm (on the total, or with model.match_count=active on the active
parameters: the "solved" column says "(active)" and the residual is then of the active count):

    python -m trmoe.match experiment=attention_matched
    python -m trmoe.match model=100m model.gates=false model.match_params=99487680 \
        --arm "model.num_experts=1 routing.top_k=1 model.routed_width=0" --arm "model.routed_width=256"

Exit code 2 when an arm does not resolve (its row shows the error).
"""

from __future__ import annotations

import itertools
import shlex
import sys

from trmoe.cli import Parser, run
from trmoe.durable import json_text
from trmoe.errors import UserError


def expand_arms(overrides: list[str], arms: list[str]) -> list[list[str]]:
    """The override list of every arm, in launch order (the basic sweeper's cartesian product), each
    extended by every --arm (split as a shell splits it, so that a quoted value keeps its spaces)."""
    from trmoe.config.sweep import sweep_jobs

    try:
        extra = [shlex.split(arm) for arm in arms]
    except ValueError as e:  # an unclosed quote
        raise UserError(f"match: --arm: {e}; allowed: overrides quoted as in a shell") from None
    try:
        jobs, _ = sweep_jobs(overrides)
    except UserError as e:
        raise UserError(f"match: {e}") from None
    if not arms:
        return jobs
    return [[*job, *arm] for job in jobs for arm in extra]


def _ffn_text(spec) -> str:
    if spec.num_experts == 1 or not spec.routed_width:
        return f"dense {spec.shared_width + spec.routed_width}"
    from trmoe.model.routing import REGISTRY

    routes = f"top-{spec.top_k}"
    if not all(REGISTRY[s].learned for s in spec.strategies):  # a table somewhere: its fixed weights
        routes += f" p={spec.primary_weight:g}" if spec.top_k > 1 else ""
    if spec.layer_strategies:  # routing.layers: each run of layers with its strategy, "0-2:balanced_hash"
        spans, layer = [], 0
        for name, run in itertools.groupby(spec.strategies):
            n = len(list(run))
            what = f"dense {spec.dense_width}" if REGISTRY[name].dense else name  # a dense layer's width
            spans.append(f"{layer}-{layer + n - 1}:{what}" if n > 1 else f"{layer}:{what}")
            layer += n
        routes += ", " + " ".join(spans)
    elif REGISTRY[spec.strategy].learned:  # one router strategy in every layer: its name
        routes = f"{spec.strategy} {routes}"
    trained = sum(REGISTRY[s].router == "trained" for s in spec.strategies)
    if trained:  # a trained router's E x H per layer is in total and active (a frozen one is not counted)
        routes += f", router {spec.num_experts}x{spec.hidden_size}" + (
            f" in {trained} layers" if trained < spec.num_layers else ""
        )
    return f"{spec.shared_width} + {spec.num_experts}x{spec.expert_width}, {routes}"


def solve_arm(overrides: list[str]) -> dict:
    from trmoe.config.param_match import solve_match
    from trmoe.config.resolve import compose_packaged, to_config
    from trmoe.config.spec import model_spec

    row: dict = {"overrides": overrides}
    try:
        cfg = to_config(compose_packaged([o for o in overrides if not o.startswith("hydra.")]))
    except UserError as e:  # composition errors worded as the train app words them
        return {**row, "error": str(e)}
    from trmoe.model.transformer import parameter_counts  # torch: once the arm's config is valid

    spec = model_spec(cfg)
    counts = parameter_counts(spec)
    match = solve_match(cfg)
    row.update(
        attention=f"{cfg.attention.kind.value} {spec.num_heads}/{spec.num_kv_heads}",
        ffn=_ffn_text(spec),
        shared_width=spec.shared_width,
        routed_width=spec.routed_width,
        total=counts.total,
        active=counts.active,
        match=None if match is None else match.to_dict(),
    )
    return row


def _label(rows: list[dict]) -> list[str]:
    """Each arm by the overrides that differ between arms; the shared ones are printed once above."""
    sets = [dict(o.split("=", 1) if "=" in o else (o, "") for o in r["overrides"]) for r in rows]
    keys = list(dict.fromkeys(k for s in sets for k in s))
    varying = [k for k in keys if len({s.get(k) for s in sets}) > 1] or keys
    return [" ".join(f"{k}={s[k]}" for k in varying if k in s) or "(defaults)" for s in sets]


def render(rows: list[dict]) -> str:
    labels = _label(rows)
    common = (
        [o for o in rows[0]["overrides"] if all(o in r["overrides"] for r in rows)] if len(rows) > 1 else []
    )
    header = ["arm", "attention", "FFN", "solved", "residual", "total", "active"]
    table = []
    for label, row in zip(labels, rows, strict=True):
        if "error" in row:
            table.append([label, "error: " + row["error"], "", "", "", "", ""])
            continue
        m = row["match"]
        solved = "-" if m is None else f"{m['field']}={m['width']}"
        if m is not None and m["count"] == "active":  # model.match_count=active: the residual is of active
            solved += " (active)"
        residual = "-" if m is None else ("0 (exact)" if m["residual"] == 0 else f"{m['residual']:+,}")
        table.append(
            [label, row["attention"], row["ffn"], solved, residual, f"{row['total']:,}", f"{row['active']:,}"]
        )
    widths = [max(len(str(r[i])) for r in [header, *table]) for i in range(len(header))]
    lines = []
    if len(rows) > 1 and common and len(common) < len(rows[0]["overrides"]):
        lines.append("common overrides: " + " ".join(common))
    for r in [header, *table]:
        lines.append(
            "  ".join(
                str(c).ljust(w) if i < 4 else str(c).rjust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            ).rstrip()
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    return run(_main, argv)


def _main(argv: list[str]) -> int:
    parser = Parser(
        prog="python -m trmoe.match",
        description="Solved widths and total/active parameters of every arm, before launching.",
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every arm; a,b sweeps them")
    parser.add_argument("--arm", "-a", action="append", default=[], help='one arm: "key=value key=value"')
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    arms = expand_arms(args.overrides, args.arm)
    rows = [solve_arm(a) for a in arms]
    print(json_text(rows, indent=2) if args.json else render(rows), end="" if not args.json else "\n")
    return 2 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
