"""routing=demo_stride: a route table from outside trmoe.

    r_0(t) = (7 t + salt) mod E,   r_k(t) = (r_0(t) + k) mod E

A route table is a pure function of the layer's TableArgs (vocab, experts, top_k, layer, seed, salt, ...):
trmoe builds it once per layer, checks it ([K, V] integers in [0, E), a token's K routes distinct), stores it
in every checkpoint, and dispatches by it like any built-in table.
"""

from __future__ import annotations

import numpy as np

from trmoe.model.routing import Strategy, TableArgs


def _table(a: TableArgs) -> np.ndarray:
    r0 = (7 * np.arange(a.vocab, dtype=np.int64) + a.salt) % a.experts
    return (r0[None, :] + np.arange(a.top_k)[:, None]) % a.experts


STRATEGY = Strategy(
    _table,
    balance="exact when E is prime to 7 (differ by <= 1)",
    layers="labels only (a shift per layer)",
    tuples="4",
    origin="trmoe-demo-plugins",
)
