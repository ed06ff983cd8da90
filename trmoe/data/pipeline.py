"""The data component the train loop sees: train batches by global sample index, fixed evaluation sets, the
bits-per-byte denominator, and the data cursor for checkpoints.

Sample g of the training order is a pure function of g for every source but the streamed one (data=fineweb),
whose reader also keeps a cursor (`state_dict` / `load_state_dict`). Optimizer step s reads the global samples
[(s-1)·B, s·B), B = micro_batch·grad_accum·world_size; rank r reads the contiguous block starting at
(s-1)·B + r·micro_batch·grad_accum (`micro_batch_samples`). The samples a run reads therefore depend on the
global batch only: a resume, also with another number of ranks at the same global batch, reads exactly the
samples the uninterrupted run would have read.

trmoe.data.build makes a DataPipeline from a run's config (one builder per data source).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from trmoe.data.evalsets import bits_per_byte, scored_tokens
from trmoe.data.sampler import WindowSampler
from trmoe.errors import UserError, differences

Batch = tuple[torch.Tensor, torch.Tensor]

STATE_VERSION = 1


class Source(Protocol):
    def batch(self, first_sample: int, count: int) -> Batch: ...


def micro_batch_samples(
    step: int, rank: int, world_size: int, micro_batch: int, grad_accum: int
) -> list[tuple[int, int]]:
    """(first global sample index, count) of each micro-batch that `rank` reads at optimizer step `step`
    (1-based). It takes the numbers, not the config: trmoe/data does not read the config (the callers pass
    trainer.micro_batch and grad_accum; the batch sizes themselves are trmoe.config.derived's)."""
    per_rank = micro_batch * grad_accum
    first = (step - 1) * per_rank * world_size + rank * per_rank
    return [(first + a * micro_batch, micro_batch) for a in range(grad_accum)]


@dataclass
class DataPipeline:
    train: Source  # sample g of the global training order, for any g (exact resume)
    eval_set: list[Batch]  # the same held-out batches at every evaluation
    info: dict  # recorded in run_config.json
    eval_train_set: list[Batch] = field(default_factory=list)  # fixed batches of the training split
    eval_bytes: int | None = None  # UTF-8 bytes of the text the held-out targets encode; None = no bpb
    streams: dict = field(default_factory=dict)  # metrics.csv figure -> the stream it is computed on
    fingerprint: str = ""  # identity of the data, checked when a data cursor is loaded
    sources: dict[str, DataPipeline] = field(default_factory=dict)  # data=mixture: each source's own data
    identity: dict[str, Any] = field(default_factory=dict)  # what the fingerprint is made of, by name

    def bpb(self, eval_loss: float) -> float:
        """Bits per UTF-8 byte of the held-out loss (NaN when the ids are not o200k text)."""
        return bits_per_byte(eval_loss, scored_tokens(self.eval_set), self.eval_bytes)

    def state_dict(self) -> dict[str, Any]:
        """The data position for a checkpoint (JSON-serialisable). Sources indexed by global sample need
        nothing beyond the step (samples read = step x global batch); the stream adds its cursor."""
        stream = self.train.state_dict() if hasattr(self.train, "state_dict") else None
        return {
            "version": STATE_VERSION,
            "source": self.info.get("source"),
            "fingerprint": self.fingerprint,
            "identity": self.identity,  # a later mismatch names the keys that differ, with both values
            "stream": stream,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise UserError(f"data cursor: unknown format; this trmoe reads version {STATE_VERSION}")
        if state.get("source") != self.info.get("source") or state.get("fingerprint") != self.fingerprint:
            raise UserError(f"data cursor: {self._difference(state)}; resume needs the same data")
        if state.get("stream") is not None:
            self.train.load_state_dict(state["stream"])

    def _difference(self, state: dict[str, Any]) -> str:
        """What differs between a checkpoint's data and this run's: the named parts of the identity with both
        values (at most four, then a count), or, for a cursor saved before they were recorded, the sources
        and fingerprints."""
        was, now = state.get("identity"), self.identity
        if state.get("source") == self.info.get("source") and isinstance(was, dict) and was and now:
            named = differences(was, now, "the checkpoint's")
            if named:
                return named
        return (
            f"the checkpoint read {state.get('source')!r} ({state.get('fingerprint')}); "
            f"this run reads {self.info.get('source')!r} ({self.fingerprint})"
        )

    def close(self) -> None:
        """Stop background readers (data=fineweb)."""
        if hasattr(self.train, "close"):
            self.train.close()


class ShardWindows(WindowSampler):
    """WindowSampler over a memory-mapped shard that refuses ids outside the model's vocab (a cheap
    vectorized check per batch: a shard whose index lies would otherwise crash inside the embedding)."""

    def __init__(
        self, tokens: np.ndarray, seq_len: int, order: str, seed: int, *, name: str, vocab_size: int
    ):
        super().__init__(tokens, seq_len, order, seed, name=name)
        self.vocab_size = vocab_size

    def batch(self, first_sample: int, count: int) -> Batch:
        inputs, targets = super().batch(first_sample, count)
        if count and int(torch.maximum(inputs.max(), targets.max())) >= self.vocab_size:
            raise UserError(
                f"{self.name}: holds a token id >= model.vocab_size={self.vocab_size} in samples "
                f"{first_sample}..{first_sample + count - 1}; run `python -m trmoe.data.prepare verify`"
            )
        return inputs, targets


class PinnedSource:
    """Batches copied into page-locked host memory, so `.to(cuda, non_blocking=True)` is asynchronous."""

    def __init__(self, inner: Source):
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def batch(self, first_sample: int, count: int) -> Batch:
        inputs, targets = self.inner.batch(first_sample, count)
        return inputs.pin_memory(), targets.pin_memory()
