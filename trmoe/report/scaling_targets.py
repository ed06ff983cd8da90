"""Extrapolation targets of a scaling study: a model profile (conf/model/<name>.yaml) trained on a token
budget, as the fits see it (docs/scaling.md):

    N = non-embedding active parameters        (trmoe.model.transformer.parameter_counts, meta device)
    D = tokens_per_param · N                   (Chinchilla's 20 by default)
    C = flops_per_token(profile, seq_len) · D  (trmoe.model.flops: matrices, attention and the tied head)
    κ = C / (N · D)                            the FLOPs per token per parameter of that profile
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_TARGETS = ("1b", "8b")
TOKENS_PER_PARAM = 20.0


@dataclass(frozen=True)
class Target:
    name: str
    N: int  # non-embedding active parameters
    D: float  # tokens
    C: float  # training FLOPs
    kappa: float
    params: dict | None = None  # its parameter counts (total, active, embedding, non_embedding)


def target(profile: str, *, tokens_per_param: float = TOKENS_PER_PARAM, seq_len: int = 2048) -> Target:
    """The target `profile` (a model profile name) at `tokens_per_param` tokens per N."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.initialize import get_gh_backup, restore_gh_from_backup

    from trmoe.config.resolve import compose_packaged, to_config
    from trmoe.config.spec import model_spec
    from trmoe.model.flops import flops_per_token
    from trmoe.model.transformer import parameter_counts

    backup = get_gh_backup()  # inside a running app (a sweep's report callback): its Hydra is set aside
    GlobalHydra.instance().clear()  # for the packaged composition, and put back after it
    try:
        spec = model_spec(to_config(compose_packaged([f"model={profile}"])))
    finally:
        restore_gh_from_backup(backup)
    params = parameter_counts(spec)
    N = params.active - params.embedding
    D = tokens_per_param * N
    C = float(flops_per_token(spec, params, seq_len)) * D
    return Target(profile, N, D, C, C / (N * D), params.to_dict())
