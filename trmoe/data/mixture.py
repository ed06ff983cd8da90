"""data=mixture: a weighted blend of several sources (trmoe.data.build builds them and the blend).

The assignment of training samples to sources is a pure function of (weights, ramp, B, seed, step), with
B = the global batch in samples (critical on resume, so fixed for a run):

- Step s holds q_i(s) samples of source i, Σ q_i(s) = B. The cumulative counts C_i(s) = Σ_{s'≤s} q_i(s')
  follow the ideal T_i(s) = Σ_{s'≤s} B · w_i(s') as closely as whole samples allow: C_i(s) is the largest-
  remainder rounding of T_i(s) to s·B, never below C_i(s-1) (`_cumulative`). So |C_i(s) − T_i(s)| < 1
  for constant weights at every step: the proportions are exact, not sampled.
- Within the step, the B slots (q_i of source i) are shuffled by numpy Generator(PCG64([seed, SALT, s])).
- The k-th sample the mixture takes from source i is sample k of that source's own order (its seeded window
  permutation, or its stream): sample g = (s−1)·B + j reads source i = slots(s)[j], at index
  C_i(s−1) + (slots of source i before j in step s).

Every rank computes the same counts and slots, so which tokens a step sees depends on the config and the
step only, for any world size. A source that runs out wraps around as it does alone (a new shuffled epoch,
or the stream's next pass): its epochs over the run are C_i(steps) / its windows, recorded in
run_config.json (data.plan).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import torch

from trmoe.errors import UserError

SALT = 0x6D6978  # "mix": the slot shuffle's stream is not the sources' own window permutations


@dataclasses.dataclass(frozen=True)
class Weights:
    """Per-step source weights: `start` until `ramp_start`, linear to `final` at `ramp_end`, then `final`."""

    start: tuple[float, ...]
    final: tuple[float, ...]
    ramp_start: int | None = None
    ramp_end: int | None = None

    def at(self, step: int) -> list[float]:
        """Normalised weights of optimizer step `step` (1-based)."""
        if self.ramp_start is None or step <= self.ramp_start:
            raw = self.start
        elif step >= self.ramp_end:
            raw = self.final
        else:
            a = (step - self.ramp_start) / (self.ramp_end - self.ramp_start)
            raw = tuple(w + a * (f - w) for w, f in zip(self.start, self.final, strict=True))
        total = sum(raw)
        return [w / total for w in raw]


class MixtureSchedule:
    """Samples per source per step (`counts`) and the order of the step's samples (`slots`)."""

    def __init__(self, weights: Weights, samples_per_step: int, seed: int):
        self.weights, self.B, self.seed = weights, int(samples_per_step), int(seed)
        self.S = len(weights.start)
        self._counts = [[0] * self.S]  # C(s) for s = 0, 1, ... as far as asked
        self._ideal = [0.0] * self.S
        self._slots: dict[int, np.ndarray] = {}

    def _cumulative(self, step: int) -> None:
        while len(self._counts) <= step:
            s = len(self._counts)
            prev = self._counts[-1]
            for i, w in enumerate(self.weights.at(s)):
                self._ideal[i] += self.B * w
            ideal = self._ideal
            f = [max(math.floor(ideal[i]), prev[i]) for i in range(self.S)]
            short = s * self.B - sum(f)
            while short > 0:  # the largest remainders get one more (ties: the first source)
                i = max(range(self.S), key=lambda k: (ideal[k] - f[k], -k))
                f[i] += 1
                short -= 1
            while short < 0:  # sources held at C(s-1) took too many: the furthest ahead gives one back
                i = min((k for k in range(self.S) if f[k] > prev[k]), key=lambda k: (ideal[k] - f[k], k))
                f[i] -= 1
                short += 1
            self._counts.append(f)

    def counts(self, step: int) -> list[int]:
        """C(step): samples of each source in steps 1..step (C(0) = 0)."""
        self._cumulative(step)
        return list(self._counts[step])

    def quota(self, step: int) -> list[int]:
        before, after = self.counts(step - 1), self.counts(step)
        return [a - b for a, b in zip(after, before, strict=True)]

    def slots(self, step: int) -> np.ndarray:
        """The source of each of step `step`'s B samples, in global sample order."""
        slots = self._slots.get(step)
        if slots is None:
            ordered = np.repeat(np.arange(self.S), self.quota(step))
            slots = np.random.Generator(np.random.PCG64([self.seed, SALT, step])).permutation(ordered)
            if len(self._slots) >= 4:
                self._slots.pop(next(iter(self._slots)))
            self._slots[step] = slots
        return slots

    def locate(self, sample: int) -> tuple[int, int]:
        """Global sample index -> (source, that source's sample index)."""
        step, j = divmod(int(sample), self.B)
        slots = self.slots(step + 1)
        i = int(slots[j])
        return i, self.counts(step)[i] + int(np.count_nonzero(slots[:j] == i))


class MixtureWindows:
    """The mixture's training samples: `batch(first, count)` reads each source's share with one batch call
    per source per step touched, in that source's own index order (forward only, for streamed sources)."""

    def __init__(self, names: list[str], sources: list, schedule: MixtureSchedule):
        self.names, self.sources, self.schedule = names, sources, schedule
        self.num_windows = None  # unbounded: every source wraps around
        self._next_sample = 0

    def batch(self, first_sample: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        first_sample, count = int(first_sample), int(count)
        if first_sample < 0 or count < 0:
            raise ValueError(f"first_sample and count must be >= 0, got {first_sample}, {count}")
        B = self.schedule.B
        inputs: list[torch.Tensor | None] = [None] * count
        targets: list[torch.Tensor | None] = [None] * count
        g, end = first_sample, first_sample + count
        while g < end:
            step, j0 = divmod(g, B)
            j1 = min(B, j0 + end - g)
            slots = self.schedule.slots(step + 1)
            before = self.schedule.counts(step)
            part = slots[j0:j1]
            for i in range(self.schedule.S):
                rows = np.flatnonzero(part == i)
                if rows.size == 0:
                    continue
                local = before[i] + int(np.count_nonzero(slots[:j0] == i))
                x, y = self.sources[i].batch(local, int(rows.size))
                for r, row in enumerate(rows):
                    inputs[g - first_sample + int(row)] = x[r]
                    targets[g - first_sample + int(row)] = y[r]
            g += j1 - j0
        self._next_sample = end
        if count == 0:
            empty = torch.empty((0, 0), dtype=torch.int64)
            return empty, empty.clone()
        return torch.stack(inputs), torch.stack(targets)  # type: ignore[arg-type]

    def read_counts(self) -> dict[str, int]:
        """Samples of each source in global samples [0, next sample) (the cursor's record)."""
        B = self.schedule.B
        step, j = divmod(self._next_sample, B)
        counts = self.schedule.counts(step)
        if j:
            slots = self.schedule.slots(step + 1)[:j]
            counts = [c + int(np.count_nonzero(slots == i)) for i, c in enumerate(counts)]
        return dict(zip(self.names, counts, strict=True))

    def state_dict(self) -> dict[str, Any]:
        return {
            "next_sample": self._next_sample,
            "samples_read": self.read_counts(),  # a function of next_sample: checked on load
            "sources": {
                name: src.state_dict() if hasattr(src, "state_dict") else None
                for name, src in zip(self.names, self.sources, strict=True)
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            next_sample, read, cursors = int(state["next_sample"]), state["samples_read"], state["sources"]
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"data cursor: malformed mixture state ({exc!r})") from None
        if sorted(cursors) != sorted(self.names):
            raise UserError(
                f"data cursor: the checkpoint's mixture has sources {sorted(cursors)}, this run {self.names}"
            )
        self._next_sample = next_sample
        if self.read_counts() != read:
            raise UserError(
                f"data cursor: at sample {next_sample} the checkpoint had read {read} samples per source, "
                f"this mixture assigns {self.read_counts()}; resume needs the same mixture"
            )
        for name, src in zip(self.names, self.sources, strict=True):
            if cursors[name] is not None and hasattr(src, "load_state_dict"):
                src.load_state_dict(cursors[name])

    def close(self) -> None:
        for src in self.sources:
            if hasattr(src, "close"):
                src.close()
