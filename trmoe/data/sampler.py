"""Exact, resumable batch sampling by global sample index.

A sample is a window of seq_len + 1 tokens (inputs = window[:-1], targets = window[1:]). Window j covers
tokens [j * seq_len, j * seq_len + seq_len], so W = (N - 1) // seq_len windows fit in N tokens. Sample g is
a pure function of (tokens, seq_len, order, seed, g): any run can resume from any sample index and read
exactly the batches it would have read without stopping.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from trmoe.errors import UserError

ORDERS = ("sequential", "shuffled")


class WindowSampler:
    """Windows of a token array, sequential (sample % W) or shuffled (a fresh permutation of all windows per
    epoch, drawn from numpy Generator(PCG64([seed, epoch])); every window is used exactly once per epoch)."""

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        order: str = "shuffled",
        seed: int = 0,
        *,
        name: str = "tokens",
    ):
        tokens = np.asarray(tokens)
        if tokens.ndim != 1:
            raise UserError(f"{name}: token array must be 1-D, got shape {tuple(tokens.shape)}")
        if int(seq_len) < 1:
            raise UserError(f"{name}: seq_len must be >= 1, got {seq_len}")
        if order not in ORDERS:
            raise UserError(f"{name}: sample order must be one of {', '.join(ORDERS)}, got {order!r}")
        if int(seed) < 0:
            raise UserError(f"{name}: sampler seed must be >= 0, got {seed}")
        self.tokens = tokens
        self.seq_len = int(seq_len)
        self.order = order
        self.seed = int(seed)
        self.name = name
        self.num_windows = (tokens.shape[0] - 1) // self.seq_len if tokens.shape[0] > 0 else 0
        if self.num_windows == 0:
            raise UserError(
                f"{name}: {tokens.shape[0]} tokens is too few for one window of seq_len+1 = "
                f"{self.seq_len + 1} tokens; use a shorter seq_len or more text"
            )
        self._offsets = np.arange(self.seq_len + 1, dtype=np.int64)
        self._perms: dict[int, np.ndarray] = {}  # the most recent epochs' permutations (at most 2)

    def _permutation(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
            perm = rng.permutation(self.num_windows)
            if len(self._perms) >= 2:
                self._perms.pop(next(iter(self._perms)))
            self._perms[epoch] = perm
        return perm

    def window_index(self, sample: int) -> int:
        """Global sample index -> window index."""
        sample = int(sample)
        if sample < 0:
            raise ValueError(f"sample index must be >= 0, got {sample}")
        if self.order == "sequential":
            return sample % self.num_windows
        epoch, within = divmod(sample, self.num_windows)
        return int(self._permutation(epoch)[within])

    def _window_indices(self, first_sample: int, count: int) -> np.ndarray:
        samples = np.arange(first_sample, first_sample + count, dtype=np.int64)
        within = samples % self.num_windows
        if self.order == "sequential":
            return within
        epochs = samples // self.num_windows
        windows = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            windows[mask] = self._permutation(int(epoch))[within[mask]]
        return windows

    def batch(self, first_sample: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples first_sample .. first_sample+count-1 as (inputs, targets): int64 [count, seq_len]."""
        first_sample, count = int(first_sample), int(count)
        if first_sample < 0 or count < 0:
            raise ValueError(f"first_sample and count must be >= 0, got {first_sample}, {count}")
        starts = self._window_indices(first_sample, count) * self.seq_len
        windows = self.tokens[starts[:, None] + self._offsets].astype(np.int64)
        windows_t = torch.from_numpy(windows)
        return windows_t[:, :-1].contiguous(), windows_t[:, 1:].contiguous()


def _sample_seed(seed: int, sample: int) -> int:
    digest = hashlib.blake2b(f"trmoe-random:{seed}:{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # 63 bits: valid for torch.Generator.manual_seed


class RandomTokens:
    """Uniform random token ids for smoke tests: sample g is drawn from a torch.Generator seeded with a hash
    of (seed, g), so any sample index can be regenerated independently (exact resume)."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        if int(vocab_size) < 1:
            raise UserError(f"random tokens: vocab_size must be >= 1, got {vocab_size}")
        if int(seq_len) < 1:
            raise UserError(f"random tokens: seq_len must be >= 1, got {seq_len}")
        self.vocab_size = int(vocab_size)
        self.seq_len = int(seq_len)
        self.seed = int(seed)
        self.num_windows = None  # unbounded: every sample index is a fresh window

    def sample(self, index: int) -> torch.Tensor:
        """The seq_len + 1 token window of sample `index`."""
        generator = torch.Generator().manual_seed(_sample_seed(self.seed, int(index)))
        return torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=generator, dtype=torch.int64)

    def batch(self, first_sample: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        first_sample, count = int(first_sample), int(count)
        if first_sample < 0 or count < 0:
            raise ValueError(f"first_sample and count must be >= 0, got {first_sample}, {count}")
        if count == 0:
            empty = torch.empty((0, self.seq_len), dtype=torch.int64)
            return empty, empty.clone()
        windows = torch.stack([self.sample(g) for g in range(first_sample, first_sample + count)])
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def eval_batches(sampler, batch_size: int, num_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed evaluation set: samples 0, 1, ... of `sampler` (build it with order="sequential" on the
    eval split), the same batches every evaluation. If the split has fewer windows than
    batch_size * num_batches, as many full batches as fit; if not even one full batch fits, a single batch of
    all windows."""
    if int(batch_size) < 1 or int(num_batches) < 1:
        raise UserError(
            f"eval batches: batch_size and num_batches must be >= 1, got {batch_size}, {num_batches}"
        )
    batch_size, num_batches = int(batch_size), int(num_batches)
    windows = getattr(sampler, "num_windows", None)
    if windows is None:
        sizes = [batch_size] * num_batches
    elif windows < 1:
        raise UserError(
            f"eval batches: the eval split has no windows of {getattr(sampler, 'seq_len', '?')} tokens"
        )
    elif windows >= batch_size:
        sizes = [batch_size] * min(num_batches, windows // batch_size)
    else:
        sizes = [windows]
    out = []
    first = 0
    for size in sizes:
        out.append(sampler.batch(first, size))
        first += size
    return out
