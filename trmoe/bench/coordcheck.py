"""`coordcheck`: muP's coordinate check (Yang et al. 2022, microsoft/mup's coord_check) for the TR-MoE model.

For each parametrization and each hidden size H of --widths (the shared and routed widths 2H and H, E=4,
heads fixed, so the head dim grows with H), a fresh model trains --steps AdamW steps at one fixed lr on
random token ids; every step's forward records the RMS sqrt(mean(x^2)) of

    embedding       the embedding output (block 0's input)
    attn_logits.<l> layer l's pre-softmax attention logits (q·k times its scale; the causal entries)
    attn.<l>        layer l's attention output
    shared.<l>      layer l's shared-expert output (gate x scale included)
    routed.<l>      layer l's routed-expert output (gate x scale included)
    logits          the full logits over the vocabulary

averaged over --seeds. The slope of log RMS against log H, fitted (numpy.polyfit) at the last recorded step
(after steps - 1 updates), is printed per activation: Theta(1) coordinates, what muP promises, give slope 0;
SP's grow (slope ~1/2 from a fixed-std init, ~1 from Adam's updates). The check passes when every slope is in
its band (BAND; the attention logits' one-sided band BANDS, see there) and prints the ones that are not. The
mup runs take the smallest width as their base shape (mup_base_width; the shared and routed bases follow
it). --drop removes one of mup's multipliers by hand (each makes the check fail): output (the 1/m_d
readout), attention (sqrt(d_0)/d back to 1/sqrt(d) at every width), init (the 1/sqrt(m) init stds) or lr
(the 1/m lr factors).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from trmoe.bench.common import Parser, figure, positive_int, record, save_figure, sorted_list

PARAMETRIZATIONS = ("sp", "mup")
DROPS = ("output", "attention", "init", "lr")
GROUPS = ("embedding", "attn_logits", "attn", "shared", "routed", "logits")  # the plot's panels
WIDTHS = (64, 128, 256, 512)
# The check's criterion: the band of log-log slopes each coordinate may have under mup. Theta(1) activations:
# slope 0 up to finite-width noise (measured |slope| <= 0.15), and 0.25 is half the smallest growth SP
# predicts (1/2 from a fixed-std init, ~1 from Adam's updates). The attention logits are one-sided: under mup
# (q·k times sqrt(d_0)/d) their init part decays as d^-1/2 (q and k independent: q·k ~ sqrt(d)) and their
# learned part (q and k aligned: q·k ~ d) is Theta(1), so the slope rises from -1/2 towards 0 as training
# goes on and never above; under 1/sqrt(d) at every width the init part is Theta(1) (~1 in RMS with QK-norm)
# and the learned part grows as d^1/2: from 0 upwards (measured +0.16 after 3 updates, intact -0.31).
BAND = (-0.25, 0.25)
BANDS = {"attn_logits": (-0.75, 0.05)}


@dataclass
class CoordCheck:
    parametrization: str
    widths: list[int]
    rms: dict[str, list[list[float]]]  # activation -> [step][width index], mean over seeds
    slopes: dict[str, float]  # activation -> log-log slope at the last step
    drop: str | None = None

    def max_abs_slope(self) -> tuple[str, float]:
        name = max(self.slopes, key=lambda k: abs(self.slopes[k]))
        return name, self.slopes[name]

    def failures(self) -> dict[str, float]:
        """The coordinates whose slope is outside their band (`band`): empty when mup holds."""
        return {k: v for k, v in self.slopes.items() if not band(k)[0] <= v <= band(k)[1]}


def band(name: str) -> tuple[float, float]:
    """The slopes coordinate `name` may have under mup (BANDS by its group, else BAND)."""
    return BANDS.get(name.split(".")[0], BAND)


def overrides(parametrization: str, width: int, base: int, layers: int, lr: float) -> list[str]:
    """The config of one width: 4 heads, shared 2H, routed H over E=4, vocabulary 256, random ids."""
    extra = [f"model.mup_base_width={base}"] if parametrization == "mup" else []
    return [
        "model=tiny",
        "data=random",
        "model.vocab_size=256",
        f"model.hidden_size={width}",
        f"model.num_layers={layers}",
        "model.num_heads=4",
        "model.num_kv_heads=4",
        f"model.shared_width={2 * width}",
        f"model.routed_width={width}",
        "model.num_experts=4",
        f"model.parametrization={parametrization}",
        *extra,
        f"optimizer.lr={lr}",
        "hardware=cpu",
        "hardware.threads=1",
    ]


def _model_and_optimizer(overrides_: list[str], drop: str | None, seed: int):
    from trmoe.bench.step import compose_arm
    from trmoe.model.transformer import TRMoETransformer
    from trmoe.optim.build import build_optimizer

    cfg, spec = compose_arm(overrides_)
    torch.manual_seed(seed)
    model = TRMoETransformer(spec)
    sp = replace(spec, parametrization="sp")
    if drop == "init":
        model.spec = sp  # reset_parameters reads the spec: the sp stds, mup's forward multipliers kept
        torch.manual_seed(seed)
        model.reset_parameters()
        model.spec = spec
    if drop == "output":
        model.output_mult = 1.0
    if drop == "attention":
        for block in model.blocks:
            block.attn.scale = None
    if drop == "lr":
        model.spec = sp  # the optimizer reads the lr factors from the spec
    optimizer = build_optimizer(model, cfg.optimizer, torch.device("cpu"))
    model.spec = spec
    return model, optimizer, cfg


def _rms(x: torch.Tensor) -> float:
    return x.detach().float().pow(2).mean().sqrt().item()


def attention_logits(attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The pre-softmax logits [B, heads, S, S] of one attention layer on its input x (what SDPA computes
    inside: q·k times the layer's scale, 1/sqrt(d) when it has none), -inf above the diagonal (causal)."""
    from trmoe.model.attention import apply_rope

    b, s, _ = x.shape
    d, hq, hkv = attn.head_dim, attn.num_heads, attn.num_kv_heads
    q, k, _v = attn.qkv(x).split([hq * d, hkv * d, hkv * d], dim=-1)
    q = q.view(b, s, hq, d).transpose(1, 2)
    k = k.view(b, s, hkv, d).transpose(1, 2)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k = k.repeat_interleave(hq // hkv, dim=1)
    scale = attn.scale if attn.scale is not None else 1 / math.sqrt(d)
    logits = (q @ k.transpose(-1, -2)) * scale
    return logits.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))


def _hook(model, out: dict[str, float], logits: dict[str, torch.Tensor]) -> list:
    """Forward hooks that write each activation's RMS into `out` as the forward runs (the routed branch adds
    into the shared branch's output in place: its own share is the difference, taken at once), and each
    layer's attention logits (causal entries) into `logits`."""
    handles = [
        model.blocks[0].register_forward_pre_hook(
            lambda _m, args: out.__setitem__("embedding", _rms(args[0]))
        )
    ]
    for layer, block in enumerate(model.blocks):

        def scores(attn, args, l=layer):
            with torch.no_grad():
                full = attention_logits(attn, *args[:3])
            logits[f"attn_logits.{l}"] = full[torch.isfinite(full)]

        handles.append(block.attn.register_forward_pre_hook(scores))
        handles.append(
            block.attn.register_forward_hook(lambda _m, _a, y, l=layer: out.__setitem__(f"attn.{l}", _rms(y)))
        )
        ffn = block.ffn
        if ffn.shared is not None:
            handles.append(
                ffn.shared.register_forward_hook(
                    lambda _m, _a, y, l=layer: out.__setitem__(f"shared.{l}", _rms(y))
                )
            )
        if ffn.routed is not None:
            before: dict[str, torch.Tensor | None] = {}

            def pre(_m, _args, kwargs, before=before):
                into = kwargs.get("into")
                before["into"] = None if into is None else into.detach().clone()

            def post(_m, _args, _kwargs, y, l=layer, before=before):
                own = y if before["into"] is None else y - before["into"]
                out[f"routed.{l}"] = _rms(own)

            handles.append(ffn.routed.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(ffn.routed.register_forward_hook(post, with_kwargs=True))
    return handles


def _trace(
    model, optimizer, steps: int, batch: int, seq: int, vocab: int, seed: int
) -> list[dict[str, float]]:
    """RMS of every activation at each of `steps` forwards (forward t sees t updates)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    rows = []
    for _ in range(steps):
        row: dict[str, float] = {}
        scores: dict[str, torch.Tensor] = {}
        handles = _hook(model, row, scores)
        try:
            logits = model.logits(model(inputs))
        finally:
            for h in handles:
                h.remove()
        row.update({name: _rms(values) for name, values in scores.items()})
        row["logits"] = _rms(logits)
        rows.append(row)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return rows


def slope(widths: list[int], values: list[float]) -> float:
    """The least-squares slope of log(value) against log(width)."""
    return float(np.polyfit(np.log(widths), np.log(values), 1)[0])


def coord_check(
    parametrization: str,
    widths: list[int] | tuple[int, ...] = WIDTHS,
    *,
    steps: int = 4,
    seeds: int = 1,
    layers: int = 2,
    lr: float = 3e-3,
    batch: int = 4,
    seq: int = 32,
    drop: str | None = None,
) -> CoordCheck:
    """Run the check for one parametrization (see the module docstring)."""
    widths = sorted(widths)
    per_width: list[list[dict[str, float]]] = []  # [width][step] -> activation -> mean RMS over seeds
    for width in widths:
        runs = []
        for seed in range(seeds):
            model, optimizer, cfg = _model_and_optimizer(
                overrides(parametrization, width, widths[0], layers, lr), drop, seed
            )
            runs.append(_trace(model, optimizer, steps, batch, seq, cfg.model.vocab_size, seed))
        per_width.append(
            [{k: float(np.mean([r[t][k] for r in runs])) for k in runs[0][t]} for t in range(steps)]
        )
    names = list(per_width[0][0])
    rms = {k: [[per_width[w][t][k] for w in range(len(widths))] for t in range(steps)] for k in names}
    slopes = {k: slope(widths, rms[k][-1]) for k in names}
    return CoordCheck(parametrization, widths, rms, slopes, drop)


def plot(checks: list[CoordCheck], path: Path) -> None:
    """One row per parametrization, one panel per activation group: RMS vs width (log-log), one line per
    step and layer."""
    from matplotlib import colormaps

    fig, axes = figure("coordcheck", len(checks), len(GROUPS), (3.2 * len(GROUPS), 2.8 * len(checks)))
    for row, check in zip(axes, checks, strict=True):
        steps = len(next(iter(check.rms.values())))
        cmap = colormaps["viridis"]
        for ax, group in zip(row, GROUPS, strict=True):
            names = [k for k in check.rms if k.split(".")[0] == group]
            for name in names:
                for t in range(steps):
                    ax.plot(
                        check.widths,
                        check.rms[name][t],
                        "o-",
                        markersize=2,
                        color=cmap(t / max(steps - 1, 1)),
                        alpha=0.9,
                        label=f"t={t}" if name == names[0] else None,
                    )
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            worst = max((check.slopes[k] for k in names), key=abs) if names else math.nan
            label = check.parametrization + (f" (no {check.drop})" if check.drop else "")
            ax.set_title(f"{label}: {group}  slope {worst:+.2f}", fontsize=8)
            ax.set_xlabel("hidden size", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
        row[0].set_ylabel("RMS", fontsize=8)
        row[0].legend(fontsize=6)
    save_figure(fig, path)


widths_arg = sorted_list(int, lambda v: v >= 4 and v % 4 == 0, "multiples of 4, e.g. 64,128,256")


def main(argv: list[str] | None = None) -> None:
    parser = Parser(prog="python -m trmoe.bench coordcheck", description=__doc__)
    parser.add_argument(
        "--widths", type=widths_arg, default=list(WIDTHS), help="hidden sizes (default 64,128,256,512)"
    )
    parser.add_argument("--steps", type=positive_int, default=4, help="forwards recorded (default 4)")
    parser.add_argument("--seeds", type=positive_int, default=1)
    parser.add_argument("--layers", type=positive_int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--parametrization", choices=PARAMETRIZATIONS, nargs="+", default=list(PARAMETRIZATIONS)
    )
    parser.add_argument("--drop", choices=DROPS, help="mup runs: remove this multiplier")
    parser.add_argument("--plot", type=Path, help="write the PNG here")
    args = parser.parse_args(argv)
    if not (args.lr > 0 and math.isfinite(args.lr)):
        parser.error(f"--lr: got {args.lr}; allowed: a positive number")
    torch.set_num_threads(1)
    checks = [
        coord_check(
            p,
            args.widths,
            steps=args.steps,
            seeds=args.seeds,
            layers=args.layers,
            lr=args.lr,
            drop=args.drop if p == "mup" else None,
        )
        for p in args.parametrization
    ]
    names = list(checks[0].slopes)
    print(f"log-log slope of activation RMS vs hidden size {args.widths}, at step {args.steps - 1}:")
    print(
        f"{'activation':<16}"
        + "".join(f"{c.parametrization + (f'-{c.drop}' if c.drop else ''):>14}" for c in checks)
    )
    for name in names:
        print(f"{name:<16}" + "".join(f"{c.slopes[name]:>+14.3f}" for c in checks))
    for c in checks:
        label = c.parametrization + (f" without its {c.drop} multiplier" if c.drop else "")
        bad = c.failures()
        verdict = (
            "passes"
            if not bad
            else "fails: "
            + ", ".join(
                f"{k} {v:+.3f} outside [{band(k)[0]:+.2f}, {band(k)[1]:+.2f}]" for k, v in bad.items()
            )
        )
        print(f"{label}: the mup check {verdict}")
    if args.plot:
        plot(checks, args.plot)
        print(f"plot: {args.plot}")
    record(
        "coordcheck",
        {
            "widths": args.widths,
            "steps": args.steps,
            "seeds": args.seeds,
            "layers": args.layers,
            "lr": args.lr,
            "checks": [
                {
                    "parametrization": c.parametrization,
                    "drop": c.drop,
                    "slopes": c.slopes,
                    "failures": c.failures(),
                    "rms": c.rms,
                }
                for c in checks
            ],
        },
    )
