"""`python -m trmoe.convert reference <checkpoint.pt> --out runs/<name>`: a checkpoint of the old runner (the
reference's `cf-o200k-pretrain`, layout in docs/coming-from-the-old-runner.md) as a trmoe run directory.

What it writes into --out (which must not exist yet):
  - checkpoints/step_<s>/: a trmoe checkpoint of the converted weights (an empty optimizer: the old runner's
    AdamW moments are not carried), read by `trmoe.run.checkpoint.load_checkpoint` like any other. It holds
    no train state (the old file has no RNG state or data cursor), so `trainer.resume=` does not continue it:
    a new run starts from its weights with `trainer.init_from=<out>` (docs/reliability.md);
  - run_config.json: the trmoe config composed from the checkpoint's recorded settings, its model spec and
    parameter counts, and `converted_from` (file, step, the reference's strategy name, p);
  - overrides.txt: the command-line overrides that compose that config (`python -m trmoe.train $(cat ...)`),
    with the run's own p target and ramp share (so that compat=old_runner after them does not reset them).

The weights are re-laid (q, k, v stacked into the fused qkv; gate and up concatenated; the shared expert's
Linear weights transposed) and the route tables carried as they are: they are authoritative (none of trmoe's
constructions rebuilds the reference's tables bit for bit), and `routing.strategy` only names the closest
construction, which builds the placeholder the saved table replaces. p is the value the checkpoint last
trained with (the runner's schedule, not `config.top_k_primary_weight`, its start value).

A setting trmoe cannot express (learned hash pair gates, a non-zero hash channel modulation, lsh_hidden, an
FFN or attention type trmoe does not have, other fixed facts) is refused with one line naming it (exit 2), and
so is a malformed file, before anything is written: a missing top-level key (`args` too: p is computed from
it), a `step` that is not an integer >= 0, a model size in `config` that is not a positive integer (or heads
that do not divide the hidden size), any value the conversion reads of the wrong type (checks.py), a profile
name overrides.txt cannot hold, and any tensor missing, of the wrong shape or dtype, or left over (a config
that disagrees with the tensors: more or fewer layers than `num_hidden_layers`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from trmoe import cli
from trmoe.cli import Parser
from trmoe.convert.checks import check_record, check_state
from trmoe.durable import json_text, staged_dir, write_file
from trmoe.errors import UserError, require_writable

# The reference's strategy name -> the trmoe construction closest to it (only the placeholder's; see above).
STRATEGY_NAMES = {
    "modulo_cyclic": "modulo_cyclic",
    "modulo": "modulo_cyclic",
    "round_robin": "modulo_cyclic",
    "modulo_balanced_secondary": "balanced_secondary",
    "zipf": "balanced_secondary",  # without a table; with one its LPT primary has no trmoe construction
    "modulo_frequency_balanced_secondary": "balanced_secondary",  # the counts are not in the file (1.6)
    "token_id_balanced_hash": "balanced_hash_all_tuples",
    "token_id_pair_coverage_hash": "balanced_hash_all_tuples",
    "random": "random_shared",
}
FFN_TYPES = (None, "token_routed", "sort_split", "sort_split_moe", "deterministic_moe", "complexity")


def _refuse(source: Path, setting: str, value: Any, why: str) -> UserError:
    return UserError(f"convert: {source}: {setting}={value!r} cannot be expressed in trmoe ({why})")


def p_schedule(args: dict[str, Any]) -> tuple[float, float, float]:
    """The runner's p schedule flags: (start, final, ramp ratio), start and final clamped to [0, 1] and the
    ratio to <= 1 as the runner clamps them (a ramp never outlasts the run)."""
    a = min(max(float(args.get("top_k_primary_weight", 0.5)), 0.0), 1.0)
    final = args.get("top_k_primary_weight_final")
    b = a if final is None else min(max(float(final), 0.0), 1.0)
    return a, b, min(float(args.get("top_k_primary_weight_schedule_ratio", 0.0) or 0.0), 1.0)


def primary_weight(args: dict[str, Any], step: int, top_k: int) -> float:
    """p of the runner's schedule at `step` (the last step the checkpoint trained): a cosine ramp from
    top_k_primary_weight to top_k_primary_weight_final over max(1, floor(max(1, steps) * ratio)) steps."""
    if top_k == 1:
        return 1.0
    a, b, ratio = p_schedule(args)
    ramp = max(1, math.floor(max(1, int(args.get("steps", 1) or 1)) * ratio))
    if ratio <= 0 or ramp <= 1:
        return b
    x = min(1.0, (max(step, 1) - 1) / ramp)
    return a + (b - a) * (0.5 - 0.5 * math.cos(math.pi * x))


def _scales(config: dict[str, Any], branch: str, layers: int) -> tuple[float, float | None]:
    """(layer 0's scale, the last layer's or None when constant) of the runner's interpolation rule."""
    base = float(config.get(f"{branch}_output_scale", 1.0) or 1.0)
    first, last = (
        config.get(f"{branch}_output_scale_first_layer"),
        config.get(f"{branch}_output_scale_last_layer"),
    )
    if first is None and last is None:
        return base, None
    first = base if first is None else float(first)
    last = first if last is None else float(last)
    return first, (None if last == first or layers == 1 else last)


def _overrides(source: Path, ckpt: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """The trmoe overrides that build the checkpoint's model, and what the conversion records."""
    config, args, state = ckpt["config"], ckpt["args"], ckpt["model"]
    mlp = config.get("mlp_type")
    if mlp not in FFN_TYPES:
        raise _refuse(source, "mlp_type", mlp, "only the token-routed FFN converts")
    strategy = config.get("routing_strategy")
    if strategy == "lsh_hidden":
        raise _refuse(source, "routing_strategy", strategy, "its routes depend on the hidden state")
    if strategy not in STRATEGY_NAMES:
        raise _refuse(source, "routing_strategy", strategy, f"known: {', '.join(STRATEGY_NAMES)}")
    for key in state:
        if key.endswith("mlp.hash_pair_gate_logits"):
            raise _refuse(
                source, "learn_hash_pair_gates", True, "the route weights would be learned per pair"
            )
        if key.endswith("mlp.hash_channel_scale") and bool(state[key].abs().max() > 0):
            raise _refuse(source, "learn_hash_channel_modulation", True, "its channel scale is not zero")
    facts = {"tie_word_embeddings": True, "use_qk_norm": True}
    for key, want in facts.items():
        if config.get(key, want) != want:
            raise _refuse(source, key, config.get(key), f"trmoe has {key}={want}")
    attention = config.get("attention_type", "gqa")
    if attention not in ("gqa", "mha", "mqa"):
        raise _refuse(source, "attention_type", attention, "allowed: gqa, mha, mqa")
    experts = int(config.get("num_experts", 4))
    hidden, layers, heads = (
        int(config["hidden_size"]),
        int(config["num_hidden_layers"]),
        int(config["num_attention_heads"]),
    )
    shared = (
        int(config.get("shared_intermediate_size") or config["intermediate_size"])
        if config.get("shared_expert", True)
        else 0
    )
    gates = bool(config.get("shared_expert", True) and config.get("use_shared_routed_gates", False))
    check_state(source, ckpt, gates, shared)
    # config.num_key_value_heads lies (1.6): n_kv from k_proj's rows
    kv = state["layers.0.self_attn.k_proj.weight"].shape[0] // (hidden // heads)
    top_k = int(config.get("top_k", 1))
    step = int(ckpt["step"])
    p = primary_weight(args, step, top_k)
    if "token_frequencies" not in config and strategy in ("zipf", "modulo_frequency_balanced_secondary"):
        note = "built with a token-frequency table (not in the file); the route tables carry its effect"
    else:
        note = "route tables carried from the checkpoint"
    shared_scale, shared_last = _scales(config, "shared", layers)
    routed_scale, routed_last = _scales(config, "routed", layers)
    out = [
        "model=tiny",
        f"model.name=reference-{args.get('profile') or 'checkpoint'}",
        f"model.vocab_size={int(config['vocab_size'])}",
        "model.vocab_pad_multiple=1",
        f"model.hidden_size={hidden}",
        f"model.num_layers={layers}",
        f"model.num_heads={heads}",
        f"model.num_kv_heads={kv}",
        f"model.max_seq_len={int(config.get('max_position_embeddings', 2048))}",
        f"model.shared_width={shared}",
        f"model.routed_width={int(config['intermediate_size'])}",
        f"model.num_experts={experts}",
        f"model.gates={str(gates).lower()}",
        f"model.shared_scale={shared_scale}",
        f"model.routed_scale={routed_scale}",
        f"model.shared_scale_last={'null' if shared_last is None else shared_last}",
        f"model.routed_scale_last={'null' if routed_last is None else routed_last}",
        f"model.norm_eps={float(config.get('norm_eps', 1e-6))}",
        f"model.init_std={float(config.get('initializer_range', 0.02))}",
        "model.init="
        + ("legacy_kaiming" if config.get("expert_initialization") == "legacy_kaiming" else "default"),
        f"attention={attention}",
        "attention.qk_norm=true",
        f"attention.rope_theta={float(config.get('rope_theta', 10_000.0))}",
        f"routing={STRATEGY_NAMES[strategy]}",
        f"routing.top_k={top_k}",
        f"routing.primary_weight={p!r}",
    ]
    p_final = None
    if top_k > 1:
        # the run's own p target and ramp share, so that a new run from these weights goes on toward them
        # from p, with or without compat=old_runner (whose 0.85 and 0.5 these overrides replace)
        _, p_final, ratio = p_schedule(args)
        out += [
            f"routing.primary_weight_final={p_final!r}",
            f"routing.primary_weight_ramp={max(ratio, 0.0)!r}",
        ]
    record = {
        "file": str(source),
        "step": step,
        "reference_strategy": strategy,
        "primary_weight": p,
        "primary_weight_final": p_final,
        "note": note,
    }
    return out, record


def _state(source: Path, ckpt: dict[str, Any], spec) -> dict[str, Any]:
    """The reference's state dict re-laid in trmoe's names and layouts (fact sheet 1.3)."""
    import torch

    ref = ckpt["model"]
    out: dict[str, torch.Tensor] = {
        "embed.weight": ref["embed_tokens.weight"],
        "norm.weight": ref["norm.weight"],
    }
    inv_freq = 1.0 / spec.rope_theta ** (
        torch.arange(0, spec.head_dim, 2, dtype=torch.float64) / spec.head_dim
    )
    for layer in range(spec.num_layers):
        r, t = f"layers.{layer}.", f"blocks.{layer}."
        saved = ref.get(r + "self_attn.rotary_emb.inv_freq")
        if saved is not None and not torch.allclose(saved.double(), inv_freq, rtol=1e-6):
            raise _refuse(source, "rotary_emb.inv_freq", "other values", "trmoe's RoPE is theta^(-2i/d)")
        a = r + "self_attn."
        out[t + "attn_norm.weight"] = ref[r + "input_layernorm.weight"]
        out[t + "attn.qkv.weight"] = torch.cat(
            [ref[a + "q_proj.weight"], ref[a + "k_proj.weight"], ref[a + "v_proj.weight"]]
        )
        out[t + "attn.out.weight"] = ref[a + "o_proj.weight"]
        out[t + "attn.q_norm.weight"] = ref[a + "q_norm.weight"]
        out[t + "attn.k_norm.weight"] = ref[a + "k_norm.weight"]
        out[t + "ffn_norm.weight"] = ref[r + "post_attention_layernorm.weight"]
        m = r + "mlp."
        if spec.shared_width:
            out[t + "ffn.shared.w_in"] = torch.cat(
                [ref[m + "shared_gate.weight"].T, ref[m + "shared_up.weight"].T], dim=1
            )
            out[t + "ffn.shared.w_out"] = ref[m + "shared_down.weight"].T
        if spec.gates:
            out[t + "ffn.shared_gate"] = ref[m + "shared_output_gate"]
            out[t + "ffn.routed_gate"] = ref[m + "routed_output_gate"]
        out[t + "ffn.routed.w_in"] = torch.cat([ref[m + "gate_proj_w"], ref[m + "up_proj_w"]], dim=2)
        out[t + "ffn.routed.w_out"] = ref[m + "down_proj_w"]
        table = ref[m + "topk_token_to_expert"]  # its shape is checked (_check_state)
        if int(table.min()) < 0 or int(table.max()) >= spec.num_experts:
            raise UserError(
                f"convert: {source}: {m}topk_token_to_expert has expert ids outside 0..{spec.num_experts - 1}"
            )
        ordered = table.sort(dim=0).values
        if bool((ordered[1:] == ordered[:-1]).any()):
            raise UserError(f"convert: {source}: {m}topk_token_to_expert routes a token twice to one expert")
        primary = ref.get(m + "token_to_expert")
        if primary is not None and not torch.equal(primary, table[0]):
            raise UserError(
                f"convert: {source}: {m}token_to_expert differs from row 0 of topk_token_to_expert"
            )
        out[t + "ffn.routed.route_table"] = table.to(torch.uint8 if spec.num_experts <= 256 else torch.int16)
    return {k: v.contiguous() for k, v in out.items()}


def convert_reference(checkpoint: str | Path, out: str | Path) -> Path:
    """Convert the old runner's checkpoint into the run directory `out`; returns it."""
    import torch
    from omegaconf import OmegaConf

    from trmoe.config.resolve import compose_packaged, to_config
    from trmoe.config.spec import model_spec
    from trmoe.model.transformer import TRMoETransformer, count_parameters
    from trmoe.run.checkpoint import CheckpointStore

    source, out = Path(checkpoint), Path(out)
    if out.exists():
        raise UserError(f"convert: --out {out}: already exists; choose a new run directory")
    require_writable(out, f"convert: --out {out}", "choose a new run directory where one can be written")
    if not source.is_file():
        raise UserError(f"convert: {source}: no such file (a checkpoint.pt of the old runner)")
    try:
        ckpt = torch.load(source, map_location="cpu", weights_only=True)
    except Exception as exc:  # a pickle, a truncated file, not torch's format
        raise UserError(
            f"convert: {source}: not a loadable torch checkpoint ({type(exc).__name__})"
        ) from None
    check_record(source, ckpt)
    overrides, record = _overrides(source, ckpt)
    raw = compose_packaged(overrides)
    cfg = to_config(raw)
    spec = model_spec(cfg)
    state = _state(source, ckpt, spec)
    torch.manual_seed(0)
    model = TRMoETransformer(spec)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise UserError(
            f"convert: {source}: tensors that do not map: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    container = OmegaConf.to_container(raw, resolve=True)
    # built aside and renamed into place: a failure leaves nothing at --out
    with staged_dir(out) as tmp:
        optimizer = torch.optim.AdamW(model.parameters())  # empty: the runner's moments are not carried
        meta = {"tokens": None, "config": container, "converted_from": record}
        CheckpointStore(tmp / "checkpoints").save(
            record["step"],
            model=model,
            optimizer=optimizer,
            local_state={"converted_from": record},
            meta=meta,
        )
        run_config = {
            "run_name": out.name,
            "config": container,
            "model_spec": spec.to_dict(),
            "params": count_parameters(model).to_dict(),
            "converted_from": record,
        }
        write_file(tmp / "run_config.json", json_text(run_config, indent=2) + "\n")
        write_file(tmp / "overrides.txt", " ".join(overrides) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, argv)


def _main(argv: list[str]) -> int:
    parser = Parser(prog="python -m trmoe.convert", description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=["reference"], help="what the checkpoint comes from")
    parser.add_argument("checkpoint", help="the old runner's step_*/checkpoint.pt")
    parser.add_argument("--out", required=True, help="the new run directory (runs/<name>)")
    args = parser.parse_args(argv)
    out = convert_reference(args.checkpoint, args.out)
    print(f"converted {args.checkpoint} -> {out}")
    return 0
