"""Model preparation: what the config sets on the model once, before training (and before the optimizer is
built): activation checkpointing per block, shared-expert token chunking, the sparse embedding gradient on
CPU, the scheduled gates taken out of the learned parameters; and torch.compile of the training module.
`check_backends` is the part that can fail on this machine (loss and compile backends), run by the job
before anything is written.
"""

from __future__ import annotations

import torch
from torch import nn

from trmoe.config.schema import Config, LossBackend, TrainerConfig
from trmoe.errors import UserError
from trmoe.loss.backend import resolve_backend
from trmoe.optim.schedule import Schedules


def check_backends(cfg: Config, device: torch.device) -> LossBackend:
    """The checks that need the device or the installed packages (validate.py has the static ones): the
    loss backend (resolved) and the compile backend. Raises UserError before anything is written."""
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


def freeze_scheduled_gates(model: nn.Module, schedules: Schedules) -> None:
    """A scheduled gate follows its schedule: it is not learned, and the optimizer does not see it."""
    for block in model.blocks:
        ffn = block.ffn
        if schedules.shared_gate is not None and ffn.shared_gate is not None:
            ffn.shared_gate.requires_grad_(False)
        if schedules.routed_gate is not None and ffn.routed_gate is not None:
            ffn.routed_gate.requires_grad_(False)


def prepare_model(model: nn.Module, t: TrainerConfig, device: torch.device, schedules: Schedules) -> None:
    """Call after the model is built and before the optimizer is (scheduled gates stop being parameters
    the optimizer sees)."""
    model.activation_checkpointing = t.activation_checkpointing
    model.sparse_embedding_grad = device.type == "cpu"  # summed into the tied head's dense gradient
    for block in model.blocks:
        if block.ffn.shared is not None:
            block.ffn.shared.chunk_tokens = t.shared_chunk_tokens
    freeze_scheduled_gates(model, schedules)


def compiled(module: nn.Module, t: TrainerConfig) -> nn.Module:
    """The module the training forward runs (the model, or its DDP wrapper), compiled once when
    trainer.compile is on."""
    return torch.compile(module, backend=t.compile_backend) if t.compile else module
