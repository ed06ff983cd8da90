"""The training loss backends behind one function, `training_loss`; evaluation always uses the exact
chunked path (trmoe.loss.tied.chunked_tied_ce).

    chunked  trmoe's own exact tied-head CE in token chunks: label smoothing, z-loss, pure CE reported.
    torch    torch.nn.functional.linear_cross_entropy with LinearCrossEntropyOptions (its chunked path,
             loss.chunk_tokens rows per chunk). That path has no z-loss, and label smoothing sends it back
             to full logits, so asking this backend for either is a config error.
    liger    liger-kernel's LigerFusedLinearCrossEntropyLoss (CUDA only): z-loss and label smoothing;
             the pure CE (train_loss column) is reported only without label smoothing (nan with it).
    auto     liger on CUDA when liger-kernel imports, chunked otherwise.

Every backend returns LossSums with sums over tokens, so the caller's normalisation by the tokens of
the whole accumulated batch (exact gradient accumulation) is the same for all of them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from trmoe.config.schema import LossBackend, LossConfig
from trmoe.errors import UserError
from trmoe.loss.tied import LossSums, chunked_tied_ce

IGNORE_INDEX = -100

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], LossSums]


def _liger_class():
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except Exception:  # ImportError, or triton failing to initialise
        return None
    return LigerFusedLinearCrossEntropyLoss


def resolve_backend(cfg: LossConfig, device: torch.device) -> LossBackend:
    """The backend a run uses (auto resolved). UserError when the requested one cannot run here."""
    backend = cfg.backend
    if backend == LossBackend.auto:
        if device.type == "cuda" and _liger_class() is not None:
            return LossBackend.liger
        return LossBackend.chunked
    if backend == LossBackend.liger:
        if device.type != "cuda":
            raise UserError(
                f"config error: loss.backend=liger: liger-kernel runs on CUDA only, this run is on "
                f"{device.type}; allowed here: chunked, torch, auto"
            )
        if _liger_class() is None:
            raise UserError(
                "config error: loss.backend=liger: liger-kernel is not importable "
                "(pip install 'trmoe[cuda]'); allowed here: chunked, torch, auto"
            )
    if backend == LossBackend.torch and not hasattr(F, "linear_cross_entropy"):
        raise UserError(
            f"config error: loss.backend=torch: this torch ({torch.__version__}) has no "
            "torch.nn.functional.linear_cross_entropy; allowed here: chunked, auto"
        )
    return backend


def _nan(like: torch.Tensor) -> torch.Tensor:
    return torch.full((), float("nan"), dtype=torch.float32, device=like.device)


def _torch_loss(cfg: LossConfig) -> LossFn:
    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=cfg.chunk_tokens, chunking_method=None)

    def loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> LossSums:
        h, t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
        if h.dtype != weight.dtype:  # the op wants one dtype; keep the fp32 master weight's
            h = h.to(weight.dtype)
        total = F.linear_cross_entropy(
            h, weight, t, reduction="sum", ignore_index=IGNORE_INDEX, options=options
        ).float()
        tokens = (t != IGNORE_INDEX).sum()
        # without smoothing and z-loss the objective is the pure CE; lse is not exposed: z is nan
        return LossSums(total=total, ce=total.detach(), z=_nan(total), tokens=tokens)

    return loss


def _liger_loss(cfg: LossConfig) -> LossFn:
    module = _liger_class()(
        ignore_index=IGNORE_INDEX,
        lse_square_scale=cfg.z_loss,
        label_smoothing=cfg.label_smoothing,
        reduction="sum",
        return_z_loss=True,
    )
    eps, c = cfg.label_smoothing, cfg.z_loss

    def loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> LossSums:
        h, t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
        w = weight if weight.dtype == h.dtype else weight.to(h.dtype)
        out = module(w, h, t)  # the module takes the weight first
        total, z_term = (out.loss, out.z_loss) if hasattr(out, "loss") else (out[0], out[1])
        total = total.float()
        z_term = z_term.detach().float() if z_term is not None else _nan(total)
        tokens = (t != IGNORE_INDEX).sum()
        # liger adds c * sum(lse^2) into the loss; without smoothing the rest is the pure CE
        ce = total.detach() - (z_term if c > 0 else 0.0) if eps == 0 else _nan(total)
        z = z_term / c if c > 0 else _nan(total)
        return LossSums(total=total, ce=ce, z=z, tokens=tokens)

    return loss


def _chunked_loss(cfg: LossConfig) -> LossFn:
    def loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> LossSums:
        return chunked_tied_ce(
            hidden,
            weight,
            targets,
            chunk_tokens=cfg.chunk_tokens,
            label_smoothing=cfg.label_smoothing,
            z_loss=cfg.z_loss,
            ignore_index=IGNORE_INDEX,
        )

    return loss


def training_loss(cfg: LossConfig, backend: LossBackend, compute_dtype: torch.dtype | None = None) -> LossFn:
    """The training loss function of a resolved backend: (hidden, tied weight, targets) -> LossSums.

    compute_dtype (the run's autocast dtype, bf16/fp16 on GPUs): the head's GEMMs run in it, as every
    other matmul of the step does; the backends still reduce the softmax and accumulate dW in fp32, and
    the gradient reaches the fp32 master weight through the cast."""
    if backend == LossBackend.torch:
        fn = _torch_loss(cfg)
    elif backend == LossBackend.liger:
        fn = _liger_loss(cfg)
    else:
        fn = _chunked_loss(cfg)
    if compute_dtype is None:
        return fn

    def in_compute_dtype(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> LossSums:
        return fn(hidden.to(compute_dtype), weight.to(compute_dtype), targets)

    return in_compute_dtype
