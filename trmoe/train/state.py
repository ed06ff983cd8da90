"""The registry of a run's stateful components (`Components`: a checkpoint's rank-local state), and the
small ones without a module of their own: the random generators and the run's progress (step, training
time, last held-out loss). Each has `state_dict`/`load_state_dict`, like the data, the guard, the metrics
window and the telemetry."""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from trmoe.run.checkpoint import CheckpointError
from trmoe.runtime.env import mps_available

log = logging.getLogger("trmoe")


@dataclass
class _Entry:
    name: str
    component: Any
    flat: bool
    last: bool


class Components:
    """The named stateful components of a checkpoint's rank-local state (rank_XXXXX.pt): `state_dict()` is
    {"version": ..., name: component.state_dict() for each in registration order}; a `flat` component's
    keys sit at the top level instead (older checkpoints were written so), and it loads from the whole
    dictionary. A component registered as None saves None. `load_state_dict` gives each its part back in
    registration order, the `last` ones after the rest (the RNG: nothing after it may draw); a part that is
    missing or None leaves its component as it is (a checkpoint older than the component)."""

    def __init__(self, version: int):
        self.version = version
        self._entries: list[_Entry] = []

    def register(self, name: str, component: Any, *, flat: bool = False, last: bool = False) -> None:
        if any(e.name == name for e in self._entries):
            raise ValueError(f"component {name!r} is registered already")
        self._entries.append(_Entry(name, component, flat, last))

    def names(self) -> list[str]:
        return [e.name for e in self._entries]

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"version": self.version}
        for e in self._entries:
            part = None if e.component is None else e.component.state_dict()
            if e.flat:
                state.update(part)
            else:
                state[e.name] = part
        return state

    def load_state_dict(self, state: dict[str, Any], *, skip: Collection[str] = ()) -> None:
        """Raises CheckpointError for another version; `skip`: names left as they are."""
        if state.get("version") != self.version:
            raise CheckpointError(
                f"train state version {state.get('version')}; this trmoe reads {self.version}"
            )
        entries = [e for e in self._entries if not e.last] + [e for e in self._entries if e.last]
        for e in entries:
            if e.name in skip or e.component is None:
                continue
            part = state if e.flat else state.get(e.name)
            if part is not None:
                e.component.load_state_dict(part)


class RNG:
    """Every generator a step could draw from: Python, numpy, torch CPU, each CUDA device, and MPS."""

    def state_dict(self) -> dict[str, Any]:
        cuda = (
            torch.cuda.get_rng_state_all()
            if torch.cuda.is_available() and torch.cuda.is_initialized()
            else []
        )
        return {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "cuda": cuda,
            "mps": torch.mps.get_rng_state() if mps_available() else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if state.get("mps") is not None and mps_available():
            torch.mps.set_rng_state(state["mps"])
        if state["cuda"] and torch.cuda.is_available():
            if len(state["cuda"]) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(state["cuda"])
            else:
                log.warning(
                    "checkpoint holds RNG states of %d CUDA devices, this process sees %d: CUDA RNG not "
                    "restored",
                    len(state["cuda"]),
                    torch.cuda.device_count(),
                )


@dataclass
class TrainState:
    """Where the run is: the last optimizer step taken, the training seconds so far (evaluation excluded)
    and the last held-out loss. Tokens and samples follow from the step and the global batch."""

    tokens_per_step: int
    samples_per_step: int
    step: int = 0
    train_time: float = 0.0
    eval_loss: float = math.nan

    @property
    def tokens(self) -> int:
        return self.step * self.tokens_per_step

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "tokens": self.tokens,
            "next_sample": self.step * self.samples_per_step,  # the global sample the next step starts at
            "train_time": self.train_time,
            "eval_loss": self.eval_loss,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.train_time, self.eval_loss = (
            int(state["step"]),
            state["train_time"],
            state["eval_loss"],
        )
