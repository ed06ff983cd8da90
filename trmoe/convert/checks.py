"""What a well-formed checkpoint of the old runner holds (fact sheet 1.2-1.3), checked before anything is
converted or written: each flaw is one line naming the key (a UserError, exit 2).

- top level: `step` (an integer >= 0), `model`, `config`, `args` (dicts; p is computed from `args`);
- `config`: hidden_size, num_hidden_layers, num_attention_heads, intermediate_size, vocab_size, num_experts,
  top_k positive integers, the heads dividing the hidden size; with top_k > 1, the p schedule's four `args`;
- `model`: exactly the tensors the config describes (per layer: norms, q/k/v/o, q/k norms, the expert
  tensors, the route table; the shared expert's and the gates' when the config has them), each of its shape
  and kind (floating point; an integer route table), n_kv read from layer 0's k_proj and dividing the heads;
  besides them only the buffers the conversion drops.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trmoe.errors import UserError

_P_ARGS = (
    "steps",
    "top_k_primary_weight",
    "top_k_primary_weight_final",
    "top_k_primary_weight_schedule_ratio",
)
# tensors the conversion drops (the trmoe model rebuilds or does not need them)
_DROPPED = ("rotary_emb.inv_freq", "token_to_expert", "pair_hash_route_codes", "pair_hash_expert_pairs")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_record(source: Path, ckpt: Any) -> None:
    """The top-level keys, `step`, the model sizes in `config` and the p schedule's `args`."""
    if not isinstance(ckpt, dict):
        raise UserError(
            f"convert: {source}: not an old-runner checkpoint (a dict with step, model, config, args)"
        )
    kinds = {int: "an integer", dict: "a dict"}
    for key, kind in (("step", int), ("model", dict), ("config", dict), ("args", dict)):
        if key not in ckpt:
            why = "; p is computed from its schedule flags" if key == "args" else ""
            raise UserError(f"convert: {source}: no '{key}' key (an old-runner checkpoint holds it{why})")
        if not isinstance(ckpt[key], kind) or (kind is int and not _is_int(ckpt[key])):
            raise UserError(f"convert: {source}: {key}={ckpt[key]!r} (allowed: {kinds[kind]})")
    if ckpt["step"] < 0:
        raise UserError(
            f"convert: {source}: step={ckpt['step']} (allowed: an integer >= 0, the steps completed)"
        )
    config = ckpt["config"]
    sizes = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    for key in (*sizes, "num_experts", "top_k"):
        value = config.get(key, {"num_experts": 4, "top_k": 1}.get(key))
        if not _is_int(value) or value <= 0:
            raise UserError(f"convert: {source}: config.{key}={value!r} (allowed: an integer > 0)")
    if config["hidden_size"] % config["num_attention_heads"]:
        raise UserError(
            f"convert: {source}: config.hidden_size={config['hidden_size']} is not a multiple of "
            f"config.num_attention_heads={config['num_attention_heads']}"
        )
    if config["intermediate_size"] % config.get("num_experts", 4):
        raise UserError(
            f"convert: {source}: config.intermediate_size={config['intermediate_size']} (the total routed "
            f"width) is not a multiple of config.num_experts={config.get('num_experts', 4)}"
        )
    if config.get("top_k", 1) > 1:
        for key in _P_ARGS:
            if key not in ckpt["args"]:
                raise UserError(f"convert: {source}: args has no {key!r} (p is computed from it)")
            value = ckpt["args"][key]
            if not (value is None and key == "top_k_primary_weight_final") and (
                isinstance(value, bool) or not isinstance(value, (int, float))
            ):
                raise UserError(f"convert: {source}: args.{key}={value!r} (a number: p is computed from it)")


def _expected_shapes(config: dict[str, Any], state: dict[str, Any], gates: bool, shared: int) -> dict:
    """Every tensor the model `config` describes -> its shape (fact sheet 1.3); n_kv from k_proj's rows."""
    h, layers, heads, vocab = (
        config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    )
    experts, d = config.get("num_experts", 4), config["hidden_size"] // config["num_attention_heads"]
    width = config["intermediate_size"] // experts
    k = state.get("layers.0.self_attn.k_proj.weight")
    kv_rows = k.shape[0] if hasattr(k, "shape") and len(k.shape) == 2 and k.shape[0] % d == 0 else d
    out = {"embed_tokens.weight": (vocab, h), "norm.weight": (h,)}
    for layer in range(layers):
        r, m = f"layers.{layer}.", f"layers.{layer}.mlp."
        out |= {r + n: (h,) for n in ("input_layernorm.weight", "post_attention_layernorm.weight")}
        out |= {r + "self_attn.q_proj.weight": (heads * d, h), r + "self_attn.o_proj.weight": (h, heads * d)}
        out |= {r + f"self_attn.{n}_proj.weight": (kv_rows, h) for n in "kv"}
        out |= {r + f"self_attn.{n}_norm.weight": (d,) for n in "qk"}
        out |= {m + "gate_proj_w": (experts, h, width), m + "up_proj_w": (experts, h, width)}
        out |= {
            m + "down_proj_w": (experts, width, h),
            m + "topk_token_to_expert": (config.get("top_k", 1), vocab),
        }
        if shared:
            out |= {m + "shared_gate.weight": (shared, h), m + "shared_up.weight": (shared, h)}
            out[m + "shared_down.weight"] = (h, shared)
        if gates:
            out |= {m + "shared_output_gate": (), m + "routed_output_gate": ()}
    return out


def check_state(source: Path, ckpt: dict[str, Any], gates: bool, shared: int) -> None:
    """Every tensor the config implies is there with its shape and kind; nothing else is (but the dropped)."""
    import torch

    config, state = ckpt["config"], ckpt["model"]
    want = _expected_shapes(config, state, gates, shared)
    layers = config["num_hidden_layers"]
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise UserError(f"convert: {source}: model[{key!r}] is a {type(value).__name__}, not a tensor")
        if key in want or key.endswith(_DROPPED) or key.endswith("mlp.hash_channel_scale"):
            continue
        index = key.split(".")[1] if key.startswith("layers.") else ""
        if index.isdigit() and int(index) >= layers:
            raise UserError(
                f"convert: {source}: model holds {key} but config.num_hidden_layers={layers} "
                f"(layers 0..{layers - 1})"
            )
        raise UserError(
            f"convert: {source}: model[{key!r}] is not a tensor of the model its config describes"
        )
    for key, shape in want.items():
        if key not in state:
            raise UserError(
                f"convert: {source}: model has no {key!r} (its config implies it: {layers} layers)"
            )
        tensor = state[key]
        if tuple(tensor.shape) != shape:
            raise UserError(
                f"convert: {source}: model[{key!r}] has shape {tuple(tensor.shape)}; "
                f"its config implies {shape}"
            )
        if tensor.is_floating_point() == key.endswith("token_to_expert"):
            kind = "an integer" if key.endswith("token_to_expert") else "a floating-point"
            raise UserError(f"convert: {source}: model[{key!r}] is {tensor.dtype}, not {kind} tensor")
    kv = want["layers.0.self_attn.k_proj.weight"][0] // (
        config["hidden_size"] // config["num_attention_heads"]
    )
    if config["num_attention_heads"] % kv:
        raise UserError(
            f"convert: {source}: model['layers.0.self_attn.k_proj.weight'] gives {kv} key/value heads, "
            f"which do not divide config.num_attention_heads={config['num_attention_heads']}"
        )
