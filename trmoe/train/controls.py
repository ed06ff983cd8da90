"""The per-run and per-step training controls, in one place the loop calls:

- model execution: activation checkpointing per block, shared-expert token chunking, torch.compile;
- the loss backend (loss.backend, resolved once; evaluation stays on the exact chunked path);
- the schedules (LR, top-k primary weight p, scheduled gates, diversity weight lambda), all pure
  functions of the step, set at the start of every step;
- the expert-diversity penalty, added once per optimizer step;
- expert telemetry (telemetry.moe), which exists only when on;
- the extra metrics columns (per-group LRs, p, lambda, penalty, telemetry aggregates).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trmoe.config.schema import Config, LossBackend
from trmoe.errors import UserError
from trmoe.optim.build import GroupLRs, describe_groups
from trmoe.run.records import StepCsv
from trmoe.run.rundir import TELEMETRY
from trmoe.runtime.env import autocast_dtype
from trmoe.train.diversity import expert_diversity
from trmoe.train.loss import LossSums
from trmoe.train.loss_backend import resolve_backend, training_loss
from trmoe.train.observe.telemetry import MoETelemetry, telemetry_columns
from trmoe.train.schedule import apply_lr, build_schedules

log = logging.getLogger("trmoe")


def check_controls(cfg: Config, device: torch.device) -> LossBackend:
    """The checks that need the device or the installed packages (validate.py has the static ones).
    Raises UserError before anything is written."""
    backend = resolve_backend(cfg.loss, device)
    t = cfg.trainer
    if t.compile:
        import torch._dynamo

        known = torch._dynamo.list_backends(exclude_tags=())
        if t.compile_backend not in known:
            raise UserError(
                f"config error: trainer.compile_backend={t.compile_backend}: not a torch.compile backend; "
                f"allowed: {', '.join(sorted(known))}"
            )
    return backend


def is_log_step(step: int, cfg: Config) -> bool:
    """Steps that write a metrics row: 1, every log_every, every eval step and the last."""
    t = cfg.trainer
    is_eval = step == t.steps or (t.eval_every > 0 and step % t.eval_every == 0)
    return is_eval or step == 1 or step % t.log_every == 0


def freeze_scheduled_gates(model: nn.Module, schedules) -> None:
    """A scheduled gate follows its schedule: it is not learned, and the optimizer does not see it."""
    for block in model.blocks:
        ffn = block.ffn
        if schedules.shared_gate is not None and ffn.shared_gate is not None:
            ffn.shared_gate.requires_grad_(False)
        if schedules.routed_gate is not None and ffn.routed_gate is not None:
            ffn.routed_gate.requires_grad_(False)


class TrainingControls:
    def __init__(self, cfg: Config, model: nn.Module, device: torch.device):
        """Call after the model is built and before the optimizer is (scheduled gates stop being
        parameters the optimizer sees)."""
        t = cfg.trainer
        self.cfg, self.model = cfg, model
        self.schedules = build_schedules(cfg)
        model.activation_checkpointing = t.activation_checkpointing
        model.sparse_embedding_grad = device.type == "cpu"  # summed into the tied head's dense gradient
        for block in model.blocks:
            if block.ffn.shared is not None:
                block.ffn.shared.chunk_tokens = t.shared_chunk_tokens
        freeze_scheduled_gates(model, self.schedules)
        self.loss_backend = check_controls(cfg, device)
        # under autocast the tied head's GEMMs run in the autocast dtype too (fp32 softmax and dW sums)
        self.loss_fn = training_loss(cfg.loss, self.loss_backend, autocast_dtype(cfg.hardware, device))
        if self.loss_backend == LossBackend.liger and cfg.loss.label_smoothing > 0:
            log.warning(
                "loss.backend=liger with label smoothing: liger reports only the smoothed loss, so "
                "train_loss/train_ppl are nan (train_objective and the exact eval_loss are logged)"
            )
        self.telemetry = MoETelemetry(model, device) if cfg.telemetry.moe else None
        # evaluation and the checkpoints use `model`; the training forward goes through this one
        self.train_model: nn.Module = model
        self.values: dict[str, float | None] = {}
        self._group_lrs: GroupLRs | None = None
        self._diversity: torch.Tensor | None = None  # last penalty value (device, detached)
        self._router: torch.Tensor | None = None  # this step's [aux, z], micro-batch mean (device, detached)
        self._grad_sq: torch.Tensor | None = None
        self._telemetry_writer: StepCsv | None = None
        self.layer_rows: list[dict[str, Any]] = []  # the last logged step's telemetry.csv rows (trackers)

    # --- once per run -------------------------------------------------------------------------------
    def set_train_module(self, module: nn.Module) -> None:
        """The module the training forward runs (the model, or its DDP wrapper), compiled once here when
        trainer.compile is on."""
        t = self.cfg.trainer
        self.train_model = torch.compile(module, backend=t.compile_backend) if t.compile else module

    def attach(self, optimizer, telemetry_csv: Path | None) -> None:
        """telemetry_csv=None on ranks > 0 of a distributed job: they take part in the telemetry reduction
        but rank 0 alone writes telemetry.csv."""
        self._group_lrs = GroupLRs(self.model, optimizer)
        if self.telemetry is not None and telemetry_csv is not None:
            self._telemetry_writer = StepCsv.continuing(
                telemetry_csv, telemetry_columns(self.telemetry.num_experts)
            )

    def record(self, optimizer) -> dict[str, Any]:
        """For run_config.json: what the controls resolved to."""
        return {
            "loss_backend": self.loss_backend.value,
            "optimizer_groups": describe_groups(optimizer),
            "schedules": self.schedules.to_dict(),
            "compile": {"enabled": self.cfg.trainer.compile, "backend": self.cfg.trainer.compile_backend},
            "telemetry_file": TELEMETRY if self.telemetry is not None else None,
        }

    def close(self) -> None:
        if self._telemetry_writer is not None:
            self._telemetry_writer.close()
        if self.telemetry is not None:
            self.telemetry.remove()

    # --- every step ---------------------------------------------------------------------------------
    def begin_step(self, step: int, optimizer) -> float:
        """Set this step's LR, p, gates and lambda; returns the LR multiplier."""
        v = self.values = self.schedules.at(step)
        self._router = None
        apply_lr(optimizer, v["lr_mult"])
        with torch.no_grad():
            for block in self.model.blocks:
                ffn = block.ffn
                if v["primary_weight"] is not None and ffn.routed is not None:
                    if ffn.routed.primary_weight != v["primary_weight"]:
                        ffn.routed.primary_weight = v["primary_weight"]
                if v["shared_gate"] is not None and ffn.shared_gate is not None:
                    ffn.shared_gate.fill_(v["shared_gate"])
                if v["routed_gate"] is not None and ffn.routed_gate is not None:
                    ffn.routed_gate.fill_(v["routed_gate"])
        return v["lr_mult"]

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """The training forward (telemetry counts it when on)."""
        ctx = self.telemetry.recording() if self.telemetry is not None else contextlib.nullcontext()
        with ctx:
            return self.train_model(inputs)

    def loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> LossSums:
        return self.loss_fn(hidden, self.model.head_weight, targets)

    def penalty(self) -> torch.Tensor | None:
        """lambda(step) * diversity, to add once per optimizer step (on one micro-batch); None when off."""
        lam = self.values.get("diversity")
        if lam is None:
            return None
        div = expert_diversity(self.model, self.cfg.loss.diversity_target)
        self._diversity = div.detach()
        return lam * div

    def with_router_loss(self, objective: torch.Tensor, micro_batches: int) -> torch.Tensor:
        """objective + routing.aux_weight * aux + routing.z_weight * z of the learned routers' forward just
        run (each term per micro-batch, averaged over the step's micro-batches as the cross-entropy is, so
        accumulation and DDP over the same micro-batches agree); the objective as it is otherwise."""
        terms = self.model.router_losses()
        if terms is None:
            return objective
        pair = torch.stack([terms["aux"], terms["z"]]).detach() / micro_batches
        self._router = pair if self._router is None else self._router + pair
        r = self.cfg.routing
        extra = None
        for weight, term in ((r.aux_weight, terms["aux"]), (r.z_weight, terms["z"])):
            if weight > 0:
                extra = weight * term if extra is None else extra + weight * term
        return objective if extra is None else objective + extra / micro_batches

    def before_clip(self, log_step: bool) -> None:
        """After backward, before clipping: the telemetry gradient norms of a logged step."""
        if self.telemetry is not None and log_step:
            self._grad_sq = self.telemetry.grad_norms()

    def rewind(self, step: int) -> None:
        """A rollback to the checkpoint of `step`: telemetry.csv loses its later rows, the window its counts
        (the checkpoint's are loaded next, by `Trainer.load_state_dict`)."""
        self._grad_sq = None
        if self.telemetry is not None:
            self.telemetry.reset()
        if self._telemetry_writer is not None:
            self._telemetry_writer.rewind(step)

    def log_columns(self, step: int) -> dict[str, Any]:
        """The metrics columns of a logged step that the controls own: per-group LRs, the gates' means, p,
        lambda, the router's losses, telemetry (writes the telemetry.csv rows of the window)."""
        row: dict[str, Any] = dict(self._group_lrs.row()) if self._group_lrs is not None else {}
        row["shared_gate"], row["routed_gate"] = _gate_means(self.model)
        routed = [b.ffn.routed for b in self.model.blocks if b.ffn.routed is not None]
        row["primary_weight"] = routed[0].primary_weight if routed and routed[0].top_k > 1 else None
        row["diversity_lambda"] = self.values.get("diversity")
        row["diversity"] = None if self._diversity is None else float(self._diversity)
        if self._router is not None:
            router = self._router.clone()
            if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
                torch.distributed.all_reduce(router)  # every rank logs: the mean over ranks
                router /= torch.distributed.get_world_size()
            row["router_aux"], row["router_z"] = router.tolist()
        if self.telemetry is not None:
            aggregate, layer_rows = self.telemetry.collect(step, self._grad_sq)
            self._grad_sq = None
            row.update(aggregate)
            if self._telemetry_writer is not None:
                self._telemetry_writer.write_rows(layer_rows)
            self.layer_rows = layer_rows
        return row


def _gate_means(model: nn.Module) -> tuple[float | None, float | None]:
    shared = [b.ffn.shared_gate for b in model.blocks if b.ffn.shared_gate is not None]
    routed = [b.ffn.routed_gate for b in model.blocks if b.ffn.routed_gate is not None]

    def mean(gates):
        return torch.stack([g.detach() for g in gates]).mean().item() if gates else None

    return mean(shared), mean(routed)
