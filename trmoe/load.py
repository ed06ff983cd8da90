"""Load a trained model: the one mechanism `trmoe.sample`, `trmoe.export` and `trmoe.eval` share.

A run directory, its checkpoints/ directory or one checkpoint (step_XXXXXXXX) -> the checkpoint (the newest
complete one, or a chosen step), verified against its meta.json (`trmoe.run.find`: finding a checkpoint is
the run directory's business); the model is rebuilt from the config that checkpoint recorded
(meta.json["config"], the run's own composed config) and takes its weights and route tables, whichever
format wrote them (torch: one file; dcp: torch.distributed.checkpoint, FSDP/DDP runs).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trmoe.data.tokenizer import O200K_VOCAB, Tokenizer, load_tokenizer
from trmoe.errors import UserError
from trmoe.model.transformer import ModelSpec, TRMoETransformer
from trmoe.run.find import find_checkpoint


@dataclass
class LoadedModel:
    model: TRMoETransformer
    spec: ModelSpec
    step: int
    checkpoint: Path
    config: dict[str, Any]  # the run's composed config as the checkpoint recorded it
    device: torch.device

    @property
    def run_dir(self) -> Path:
        return self.checkpoint.parent.parent

    @property
    def tokenizer_name(self) -> str:
        """tokenizer.name as the run recorded it (a record from before the tokenizer group: o200k)."""
        return str((self.config.get("tokenizer") or {}).get("name") or "o200k")

    @property
    def text_vocab(self) -> bool:
        """Whether the model reads text (text prompts can be encoded for it): o200k_base ids, or the ids of
        the tokenizer=bpe it was trained with."""
        return self.tokenizer_name == "bpe" or self.spec.vocab_size == O200K_VOCAB

    def tokenizer(self) -> Tokenizer:
        """The tokenizer the run read its text with (its recorded tokenizer.*): o200k_base, or its bpe
        tokenizer.json, checked against the recorded sha256 and the model's vocabulary."""
        if self.tokenizer_name != "bpe":
            return load_tokenizer()
        t = self.config.get("tokenizer") or {}
        path, sha = t.get("path"), t.get("sha256")
        if not path or not Path(path).is_file():
            raise UserError(
                f"run {self.run_dir}: its tokenizer file {path} (tokenizer=bpe, sha256 {str(sha)[:16]}...) "
                "is missing; allowed: the run with its tokenizer.json back at that path"
            )
        tok = load_tokenizer("bpe", path)
        if (sha and tok.sha256 != sha) or tok.n_vocab != self.spec.vocab_size:
            raise UserError(
                f"run {self.run_dir}: its tokenizer file {path} changed since the run (sha256 "
                f"{tok.sha256[:16]}..., {tok.n_vocab} ids; recorded {str(sha)[:16]}..., "
                f"{self.spec.vocab_size} ids); allowed: the file the run was trained with"
            )
        return tok


def spec_from_config(config: dict[str, Any]) -> ModelSpec:
    """The ModelSpec of a recorded (resolved) config container, validated as the train app validates it."""
    from omegaconf import OmegaConf

    from trmoe.config.resolve import to_config
    from trmoe.config.schema import Config
    from trmoe.config.spec import model_spec

    try:
        cfg = OmegaConf.merge(OmegaConf.structured(Config), config)
    except Exception as e:  # another trmoe version's config: keys this one does not know
        raise UserError(f"checkpoint config: not readable by this trmoe ({str(e).splitlines()[0]})") from None
    return model_spec(to_config(cfg))


def load_model(
    path: str | Path, step: int | None = None, *, device: str = "auto", dtype: str = "auto"
) -> LoadedModel:
    """The model of a run (or checkpoint) at `step` (None: the newest complete checkpoint), in eval mode."""
    from trmoe.run.checkpoint import TORCH_PAYLOAD, _single_process_quiet
    from trmoe.runtime.env import pick_device, weights_dtype  # (not at the top: config.validate imports this)

    info = find_checkpoint(path, step)
    config = info.meta.get("config")
    if not isinstance(config, dict):
        raise UserError(f"checkpoint {info.path}: meta.json records no config; allowed: a trmoe checkpoint")
    spec = spec_from_config(config)
    dev = pick_device(device, label="device")
    model = TRMoETransformer(spec)
    if info.meta.get("format", "torch") == "torch":
        state = torch.load(info.path / TORCH_PAYLOAD, map_location="cpu", weights_only=True)["model"]
    else:
        import torch.distributed.checkpoint as dcp

        state = model.state_dict()  # DCP fills these tensors in place (the model part only)
        with _single_process_quiet():
            dcp.load({"model": state}, checkpoint_id=str(info.path))
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        detail = " ".join(str(e).split("\n\t")[1:2]).strip() or str(e).splitlines()[0]
        raise UserError(f"checkpoint {info.path} does not fit its recorded config ({detail[:200]})") from None
    model = model.to(device=dev, dtype=weights_dtype(dtype, dev)).eval()
    return LoadedModel(model, spec, info.step, info.path, config, dev)
