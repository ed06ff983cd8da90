"""Checkpoints: checkpoints/step_XXXXXXXX.pt, written to a temporary name, fsynced, then renamed; a
`latest` pointer is updated last."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any]) -> Path:
    directory = checkpoint_dir(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step_{step:08d}.pt"
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    pointer = directory / "latest.tmp"
    pointer.write_text(path.name + "\n")
    os.replace(pointer, directory / "latest")
    return path


def load_checkpoint(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    if path.is_dir():
        path = path / (path / "latest").read_text().strip()
    return torch.load(path, map_location=map_location, weights_only=False)
