"""The training objective of one micro-batch: the training forward (under autocast; the model, its DDP
wrapper or its compiled module; counted by expert telemetry when on), the loss backend's sums (loss.backend,
resolved once; evaluation stays on the exact chunked path), and the terms that join it: a learned router's
auxiliary losses on every micro-batch, the expert-diversity penalty once per optimizer step. The Trainer's
step and the step benchmarks (trmoe.bench.step, trmoe.tools.telemetry_overhead) run this same objective."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from torch import nn

from trmoe.config.schema import Config, LossBackend
from trmoe.loss.backend import resolve_backend, training_loss
from trmoe.loss.tied import LossSums
from trmoe.run.columns import MetricColumn
from trmoe.runtime import env
from trmoe.train.diversity import expert_diversity

log = logging.getLogger("trmoe")


class Objective:
    COLUMNS = (
        MetricColumn(
            "diversity",
            "1",
            "moe/diversity",
            "expert-diversity penalty (mean squared expert cosine) at this step (nan when off)",
            slot=27,
        ),
        MetricColumn(
            "router_aux",
            "1",
            "moe/router_aux",
            "routers: load-balancing loss at this step (layer mean; learned_v3 alone: its sequence-wise "
            "one; 1 = balanced; else nan)",
            slot=28,
        ),
        MetricColumn(
            "router_z",
            "1",
            "moe/router_z",
            "softmax routers: router z-loss at this step (layer mean; nan otherwise)",
            slot=29,
        ),
    )

    def __init__(
        self,
        cfg: Config,
        model: nn.Module,
        device: torch.device,
        amp_dtype: torch.dtype | None,
        telemetry: Any = None,
    ):
        """`telemetry`: what counts the training forwards (`recording()`), or None."""
        self.cfg, self.model, self.device, self.amp_dtype, self.telemetry = (
            cfg,
            model,
            device,
            amp_dtype,
            telemetry,
        )
        self.loss_backend = resolve_backend(cfg.loss, device)
        # under autocast the tied head's GEMMs run in the autocast dtype too (fp32 softmax and dW sums)
        self.loss_fn = training_loss(cfg.loss, self.loss_backend, amp_dtype)
        if self.loss_backend == LossBackend.liger and cfg.loss.label_smoothing > 0:
            log.warning(
                "loss.backend=liger with label smoothing: liger reports only the smoothed loss, so "
                "train_loss/train_ppl are nan (train_objective and the exact eval_loss are logged)"
            )
        # evaluation and the checkpoints use `model`; the training forward goes through this one
        self.train_model: nn.Module = model
        self.diversity_weight: float | None = None  # this step's lambda (None: no penalty)
        self._diversity: torch.Tensor | None = None  # last penalty value (device, detached)
        # this step's router terms by name (aux, z, seq_aux), micro-batch means (device, detached)
        self._router: dict[str, torch.Tensor] | None = None

    def begin_step(self, diversity_weight: float | None) -> None:
        self.diversity_weight, self._router = diversity_weight, None

    def __call__(
        self, inputs: torch.Tensor, targets: torch.Tensor, step_tokens: int, micro_batches: int, last: bool
    ) -> tuple[torch.Tensor, LossSums]:
        """The objective of one micro-batch, and its loss sums. Normalised by the tokens of the whole
        accumulated batch: accumulation equals one larger batch (and every rank has as many tokens, so
        DDP's gradient mean is the global batch's). The penalty joins once per step, on the last one."""
        # the targets go into the forward only where the routes read them (oracle_future_hash)
        hidden = self.forward(inputs, targets) if self.model.needs_targets else self.forward(inputs)
        sums = self.loss(hidden, targets)
        return self.total(sums, step_tokens, micro_batches, last), sums

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The training forward (telemetry counts it when on); `targets` only for a model whose routes read
        them (oracle_future_hash)."""
        recording = self.telemetry.recording() if self.telemetry is not None else contextlib.nullcontext()
        with recording, env.autocast(self.device, self.amp_dtype):
            if targets is not None:
                return self.train_model(inputs, targets=targets)
            return self.train_model(inputs)

    def loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> LossSums:
        return self.loss_fn(hidden, self.model.head_weight, targets)

    def total(self, sums: LossSums, step_tokens: int, micro_batches: int, last: bool) -> torch.Tensor:
        """The cross-entropy sums per step token, plus `terms`."""
        objective, terms = sums.total / step_tokens, self.terms(micro_batches, last)
        return objective if terms is None else objective + terms

    def terms(self, micro_batches: int, last: bool) -> torch.Tensor | None:
        """What joins the cross-entropy: routing.aux_weight * aux + routing.z_weight * z (softmax routers) +
        routing.seq_aux_weight * seq_aux (learned_v3) of the forward just run (each per micro-batch, averaged
        over the step's micro-batches as the cross-entropy is, so accumulation and DDP over the same
        micro-batches agree), and on the last micro-batch lambda(step) * diversity (once per optimizer
        step). None when there is nothing."""
        terms = self._router_loss(micro_batches)
        penalty = self._penalty() if last else None
        if penalty is not None:
            terms = penalty if terms is None else terms + penalty
        return terms

    def _penalty(self) -> torch.Tensor | None:
        lam = self.diversity_weight
        if lam is None:
            return None
        div = expert_diversity(self.model, self.cfg.loss.diversity_target)
        self._diversity = div.detach()
        return lam * div

    def _router_loss(self, micro_batches: int) -> torch.Tensor | None:
        terms = self.model.router_losses()
        if terms is None:
            return None
        logged = {name: term.detach() / micro_batches for name, term in terms.items()}
        if self._router is None:
            self._router = logged
        else:
            self._router = {name: self._router[name] + value for name, value in logged.items()}
        r, extra = self.cfg.routing, None
        weights = {"aux": r.aux_weight, "z": r.z_weight, "seq_aux": r.seq_aux_weight}
        for name, term in terms.items():
            if weights[name] > 0:
                extra = weights[name] * term if extra is None else extra + weights[name] * term
        return None if extra is None else extra / micro_batches

    def columns_declared(self) -> tuple[MetricColumn, ...]:
        return self.COLUMNS

    def row(self, step: int, row) -> dict[str, Any]:
        """The metrics columns of a logged step (a producer, trmoe.run.columns): the penalty's last value,
        the router's losses (the mean over ranks)."""
        row: dict[str, Any] = {"diversity": None if self._diversity is None else float(self._diversity)}
        if self._router is not None:
            names = sorted(self._router)  # every rank has the same terms (the same model)
            router = torch.stack([self._router[n] for n in names])
            if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
                torch.distributed.all_reduce(router)  # every rank logs: the mean over ranks
                router /= torch.distributed.get_world_size()
            values = dict(zip(names, router.tolist(), strict=True))
            # the softmax routers' balance loss, else learned_v3's sequence-wise one (both 1 when balanced)
            row["router_aux"] = values.get("aux", values.get("seq_aux"))
            row["router_z"] = values.get("z")
        return row
