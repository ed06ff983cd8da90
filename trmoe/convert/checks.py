"""What a well-formed checkpoint of the old runner holds (fact sheet 1.2-1.3), checked before anything is
converted or written: each flaw is one line naming the key (a UserError, exit 2).

- top level: `step` (an integer >= 0), `model`, `config`, `args` (dicts; p is computed from `args`);
- `config`: hidden_size, num_hidden_layers, num_attention_heads, intermediate_size, vocab_size, num_experts,
  top_k positive integers, the heads dividing the hidden size; every other key the conversion reads of its
  type (_CONFIG_TYPES: an integer, a finite number, a bool, a string);
- `args`: with top_k > 1, the p schedule's four keys, numbers (`steps` an integer >= 0); `profile`, which
  names the model in overrides.txt, a word (a blank in it would split the override in two);
- `model`: string keys and dense tensors only, exactly the tensors the config describes (per layer: norms,
  q/k/v/o, q/k norms, the expert tensors, the route table; the shared expert's and the gates' when the
  config has them), each of its shape and kind (floating point; an integer route table), n_kv read from
  layer 0's k_proj and dividing the heads; besides them only the buffers the conversion drops (each of its
  kind and shape too: inv_freq floating point [head_dim / 2], token_to_expert integer [vocab]).
"""

from __future__ import annotations

import math
import re
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


# the `config` keys the conversion reads besides the sizes -> what each must be when present (absent: the
# runner's default); None is allowed where the runner's own code falls back on it
_NUMBER, _OPTIONAL_NUMBER = "a finite number", "a finite number or null"
_CONFIG_TYPES = {
    "shared_intermediate_size": "an integer >= 0 or null",
    "max_position_embeddings": "an integer > 0",
    "shared_expert": "a bool",
    "use_shared_routed_gates": "a bool",
    "tie_word_embeddings": "a bool",
    "use_qk_norm": "a bool",
    "mlp_type": "a string or null",
    "routing_strategy": "a string",
    "attention_type": "a string",
    "expert_initialization": "gpt_normal, legacy_kaiming or null",
    "shared_output_scale": _OPTIONAL_NUMBER,
    "routed_output_scale": _OPTIONAL_NUMBER,
    "shared_output_scale_first_layer": _OPTIONAL_NUMBER,
    "shared_output_scale_last_layer": _OPTIONAL_NUMBER,
    "routed_output_scale_first_layer": _OPTIONAL_NUMBER,
    "routed_output_scale_last_layer": _OPTIONAL_NUMBER,
    "norm_eps": _NUMBER,
    "initializer_range": _NUMBER,
    "rope_theta": _NUMBER,
}
# args.profile becomes model.name=reference-<profile> in overrides.txt, read as `$(cat overrides.txt)`:
# one shell word and one Hydra value
_PROFILE = re.compile(r"[A-Za-z0-9_.+-]*")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fits(value: Any, kind: str) -> bool:
    """Whether a config value is of `kind`, one of _CONFIG_TYPES' descriptions."""
    if value is None:
        return kind.endswith("or null")
    if kind.startswith("an integer"):
        return _is_int(value) and value >= (0 if ">= 0" in kind else 1)
    if kind.startswith("a finite number"):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if kind == "a bool":
        return isinstance(value, bool)
    if kind.startswith("a string"):
        return isinstance(value, str)
    return value in ("gpt_normal", "legacy_kaiming")


def is_integer_tensor(tensor: Any) -> bool:
    import torch

    return not (tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool)


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
    for key, kind in _CONFIG_TYPES.items():
        if key in config and not _fits(config[key], kind):
            raise UserError(f"convert: {source}: config.{key}={config[key]!r} (allowed: {kind})")
    args = ckpt["args"]
    profile = args.get("profile")
    if profile is not None and not (isinstance(profile, str) and _PROFILE.fullmatch(profile)):
        raise UserError(
            f"convert: {source}: args.profile={profile!r} (allowed: letters, digits and _ . + -; it names "
            "the model in overrides.txt, model.name=reference-<profile>)"
        )
    if "steps" in args and not (_is_int(args["steps"]) and args["steps"] >= 0):
        raise UserError(
            f"convert: {source}: args.steps={args['steps']!r} (allowed: an integer >= 0, the run's --steps)"
        )
    _check_model_types(source, ckpt["model"])
    if config.get("top_k", 1) > 1:
        for key in _P_ARGS:
            if key not in ckpt["args"]:
                raise UserError(f"convert: {source}: args has no {key!r} (p is computed from it)")
            value = ckpt["args"][key]
            if not (value is None and key == "top_k_primary_weight_final") and not _fits(value, _NUMBER):
                raise UserError(
                    f"convert: {source}: args.{key}={value!r} (a finite number: p is computed from it)"
                )


def _check_model_types(source: Path, state: dict) -> None:
    """String keys and dense tensors only (the kinds and shapes are check_state's), and a floating-point
    hash_channel_scale: the conversion reads it before check_state."""
    import torch

    for key, value in state.items():
        if not isinstance(key, str):
            raise UserError(f"convert: {source}: model has a key {key!r} (allowed: parameter names, strings)")
        if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
            what = type(value).__name__ if not isinstance(value, torch.Tensor) else f"{value.layout} tensor"
            raise UserError(f"convert: {source}: model[{key!r}] is a {what}, not a dense tensor")
        if key.endswith("mlp.hash_channel_scale") and not value.is_floating_point():
            raise UserError(
                f"convert: {source}: model[{key!r}] is {value.dtype}, not a floating-point tensor"
            )


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
    """Every tensor the config implies is there with its shape and kind; nothing else is (but the dropped,
    which the conversion compares with what it builds: they too must be of their kind and shape)."""
    config, state = ckpt["config"], ckpt["model"]
    want = _expected_shapes(config, state, gates, shared)
    layers = config["num_hidden_layers"]
    d = config["hidden_size"] // config["num_attention_heads"]
    dropped = {  # suffix -> (shape, floating point)
        "rotary_emb.inv_freq": ((d // 2,), True),
        "mlp.token_to_expert": ((config["vocab_size"],), False),
    }
    for key, value in state.items():
        for suffix, (shape, floating) in dropped.items():
            kind_ok = value.is_floating_point() if floating else is_integer_tensor(value)
            if key.endswith(suffix) and (tuple(value.shape) != shape or not kind_ok):
                kind = "floating-point" if floating else "integer"
                raise UserError(
                    f"convert: {source}: model[{key!r}] is {value.dtype} {tuple(value.shape)}; "
                    f"allowed: a {kind} tensor of shape {shape}"
                )
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
        route = key.endswith("token_to_expert")
        if not (is_integer_tensor(tensor) if route else tensor.is_floating_point()):
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
