"""When a periodic job is due: at given steps and every N steps. One rule for everything a run does on a
cadence: the metrics rows, the held-out and downstream evaluations, telemetry's gradient norms and the
checkpoints. Each component owns its Cadence and asks it (`store.maybe_save(step)`, `evaluator.due(step)`)."""

from __future__ import annotations

from collections.abc import Iterable


class Cadence:
    """Due at the steps in `at` and at every multiple of `every` (0: never periodically), step 0 included.
    `a | b` is due whenever `a` or `b` is."""

    def __init__(self, every: int | Iterable[int] = 0, at: Iterable[int] = ()):
        periods = (every,) if isinstance(every, int) else tuple(every)
        self.every = tuple(sorted({n for n in periods if n > 0}))
        self.at = frozenset(at)

    def due(self, step: int) -> bool:
        return step in self.at or any(step % n == 0 for n in self.every)

    def __or__(self, other: Cadence) -> Cadence:
        return Cadence(self.every + other.every, self.at | other.at)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Cadence) and (self.every, self.at) == (other.every, other.at)

    def __hash__(self) -> int:
        return hash((self.every, self.at))

    def __repr__(self) -> str:
        return f"Cadence(every={list(self.every)}, at={sorted(self.at)})"


NEVER = Cadence()
