"""The registry of a checkpoint's components (trmoe.train.state.Components): a checkpoint's rank-local state
keeps the layout of the checkpoints written before it (docs/architecture.md), so they still load."""

from __future__ import annotations

import pytest
from helpers import compose_config
from presets import FAST_CPU

from trmoe.run.checkpoint import CheckpointError, load_checkpoint
from trmoe.train.loop import train
from trmoe.train.state import Components

FAST = [*FAST_CPU, "trainer.micro_batch=2"]

# rank_XXXXX.pt as trmoe wrote it before the registry (version 1), key by key, in order
LAYOUT = [
    "version",
    "step",
    "tokens",
    "next_sample",
    "train_time",
    "eval_loss",
    "data",
    "rng",
    "window",
    "window_totals",
    "telemetry",
    "guard",
]


@pytest.mark.parametrize("telemetry", ["false", "true"])
def test_a_checkpoints_train_state_keeps_its_layout(tmp_path, telemetry):
    train(compose_config(*FAST, "trainer.steps=2", f"telemetry.moe={telemetry}"), tmp_path / "r")
    state = load_checkpoint(tmp_path / "r")["train_state"]
    assert list(state) == LAYOUT
    assert state["version"] == 1 and state["step"] == 2
    assert set(state["rng"]) == {"python", "numpy", "torch", "cuda", "mps"}
    assert (state["telemetry"] is None) == (telemetry == "false")


class Part:
    def __init__(self, name: str, log: list[str], value: dict):
        self.name, self.log, self.value, self.loaded = name, log, value, None

    def state_dict(self) -> dict:
        return dict(self.value)

    def load_state_dict(self, state: dict) -> None:
        self.log.append(self.name)
        self.loaded = state


def test_components_save_in_order_flatten_and_load_the_last_ones_last():
    log: list[str] = []
    parts = {n: Part(n, log, {f"{n}_x": 1}) for n in ("a", "b", "rng", "c")}
    reg = Components(version=3)
    reg.register("a", parts["a"], flat=True)
    reg.register("b", parts["b"])
    reg.register("rng", parts["rng"], last=True)
    reg.register("off", None)
    reg.register("c", parts["c"])
    state = reg.state_dict()
    assert list(state.items()) == [
        ("version", 3),
        ("a_x", 1),
        ("b", {"b_x": 1}),
        ("rng", {"rng_x": 1}),
        ("off", None),
        ("c", {"c_x": 1}),
    ]
    reg.load_state_dict(state, skip=("b",))
    assert log == ["a", "c", "rng"]  # b skipped, the RNG last
    assert parts["a"].loaded is state and parts["c"].loaded == {"c_x": 1}
    log.clear()
    reg.load_state_dict({"version": 3, "a_x": 2, "c": None})  # an older checkpoint: no b, c None
    assert log == ["a"]
    with pytest.raises(CheckpointError, match="train state version 2; this trmoe reads 3"):
        reg.load_state_dict({**state, "version": 2})
    with pytest.raises(ValueError, match="registered already"):
        reg.register("a", parts["a"])
