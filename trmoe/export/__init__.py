"""Export a trained model for tools outside trmoe (`python -m trmoe.export`, docs/after_training.md).

format "hf": a Hugging Face directory that transformers loads offline with
`AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` and `AutoTokenizer.from_pretrained(dir)`:
    config.json               TRMoEConfig, with auto_map naming the two files below (its `combine` and
                              `dense_layers` say which layers learn their combine weights, routing.combine,
                              and which are dense, routing.layers)
    model.safetensors         every weight and each layer's route table (model.<trmoe name>)
    generation_config.json    end-of-text id (the length bound: max_position_embeddings)
    configuration_trmoe.py    standalone (torch + transformers; importable without trmoe)
    modeling_trmoe.py
    tokenizer.json, tokenizer_config.json   o200k_base, converted offline from the rank file trmoe ships; or
                              a tokenizer=bpe run's own tokenizer.json, byte for byte (sha256 checked)
format "safetensors": model.safetensors (trmoe's own names) and config.json (the model spec) only.

A model.parametrization=mup model's two forward multipliers are baked into the hf format's weights, so that
the exported code (plain SP math) computes trmoe's logits: the readout multiplier c into the final norm's
weight (logits = (RMSNorm(h) * c) @ E^T), the attention scale s into each layer's q (q_norm's weight, or the
q rows of qkv without QK-norm) as s * sqrt(d), which SDPA's 1/sqrt(d) turns back into s.

The directory is written under a temporary name and renamed when complete: never half-written, and an
existing non-empty directory is never written into.
"""

from __future__ import annotations

import math
from importlib import resources
from pathlib import Path

import torch

from trmoe.data.tokenizer import Tokenizer
from trmoe.durable import json_text, staged_dir
from trmoe.errors import UserError, require_directory, require_writable
from trmoe.load import LoadedModel

FORMATS = ("hf", "safetensors")
_CODE = ("configuration_trmoe.py", "modeling_trmoe.py")


def hf_config(loaded: LoadedModel, eos_id: int | None = None) -> dict:
    """config.json of the hf format: TRMoEConfig's fields (configuration_trmoe.py) and the auto_map
    (`eos_id`: the run's tokenizer's end-of-text id; None = o200k_base's)."""
    from trmoe.data.tokenizer import EOS_ID

    eos = EOS_ID if eos_id is None else eos_id
    s = loaded.spec
    return {
        "architectures": ["TRMoEForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_trmoe.TRMoEConfig",
            "AutoModelForCausalLM": "modeling_trmoe.TRMoEForCausalLM",
        },
        "model_type": "trmoe",
        "dtype": "float32",
        "vocab_size": s.vocab_size,
        "embedding_rows": s.embedding_rows,
        "hidden_size": s.hidden_size,
        "num_hidden_layers": s.num_layers,
        "num_attention_heads": s.num_heads,
        "num_key_value_heads": s.num_kv_heads,
        "max_position_embeddings": s.max_seq_len,
        "qk_norm": s.qk_norm,
        "rope_theta": s.rope_theta,
        "shared_width": s.shared_width,
        "routed_width": s.routed_width,
        "num_experts": s.num_experts,
        "num_experts_per_tok": s.top_k,
        "primary_weight": s.primary_weight,
        "gates": s.gates,
        "shared_scales": list(s.shared_scales),
        "routed_scales": list(s.routed_scales),
        "routing_strategy": s.strategy,
        **_route_key(loaded),
        "combine": s.combine,
        "dense_layers": [layer for layer in range(s.num_layers) if s.is_dense(layer)],
        "rms_norm_eps": s.norm_eps,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "pad_token_id": eos,
        "use_cache": True,
        "trmoe": {
            "run": run_name(loaded),
            "step": loaded.step,  # the weights' hash is added once written
            "parametrization": s.parametrization,  # mup: its multipliers are baked into the weights
        },
    }


def _route_key(loaded: LoadedModel) -> dict:
    """config.json's route_key (what every layer routes on) and, for a hashed key, each layer's salt."""
    from trmoe.model.routing import layer_salt

    keys = {block.ffn.route_key for block in loaded.model.blocks if block.ffn.routed is not None} or {"token"}
    if len(keys) != 1:
        raise UserError(
            f"--format hf: {loaded.checkpoint} routes its layers on different keys {sorted(keys)}"
        )
    key = keys.pop()
    if key == "token":
        return {"route_key": key}
    return {
        "route_key": key,
        "route_salts": [layer_salt(loaded.spec.route_seed, i) for i in range(loaded.spec.num_layers)],
    }


def run_name(loaded: LoadedModel) -> str:
    """The run's name (run.name as it recorded it; its directory's name otherwise): where the export came
    from, without the local path (which would publish the user's file system)."""
    return str((loaded.config.get("run") or {}).get("name") or loaded.run_dir.name)


def _sha256(path: Path) -> str:
    import hashlib

    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _readable(out: Path) -> None:
    """Files as the user's umask makes them (safetensors writes 0600)."""
    import os

    umask = os.umask(0)
    os.umask(umask)
    for path in out.iterdir():
        path.chmod(0o666 & ~umask)


def write_tokenizer(out: Path, max_len: int, tok: Tokenizer | None = None) -> None:
    """tokenizer.json / tokenizer_config.json: o200k_base as a byte-level BPE (merges recovered from the
    ranks), its special tokens at trmoe's ids (end-of-text 199999); or a tokenizer=bpe run's tokenizer.json
    as it is (`tok`: PreTrainedTokenizerFast reads that format itself)."""
    if tok is not None and tok.path is not None:
        (out / "tokenizer.json").write_bytes(tok.path.read_bytes())
        _tokenizer_config(out, max_len)
        return
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from trmoe.data.tokenizer import PAT_STR, _parse_ranks, _rank_file_bytes, load_o200k

    ranks, specials = _parse_ranks(_rank_file_bytes()), dict(load_o200k()._special_tokens)

    class _O200k(TikTokenConverter):
        def load_tiktoken_bpe(self, _path) -> dict[bytes, int]:
            return ranks  # the rank file trmoe ships, not a download

        def extract_vocab_merges_from_model(self, path):
            vocab, merges = super().extract_vocab_merges_from_model(path)
            vocab.update(specials)  # so that each special token keeps its o200k id when it is added
            return vocab, merges

    _O200k(vocab_file=None, pattern=PAT_STR, extra_special_tokens=specials).converted().save(
        str(out / "tokenizer.json")
    )
    _tokenizer_config(out, max_len)


def _tokenizer_config(out: Path, max_len: int) -> None:
    """tokenizer_config.json: both tokenizers name their end-of-text token <|endoftext|>."""
    eos = "<|endoftext|>"
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": eos,
        "eos_token": eos,
        "pad_token": eos,
        "model_max_length": max_len,
        "padding_side": "left",  # a decoder-only model: batched generation pads on the left
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json_text(config, indent=2) + "\n")


def baked_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with its muP forward multipliers folded into weights (module docstring); the
    state dict itself under sp (every multiplier 1)."""
    from trmoe.model.mup import attention_scale

    spec = model.spec
    state = {k: v.detach() for k, v in model.state_dict().items()}  # new tensors only where a factor goes
    if model.output_mult != 1:
        state["norm.weight"] = state["norm.weight"] * model.output_mult
    scale = attention_scale(spec)
    if scale is not None:
        q_factor = scale * math.sqrt(spec.head_dim)
        for layer in range(spec.num_layers):
            prefix = f"blocks.{layer}.attn."
            if spec.qk_norm:
                state[prefix + "q_norm.weight"] = state[prefix + "q_norm.weight"] * q_factor
            else:
                qkv = state[prefix + "qkv.weight"].clone()
                qkv[: spec.num_heads * spec.head_dim] *= q_factor
                state[prefix + "qkv.weight"] = qkv
    return state


def _write_hf(loaded: LoadedModel, out: Path, tokenizer: bool) -> None:
    from safetensors.torch import save_file

    from trmoe.data.tokenizer import EOS_ID

    tok = loaded.tokenizer() if tokenizer else None
    eos = EOS_ID if tok is None else tok.eos_id
    state = {f"model.{k}": v.contiguous() for k, v in baked_state(loaded.model).items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = hf_config(loaded, eos)
    config["trmoe"]["weights_sha256"] = _sha256(out / "model.safetensors")
    (out / "config.json").write_text(json_text(config, indent=2) + "\n")
    # No max_length: transformers warns on every generate(max_new_tokens=...) when one is set; without it,
    # its default length is capped at config.max_position_embeddings (the model's context).
    generation = {"bos_token_id": eos, "eos_token_id": eos, "pad_token_id": eos}
    (out / "generation_config.json").write_text(json_text(generation, indent=2) + "\n")
    code = resources.files("trmoe.export") / "hf"
    for name in _CODE:
        (out / name).write_text((code / name).read_text(encoding="utf-8"), encoding="utf-8")
    if tokenizer:
        write_tokenizer(out, loaded.spec.max_seq_len, tok)


def _write_safetensors(loaded: LoadedModel, out: Path) -> None:
    from safetensors.torch import save_file

    state = {k: v.detach().contiguous() for k, v in loaded.model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt", "step": str(loaded.step)})
    config = {"trmoe_model_spec": loaded.spec.to_dict(), "step": loaded.step, "config": loaded.config}
    (out / "config.json").write_text(json_text(config, indent=2) + "\n")


def check_out(out: Path, fmt: str) -> None:
    """UserError unless `fmt` is known and `out` is a new or empty directory."""
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt}: allowed: {', '.join(FORMATS)}")
    require_directory(out, "--out", "a new or empty directory")
    if out.is_dir() and any(out.iterdir()):
        raise UserError(f"--out {out}: not empty (nothing is overwritten); allowed: a new or empty directory")
    require_writable(out, f"--out {out}", "allowed: a new or empty directory that can be written")


def export(loaded: LoadedModel, out: Path, fmt: str = "hf") -> Path:
    """Write `loaded` (fp32, on CPU) into the new directory `out`; return it."""
    out = Path(out)
    check_out(out, fmt)
    from trmoe.model.routing import REGISTRY

    routers = [name for name in loaded.spec.strategies if REGISTRY[name].learned]
    if fmt == "hf" and routers:
        raise UserError(
            f"--format hf: {loaded.checkpoint} routes with a router (routing.strategy={routers[0]}); the "
            "exported model code supports fixed route tables only; allowed: --format safetensors"
        )
    loaded.model.refuse_analysis_only(f"export of {loaded.checkpoint}")
    if fmt == "hf" and loaded.text_vocab:
        loaded.tokenizer()  # a tokenizer=bpe file missing or changed: refused before anything is written
    model = loaded.model.to(device="cpu", dtype=torch.float32)
    loaded = LoadedModel(
        model, loaded.spec, loaded.step, loaded.checkpoint, loaded.config, torch.device("cpu")
    )
    with staged_dir(out) as tmp:  # an empty directory at `out` (checked above) is replaced
        if fmt == "hf":
            _write_hf(loaded, tmp, tokenizer=loaded.text_vocab)
        else:
            _write_safetensors(loaded, tmp)
        _readable(tmp)
    return out
