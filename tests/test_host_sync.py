"""The training loop reads device values on the host (.item(), .tolist(), float(), int(), bool()) only at
log steps: the number of such reads does not grow with the number of unlogged steps. The fault guards are
the documented exception (one read per step while any guard is on)."""

from __future__ import annotations

import pytest
import torch
from helpers import compose_config
from presets import HOST_SYNC_RUN as FAST

from trmoe.train.loop import train

GUARDS_OFF = ["guard.skip_nonfinite=false", "guard.spike_factor=0"]
READS = ("item", "tolist", "__float__", "__int__", "__bool__")


def _host_reads(monkeypatch, tmp_path, steps: int, *overrides: str) -> int:
    calls = {"n": 0}
    for name in READS:
        real = getattr(torch.Tensor, name)

        def counted(self, *args, _real=real, **kwargs):
            calls["n"] += 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    try:
        train(compose_config(*FAST, f"trainer.steps={steps}", *overrides), tmp_path / f"run_{steps}")
    finally:
        monkeypatch.undo()
    return calls["n"]


@pytest.mark.parametrize(
    ("overrides", "per_step"), [(GUARDS_OFF, 0), ([], 1)], ids=["guards_off", "guards_on"]
)
def test_host_reads_do_not_grow_with_unlogged_steps(monkeypatch, tmp_path, overrides, per_step):
    short = _host_reads(monkeypatch, tmp_path, 4, *overrides)
    long = _host_reads(monkeypatch, tmp_path, 10, *overrides)
    assert short > 0  # the logged steps do read (the counter works)
    assert long - short == per_step * (10 - 4)
