"""AdamW with parameter groups: routed experts, shared expert, everything else.

Each group has its own lr scale and weight decay. Only matrices are decayed: norms, gates and other
1-D/0-D tensors never are, and the tied embedding only when optimizer.decay_embedding is set.
"""

from __future__ import annotations

import torch
from torch import nn

from trmoe.config.schema import OptimizerConfig


def param_group_name(name: str) -> str:
    """'expert', 'shared' or 'base' from a parameter's name in TRMoETransformer."""
    if ".ffn.routed." in name or name.endswith("ffn.routed_gate"):
        return "expert"
    if ".ffn.shared." in name or name.endswith("ffn.shared_gate"):
        return "shared"
    return "base"


def param_groups(model: nn.Module, cfg: OptimizerConfig) -> list[dict]:
    scales = {"expert": cfg.expert_lr_scale, "shared": cfg.shared_lr_scale, "base": 1.0}
    decays = {
        "expert": cfg.weight_decay if cfg.expert_weight_decay is None else cfg.expert_weight_decay,
        "shared": cfg.weight_decay if cfg.shared_weight_decay is None else cfg.shared_weight_decay,
        "base": cfg.weight_decay,
    }
    buckets: dict[tuple[str, bool], list[nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        group = param_group_name(name)
        is_embedding = name == "embed.weight"
        decay = p.ndim >= 2 and (not is_embedding or cfg.decay_embedding)
        buckets.setdefault((group, decay), []).append(p)
    groups = []
    for (group, decay), params in sorted(buckets.items()):
        groups.append(
            {
                "name": f"{group}{'' if decay else '_no_decay'}",
                "params": params,
                "lr": cfg.lr * scales[group],
                "base_lr": cfg.lr * scales[group],  # the schedule multiplies this
                "weight_decay": decays[group] if decay else 0.0,
            }
        )
    return groups


def build_optimizer(model: nn.Module, cfg: OptimizerConfig, device: torch.device) -> torch.optim.Optimizer:
    # fused kernels on CUDA; the foreach path elsewhere (both are mathematically plain AdamW)
    fused = device.type == "cuda"
    return torch.optim.AdamW(
        param_groups(model, cfg),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        fused=fused,
        foreach=None if fused else True,
    )
