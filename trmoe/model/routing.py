"""Fixed token-id routing for TR-Hash MoE layers.

Every token is sent to ``K`` of ``E`` routed experts by a fixed function of its token id; there is
no learned router. Per layer a *route table* ``table[k, t]`` holds the ``k``-th expert of token id
``t`` (``k = 0`` is the primary route). The ``K`` experts of a token are always distinct. A table is
a pure function of ``(strategy, vocab_size, num_experts, top_k, layer, seed, hash_count)``: all
randomness comes from ``mix32`` (a 32-bit integer finalizer) and from
``numpy.random.Generator(PCG64(...))`` seeded by a per-layer salt, never from global RNG state.

Notation: ``V`` vocabulary size, ``E`` experts, ``K`` routes per token, ``t`` token id,
``salt = mix32(mix32(seed) ^ (layer * 0x9E3779B1 mod 2^32))`` and ``units`` the integers in
``[1, E)`` coprime with ``E`` (``[0]`` for ``E = 1``).

Strategies:

* ``modulo_cyclic``: ``pi`` a per-layer permutation of the expert labels;
  ``r_0(t) = pi[t mod E]``, ``r_k(t) = (r_0(t) + k) mod E``. The token partition is the same in
  every layer, only the labels change. Counts per expert per slot differ by at most 1.
* ``contiguous_blocks``: ``pi`` a per-layer permutation of the expert labels;
  ``r_0(t) = pi[floor(t * E / V)]``, ``r_k(t) = (r_0(t) + k) mod E``: E contiguous blocks of ids (a locality
  control: neighbouring ids share their experts). Counts per expert per slot differ by at most 1.
* ``random``: each token draws an independent, uniformly random ordered K-subset of the experts
  (the K smallest of E uniform keys, in order). Balance is statistical only.
* ``balanced_hash``: a per-layer random permutation of the token ids gives each token a rank
  ``rho``; block ``g = rho // E``, position ``q = rho % E``; a per-block stride
  ``s = units[mix32(g ^ salt) mod len(units)]``; ``pi'`` a per-layer label permutation;
  ``r_k(t) = pi'[(q + k*s) mod E]``. Every slot is exactly balanced in each full block of E ranks
  (counts per expert per slot differ by at most 1) and the partition changes per layer.
* ``affine_hash``: ``base = mix32(t ^ salt) mod E``,
  ``stride = units[mix32(t + (salt ^ 0x85EBCA77)) mod len(units)]``,
  ``r_k(t) = (base + k*stride) mod E``. Balance is statistical only.
* ``multi_hash``: rendezvous voting by ``H = hash_count`` hash functions. With
  ``salt_h = salt + h*0x85EBCA77`` (mod 2^32),
  ``score(t, e) = sum_{h<H} mix32(t ^ mix32(e + (salt_h ^ 0xC2B2AE3D)) ^ salt_h)`` (a 64-bit sum);
  the routes are the K experts of largest score, in descending order, ties to the lower expert id.
  Balance is statistical only.

* ``clustered_hash`` / ``dispersed_hash``: ``c(t)`` the k-means cluster of token t's embedding
  (trmoe/model/embedding_routing.py), ``rho`` the rank of t when the ids are sorted by ``(c(t), t)``;
  ``g = floor(rho * E / V)`` (clustered: a cluster's ids are contiguous, so they share an expert) or
  ``g = rho mod E`` (dispersed: a cluster's ids are dealt round the experts); ``pi`` a per-layer label
  permutation; ``r_k(t) = pi[(g + k) mod E]``. Exactly balanced in ids (counts differ by at most 1).

The old runner's constructions, each split into its draws and a pure construction from them (so the tests
can feed the runner's torch draws and compare with its tables): ``random_shared`` (one draw shared by every
layer, labels per layer), ``balanced_hash_all_tuples`` (all E!/(E-K)! ordered tuples dealt over a random
order of the ids), ``balanced_secondary`` and ``frequency_balanced_secondary`` (a modulo primary and
secondaries chosen greedily to balance id counts, or token occurrences). ``learned`` has no table (the
router is in trmoe/model/moe.py), nor have ``bigram_hash``, ``prev_token_hash``, ``position_hash`` and
``oracle_future_hash``: they hash another key of each position on the fly
(trmoe/model/context_routing.py). The router strategies route on the hidden state: ``learned`` trains its
``W_r`` [E, H]; ``frozen_router`` keeps ``W_r`` at its init (drawn as ``learned``'s is), never updated;
``rerandomised_router`` draws a fresh ``W_r ~ N(0, init_std^2)`` before every optimizer step from a
``torch.Generator`` seeded by ``router_step_seed(seed, layer, step) = mix32(salt ^ mix32(step))``, so a
resumed run draws the same routers; ``learned_v3`` (DeepSeek-V3's router, arXiv 2412.19437 §2.1.2) trains
``W_r`` with sigmoid scores ``s = sigmoid(x W_r^T)``, picks the top K of ``s + b`` with ``b`` [E] a bias
nudged toward balance after every optimizer step (``b_e <- b_e + gamma * sign(mean load - load_e)``, no
gradient), and weights the selected ``s`` normalised over the K (the formulas: trmoe/model/moe.py).
Every strategy with fixed routes (a table or a hashed key) may learn its combine weights instead of ``p``
(``routing.combine=learned``, DeepSeek-V4's hash layers): ``w_k = g_{r_k} / sum_j g_{r_j}`` with
``g = sqrt(softplus(x W_g^T))``, ``W_g`` [E, H] a gate per layer; the routes stay the table's.
``distilled`` (Grouter, arXiv 2603.06626, 2026) is a table too, but not a function of the sizes and the
seed: it is counted from a trained router's choices over training tokens (the formula:
trmoe/model/distill.py) and handed to ``build_route_table`` as ``routes``; until a run sets it the model
holds the table of ``balanced_hash`` (the rule for token ids the pass never saw).
``dense`` routes nothing: a layer of it (inside ``routing.layers``; DeepSeek's ``first_k_dense_replace``)
has no routed experts, its FFN is the shared SwiGLU widened to the routed layer's active width
``shared_width + K * expert_width`` (trmoe/model/moe.py). ``REGISTRY`` is the one list of strategies: the
config schema, its validation and docs/routing.md read it.

Balance bounds (max/mean and min/mean of the per-expert counts of every route slot, and of all
slots summed, at ``V = 200,019``, ``E = 4``, ``K = 2``, layers 0..3, checked by the tests):
``modulo_cyclic`` and ``balanced_hash`` are within ``1 +- 1e-4`` (exact up to one token);
``random``, ``affine_hash`` and ``multi_hash`` are within ``1 +- 0.03``.

Over 400 lines on purpose: every routing strategy's table construction is here with its formula,
because the config schema, its validation and docs/routing.md all read the one registry; a strategy split
from its neighbours would hide what the strategies share (salts, units, the balanced assignment).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from trmoe.errors import UserError
from trmoe.registry import Registry

if TYPE_CHECKING:
    import torch

# torch is imported inside the functions that take or make tensors: the config layer reads the registry
# (its schema, validation and ModelSpec) without loading torch.

__all__ = [
    "ALL_STRATEGIES",
    "REGISTRY",
    "STRATEGIES",
    "balance_stats",
    "build_route_table",
    "draw_router",
    "foreign_router_state",
    "layer_salt",
    "mix32",
    "router_step_seed",
    "route_counts",
]

MAX_EXPERTS = 32768  # expert ids must fit the int16 table dtype
MAX_HASH_COUNT = 8

_M32 = 0xFFFFFFFF
_C1 = 0x7FEB352D
_C2 = 0x846CA68B
_GOLDEN = 0x9E3779B1
_STRIDE_SALT = 0x85EBCA77
_EXPERT_SALT = 0xC2B2AE3D
_SHARED_SALT = 0xA61A710  # random_shared: the salt of its one layer-independent draw
# Elements of a [rows, E] work matrix processed at once (cache-sized; results never depend on it).
_CHUNK_ELEMENTS = 1 << 16
# Up to this K, the K smallest keys are found by repeated argmin instead of a partition.
_ARGMIN_MAX_K = 4


def mix32(x: Any) -> Any:
    """32-bit mixing finalizer (mod 2^32): ``x ^= x>>16; x *= 0x7FEB352D; x ^= x>>15;
    x *= 0x846CA68B; x ^= x>>16``. A Python int gives a Python int; an array gives a uint32 array."""
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        v = int(x) & _M32
        v ^= v >> 16
        v = (v * _C1) & _M32
        v ^= v >> 15
        v = (v * _C2) & _M32
        v ^= v >> 16
        return v
    a = np.asarray(x)
    if a.dtype != np.uint32:
        if a.dtype.kind not in "iu":
            raise TypeError(f"mix32 expects integers, got dtype {a.dtype}")
        a = (a.astype(np.uint64) & np.uint64(_M32)).astype(np.uint32)
    else:
        a = a.copy()
    return _mix32_inplace(a)


def _mix32_inplace(a: np.ndarray) -> np.ndarray:
    """mix32 of a uint32 array, overwriting it (uint32 array arithmetic wraps modulo 2^32)."""
    a ^= a >> np.uint32(16)
    a *= np.uint32(_C1)
    a ^= a >> np.uint32(15)
    a *= np.uint32(_C2)
    a ^= a >> np.uint32(16)
    return a


def layer_salt(seed: int, layer: int) -> int:
    """Per-layer 32-bit salt: ``mix32(mix32(seed) ^ (layer * 0x9E3779B1 mod 2^32))``.
    The seed is taken modulo 2^32."""
    return mix32(mix32(seed) ^ ((layer * _GOLDEN) & _M32))


def router_step_seed(seed: int, layer: int, step: int) -> int:
    """The seed of ``rerandomised_router``'s draw for (layer, optimizer step): ``mix32(salt ^ mix32(step))``
    with ``salt = layer_salt(seed, layer)``; a pure function of the three, so a resume repeats it."""
    return mix32(layer_salt(seed, layer) ^ mix32(step))


def draw_router(seed: int, layer: int, step: int, experts: int, hidden: int, std: float) -> torch.Tensor:
    """``rerandomised_router``'s router of one step: ``W_r ~ N(0, std^2)`` [E, H] float32 on the CPU, drawn by
    a ``torch.Generator`` seeded with ``router_step_seed(seed, layer, step)`` (never the global generator)."""
    import torch

    gen = torch.Generator().manual_seed(router_step_seed(seed, layer, step))
    return torch.randn(experts, hidden, generator=gen) * std


def _rng(salt: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(salt))


def _units(num_experts: int) -> np.ndarray:
    """Integers in [1, E) coprime with E, ascending; [0] for E = 1."""
    if num_experts == 1:
        return np.zeros(1, dtype=np.int64)
    return np.array([u for u in range(1, num_experts) if math.gcd(u, num_experts) == 1], dtype=np.int64)


def _check_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


def _validate(
    strategy: Any, vocab_size: Any, num_experts: Any, top_k: Any, layer: Any, seed: Any, hash_count: Any
) -> tuple[str, int, int, int, int, int, int]:
    name = getattr(strategy, "value", strategy)  # accept a str Enum such as RoutingStrategy
    if not isinstance(name, str) or name not in REGISTRY:
        raise ValueError(f"unknown routing strategy {strategy!r}; allowed: {', '.join(REGISTRY)}")
    v = _check_int("vocab_size", vocab_size)
    e = _check_int("num_experts", num_experts)
    k = _check_int("top_k", top_k)
    lay = _check_int("layer", layer)
    sd = _check_int("seed", seed)
    h = _check_int("hash_count", hash_count)
    if v < 1:
        raise ValueError(f"vocab_size must be >= 1, got {v}")
    if not 1 <= e <= MAX_EXPERTS:
        raise ValueError(f"num_experts must be in 1..{MAX_EXPERTS}, got {e}")
    if not 1 <= k <= e:
        raise ValueError(f"top_k must be in 1..num_experts (1..{e}), got {k}")
    if lay < 0:
        raise ValueError(f"layer must be >= 0, got {lay}")
    if not 1 <= h <= MAX_HASH_COUNT:
        raise ValueError(f"hash_count must be in 1..{MAX_HASH_COUNT}, got {h}")
    return name, v, e, k, lay, sd, h


def _smallest_k(keys: np.ndarray, top_k: int) -> np.ndarray:
    """Column indices of the ``top_k`` smallest keys of each row, ascending by key; ``keys`` must be
    unique within a row (then the result equals a stable argsort's first ``top_k`` columns).
    ``keys`` may be overwritten."""
    rows, cols = keys.shape
    if top_k == cols:
        return np.argsort(keys, axis=1, kind="stable")
    if top_k <= _ARGMIN_MAX_K:
        out = np.empty((rows, top_k), dtype=np.int64)
        row_ids = np.arange(rows)
        big = np.inf if keys.dtype.kind == "f" else np.iinfo(keys.dtype).max
        for k in range(top_k):
            out[:, k] = np.argmin(keys, axis=1)
            keys[row_ids, out[:, k]] = big
        return out
    idx = np.argpartition(keys, top_k - 1, axis=1)[:, :top_k]
    order = np.argsort(np.take_along_axis(keys, idx, axis=1), axis=1, kind="stable")
    return np.take_along_axis(idx, order, axis=1)


def _modulo_cyclic(vocab: int, experts: int, top_k: int, salt: int) -> np.ndarray:
    pi = _rng(salt).permutation(experts)
    r0 = pi[np.arange(vocab, dtype=np.int64) % experts]
    k = np.arange(top_k, dtype=np.int64)[:, None]
    return (r0[None, :] + k) % experts


def _contiguous_blocks(vocab: int, experts: int, top_k: int, salt: int) -> np.ndarray:
    pi = _rng(salt).permutation(experts)
    r0 = pi[np.arange(vocab, dtype=np.int64) * experts // vocab]
    k = np.arange(top_k, dtype=np.int64)[:, None]
    return (r0[None, :] + k) % experts


def _random(vocab: int, experts: int, top_k: int, salt: int) -> np.ndarray:
    rng = _rng(salt)
    out = np.empty((top_k, vocab), dtype=np.int64)
    rows = max(1, _CHUNK_ELEMENTS // experts)
    for start in range(0, vocab, rows):
        n = min(rows, vocab - start)
        # Successive float64 draws continue one stream, so chunking does not change the result.
        keys = rng.random((n, experts))
        out[:, start : start + n] = _smallest_k(keys, top_k).T
    return out


def _balanced_hash(vocab: int, experts: int, top_k: int, salt: int) -> np.ndarray:
    rng = _rng(salt)
    sigma = rng.permutation(vocab)
    labels = rng.permutation(experts)
    rank = np.empty(vocab, dtype=np.int64)
    rank[sigma] = np.arange(vocab, dtype=np.int64)
    block = rank // experts
    pos = rank % experts
    units = _units(experts)
    num_blocks = (vocab + experts - 1) // experts
    block_hash = mix32(np.arange(num_blocks, dtype=np.uint32) ^ np.uint32(salt)).astype(np.int64)
    stride = units[block_hash % len(units)][block]
    k = np.arange(top_k, dtype=np.int64)[:, None]
    return labels[(pos[None, :] + k * stride[None, :]) % experts]


def _affine_hash(vocab: int, experts: int, top_k: int, salt: int) -> np.ndarray:
    t = np.arange(vocab, dtype=np.uint32)
    base = mix32(t ^ np.uint32(salt)).astype(np.int64) % experts
    units = _units(experts)
    stride = units[mix32(t + np.uint32(salt ^ _STRIDE_SALT)).astype(np.int64) % len(units)]
    k = np.arange(top_k, dtype=np.int64)[:, None]
    return (base[None, :] + k * stride[None, :]) % experts


def _multi_hash(vocab: int, experts: int, top_k: int, salt: int, hash_count: int) -> np.ndarray:
    e = np.arange(experts, dtype=np.uint32)
    salts = [(salt + h * _STRIDE_SALT) & _M32 for h in range(hash_count)]
    # Per hash function, the expert part of the key: mix32(e + (salt_h ^ C)) ^ salt_h, shape [E].
    expert_keys = [mix32(e + np.uint32(s ^ _EXPERT_SALT)) ^ np.uint32(s) for s in salts]
    # score <= top = H * (2^32 - 1), so (top - score) * E + e < 2^64: a unique ascending key that
    # puts the larger score first and, on ties, the lower expert id (the order of a stable sort).
    top = np.uint64(hash_count * _M32)
    e64 = e.astype(np.uint64)[None, :]
    out = np.empty((top_k, vocab), dtype=np.int64)
    rows = max(1, _CHUNK_ELEMENTS // experts)
    for start in range(0, vocab, rows):
        t = np.arange(start, min(start + rows, vocab), dtype=np.uint32)[:, None]
        score = np.zeros((t.shape[0], experts), dtype=np.uint64)
        for ek in expert_keys:
            score += _mix32_inplace(t ^ ek[None, :])
        key = np.subtract(top, score, out=score)
        key *= np.uint64(experts)
        key += e64
        out[:, start : start + t.shape[0]] = _smallest_k(key, top_k).T
    return out


# ------------------------------------------------------------------ the old runner's constructions (2.x)
# Each is split into a draw (trmoe's seeded PCG64, or any other source: the tests feed the old runner's
# torch draws to check the construction against its tables) and a pure construction from the draws.


def greedy_order(weights: np.ndarray) -> np.ndarray:
    """Token ids by weight, largest first, ties in the order of torch's default (unstable) CPU sort: the
    order the old runner's greedy constructions visit tokens in (it is also libstdc++ std::sort's; with all
    weights equal it is not 0, 1, 2, ... and that order is what spreads the count-balanced secondary over
    all E(E-1) pairs)."""
    import torch

    w = torch.from_numpy(np.ascontiguousarray(weights, dtype=np.float64))
    return torch.argsort(w, descending=True).numpy()


def greedy_routes(
    primary: np.ndarray, experts: int, top_k: int, order: np.ndarray, weights: np.ndarray | None
) -> np.ndarray:
    """Routes 1..K-1 chosen greedily to balance load: loads start at 0 for every slot; each token in `order`
    takes, among the experts it does not use yet, the one of least load (ties: the lowest expert id), and
    adds its weight (1 without `weights`) to that load. Returns the [K, V] table with `primary` as row 0."""
    vocab = primary.shape[0]
    table = np.empty((top_k, vocab), dtype=np.int64)
    table[0] = primary
    w = [1] * vocab if weights is None else [int(x) for x in np.maximum(weights, 0)]
    rows = [table[k].tolist() for k in range(top_k)]
    for k in range(1, top_k):
        load = [0] * experts
        out = rows[k]
        earlier = rows[:k]
        for t in order.tolist():
            used = [r[t] for r in earlier]
            best, best_load = -1, None
            for e in range(experts):
                if e not in used and (best_load is None or load[e] < best_load):
                    best, best_load = e, load[e]
            out[t] = best
            load[best] += w[t]
        table[k] = out
    return table


def nth_unused(used: list[np.ndarray], choice: np.ndarray) -> np.ndarray:
    """The choice-th expert (from 0, by increasing id) among those not in `used` (per token)."""
    out = choice.astype(np.int64).copy()
    for u in np.sort(np.stack(used), axis=0):  # ascending: each used id at or below the pick shifts it up
        out += out >= u
    return out


def random_shared_routes(draws: np.ndarray, choices: list[np.ndarray], labels: np.ndarray) -> np.ndarray:
    """The old runner's `random`: r_0 = labels[draws]; r_k = the choices[k-1]-th unused expert. The draws
    are shared by every layer, the labels drawn per layer."""
    rows = [labels[draws]]
    for c in choices:
        rows.append(nth_unused(rows, c))
    return np.stack(rows)


def all_tuples(experts: int, top_k: int) -> np.ndarray:
    """Every ordered K-tuple of distinct experts, lexicographic: [E!/(E-K)!, K]."""
    return np.array(list(itertools.permutations(range(experts), top_k)), dtype=np.int64).reshape(-1, top_k)


def tuple_hash_routes(sigma: np.ndarray, tuple_order: np.ndarray, tuples: np.ndarray) -> np.ndarray:
    """The token at position i of sigma gets tuples[tuple_order[i mod T]] (T tuples)."""
    table = np.empty((tuples.shape[1], sigma.shape[0]), dtype=np.int64)
    table[:, sigma] = tuples[tuple_order[np.arange(sigma.shape[0]) % len(tuple_order)]].T
    return table


def _modulo_primary(args: TableArgs) -> np.ndarray:
    labels = _rng(args.salt).permutation(args.experts)
    return labels[np.arange(args.vocab, dtype=np.int64) % args.experts]


def _balanced_secondary(args: TableArgs) -> np.ndarray:
    order = greedy_order(np.ones(args.vocab))
    return greedy_routes(_modulo_primary(args), args.experts, args.top_k, order, None)


def _frequency_balanced_secondary(args: TableArgs) -> np.ndarray:
    freq = np.maximum(np.asarray(args.frequencies, dtype=np.int64), 0)
    return greedy_routes(_modulo_primary(args), args.experts, args.top_k, greedy_order(freq), freq)


def _random_shared(args: TableArgs) -> np.ndarray:
    rng = _rng(mix32(mix32(args.seed) ^ _SHARED_SALT))  # no layer in it: every layer draws the same
    draws = rng.integers(0, args.experts, args.vocab)
    choices = [rng.integers(0, args.experts - k, args.vocab) for k in range(1, args.top_k)]
    return random_shared_routes(draws, choices, _rng(args.salt).permutation(args.experts))


def _balanced_hash_all_tuples(args: TableArgs) -> np.ndarray:
    rng = _rng(args.salt)
    sigma = rng.permutation(args.vocab)
    tuples = all_tuples(args.experts, args.top_k)
    return tuple_hash_routes(sigma, rng.permutation(len(tuples)), tuples)


def _distilled(args: TableArgs) -> np.ndarray:
    """The layer's table as trmoe/model/distill.py counted it (build_route_table checks it as every table)."""
    if args.routes is None:
        raise ValueError("routing strategy 'distilled' needs its distilled table (routes)")
    return np.asarray(args.routes)


def _embedding_table(args: TableArgs, dispersed: bool) -> np.ndarray:
    from trmoe.model.embedding_routing import clusters

    vocab, experts = args.vocab, args.experts
    cluster = clusters(args.embedding, vocab, experts, args.seed)
    order = np.lexsort((np.arange(vocab), cluster))  # the ids cluster by cluster, ascending within one
    rank = np.empty(vocab, dtype=np.int64)
    rank[order] = np.arange(vocab, dtype=np.int64)
    group = rank % experts if dispersed else rank * experts // vocab
    labels = _rng(args.salt).permutation(experts)
    k = np.arange(args.top_k, dtype=np.int64)[:, None]
    return labels[(group[None, :] + k) % experts]


def tuple_count(experts: int, top_k: int) -> int:
    """E! / (E-K)!: ordered K-tuples of distinct experts."""
    return math.perm(experts, top_k)


# ----------------------------------------------------------------------------------- the registry


@dataclass(frozen=True)
class TableArgs:
    """What a construction may read (every construction reads only its own fields)."""

    vocab: int
    experts: int
    top_k: int
    layer: int
    seed: int
    salt: int
    hash_count: int
    frequencies: np.ndarray | None
    embedding: str | None = None  # clustered/dispersed: the token embedding's source (embedding_routing)
    routes: np.ndarray | None = None  # distilled: this layer's counted table (trmoe/model/distill.py)


@dataclass(frozen=True)
class Strategy:
    """One routing strategy: its construction (None: no table, a learned router or a hashed key) and what
    docs/routing.md tabulates about it."""

    build: Callable[[TableArgs], np.ndarray] | None
    balance: str  # of token ids per expert and slot
    layers: str  # what changes from layer to layer
    tuples: str  # ordered (r_0, r_1) pairs used at E = 4, K = 2
    origin: str  # the old runner's name for the same construction, or what it is new to
    needs_frequencies: bool = False  # reads routing.frequencies (token counts of the training split)
    needs_embedding: bool = False  # reads routing.embedding (a [V, H] token embedding)
    distilled: bool = False  # its table is counted from a parent run's router (routing.distill_from)
    nested_k: bool = True  # the K = 2 table is the first two rows of the K = 4 table
    # what a position routes on (trmoe.model.context_routing.KEY_KINDS): "token" (its input id, through the
    # table), or a key hashed on the fly (no table: build is None); None: a learned router (the hidden state)
    key: str | None = "token"
    analysis_only: bool = False  # routes on what inference does not have (the target): loss forwards only
    router: str = ""  # routers only (key None): "trained", "frozen" or "rerandomised" (see the module doc)
    # routers only: "softmax" (P = softmax(x W_r^T), Switch-style aux + z losses) or "sigmoid_bias"
    # (DeepSeek-V3: sigmoid scores, top-K on scores + a balancing bias, optional sequence-wise loss)
    scoring: str = "softmax"
    # no routed experts at all: the layer's FFN is the shared expert widened to the routed layers' active
    # width (`dense`, a per-layer strategy: routing.layers; trmoe/model/moe.py)
    dense: bool = False

    @property
    def learned(self) -> bool:
        """Routes by a router over the hidden state (trained, frozen or re-randomised)."""
        return self.key is None

    @property
    def fixed_routes(self) -> bool:
        """Routes by a fixed function of a key (a route table or a hashed key): no router, not dense."""
        return self.key is not None and not self.dense

    @property
    def hashed(self) -> bool:
        """Routes hashed on the fly from a route key (trmoe.model.context_routing), no table."""
        return self.key is not None and self.key != "token"

    @property
    def has_table(self) -> bool:
        return self.build is not None


def _hashed(key: str, what: str, analysis_only: bool = False) -> Strategy:
    """A strategy routed on a key hashed per batch (trmoe.model.context_routing): affine_hash's formula."""
    return Strategy(
        None,
        "statistical (of keys)",
        "partition and labels",
        "8",
        f"Roller et al. 2021; routes on {what}",
        key=key,
        analysis_only=analysis_only,
    )


def _from_embedding(dispersed: bool, what: str) -> Strategy:
    """A table built from k-means clusters of routing.embedding (trmoe.model.embedding_routing)."""
    return Strategy(
        lambda a: _embedding_table(a, dispersed=dispersed),
        "exact (differ by <= 1)",
        "labels only (same partition)",
        "4",
        f"Roller et al. 2021: similar tokens (k-means on routing.embedding) {what}",
        needs_embedding=True,
    )


_BUILTIN: dict[str, Strategy] = {
    "modulo_cyclic": Strategy(
        lambda a: _modulo_cyclic(a.vocab, a.experts, a.top_k, a.salt),
        "exact (differ by <= 1)",
        "labels only (same partition)",
        "4",
        "`modulo_cyclic` (its own label permutation)",
    ),
    "random": Strategy(
        lambda a: _random(a.vocab, a.experts, a.top_k, a.salt),
        "statistical",
        "partition and labels (independent draw)",
        "12",
        "trmoe's (the old runner's `random` is `random_shared`)",
    ),
    "random_shared": Strategy(
        _random_shared,
        "statistical",
        "labels only: one draw shared by all layers",
        "12",
        "`random`",
    ),
    "balanced_hash": Strategy(
        lambda a: _balanced_hash(a.vocab, a.experts, a.top_k, a.salt),
        "exact (differ by <= 1)",
        "partition and labels",
        "8",
        "the TR-Hash engine's `token_id_balanced_hash`",
    ),
    "balanced_hash_all_tuples": Strategy(
        _balanced_hash_all_tuples,
        "pairs differ by <= 1, experts by <= 2",
        "partition and tuple order",
        "12 (all E!/(E-K)!)",
        "the runner's legacy `token_id_balanced_hash`",
        nested_k=False,
    ),
    "balanced_secondary": Strategy(
        _balanced_secondary,
        "exact (differ by <= 1)",
        "primary labels only; secondary re-balanced",
        "12 (uneven)",
        "`modulo_balanced_secondary`, `zipf` without a table (Panel A's best arm)",
    ),
    "frequency_balanced_secondary": Strategy(
        _frequency_balanced_secondary,
        "primary ids exact; secondary *occurrences* balanced",
        "primary labels only; secondary re-balanced",
        "12 (uneven)",
        "`modulo_frequency_balanced_secondary`",
        needs_frequencies=True,
    ),
    "affine_hash": Strategy(
        lambda a: _affine_hash(a.vocab, a.experts, a.top_k, a.salt),
        "statistical",
        "partition and labels",
        "8",
        "the engine's `token_id_affine_hash`",
    ),
    "multi_hash": Strategy(
        lambda a: _multi_hash(a.vocab, a.experts, a.top_k, a.salt, a.hash_count),
        "statistical",
        "partition and labels",
        "12",
        "the engine's `token_id_multi_hash`",
    ),
    "contiguous_blocks": Strategy(
        lambda a: _contiguous_blocks(a.vocab, a.experts, a.top_k, a.salt),
        "exact (differ by <= 1)",
        "labels only (same partition)",
        "4",
        "new: a locality control (neighbouring ids, often related merges, share their experts)",
    ),
    "bigram_hash": _hashed("bigram", "the (previous id, id) pair, hashed on the fly"),
    "prev_token_hash": _hashed("prev", "the previous token id only, hashed on the fly"),
    "position_hash": _hashed("position", "the position in the row only (content-free control)"),
    "oracle_future_hash": _hashed(
        "target", "the target (next) token id: analysis only, loss forwards only", analysis_only=True
    ),
    "clustered_hash": _from_embedding(False, "share an expert"),
    "dispersed_hash": _from_embedding(True, "spread over the experts"),
    "distilled": Strategy(
        _distilled,
        "as the parent router's choices (never-seen ids: balanced_hash)",
        "per layer, as the parent's router",
        "as counted",
        "new: Grouter 2026 (arXiv 2603.06626): the K experts a trained router chose most often per token id "
        "(routing.distill_from)",
        nested_k=False,
        distilled=True,
    ),
    "learned": Strategy(
        None,
        "by the auxiliary loss (per batch)",
        "a router per layer, trained",
        "input-dependent",
        "`--mlp-type learned_router` (a linear router, softmax, top-K)",
        key=None,
        router="trained",
    ),
    "learned_v3": Strategy(
        None,
        "by a per-expert bias nudged after every step (aux-loss-free), optional sequence-wise loss",
        "a router per layer, trained (sigmoid scores)",
        "input-dependent",
        "new: DeepSeek-V3's router (arXiv 2412.19437 §2.1.2; routing.bias_update, routing.seq_aux_weight)",
        key=None,
        router="trained",
        scoring="sigmoid_bias",
    ),
    "frozen_router": Strategy(
        None,
        "none trained (the random router's own)",
        "a router per layer, frozen at its init",
        "input-dependent",
        "new: Fan et al. 2024's frozen random-init router (a control)",
        key=None,
        router="frozen",
    ),
    "rerandomised_router": Strategy(
        None,
        "statistical (a fresh random router per step)",
        "a router per layer, redrawn every step",
        "input-dependent",
        "new: Fan et al. 2024's router re-randomised every step (a control)",
        key=None,
        router="rerandomised",
    ),
    "dense": Strategy(
        None,
        "n/a: no routed experts (the shared expert widened to S + K x W_e)",
        "a per-layer strategy (routing.layers): dense where it is set",
        "none",
        "new: DeepSeek's first_k_dense_replace (arXiv 2401.06066, 2412.19437); Marin #4022, #4040",
        dense=True,
    ),
}


def _check_plugin(strategy: Any) -> None:
    """A plug-in strategy (entry point group `trmoe.routing`) is a route table: routers and hashed keys
    need model code of their own."""
    if not isinstance(strategy, Strategy):
        raise TypeError(
            f"a routing plug-in must be a trmoe.model.routing.Strategy, got {type(strategy).__name__}"
        )
    if (
        not strategy.has_table
        or strategy.key != "token"
        or strategy.analysis_only
        or strategy.router
        or strategy.dense
    ):
        raise ValueError("a routing plug-in must be a route table (build set, key 'token', no router)")


# The built-ins above (in this order: docs/routing.md's table), then the route tables of installed plug-ins.
STRATEGY_REGISTRY: Registry[Strategy] = Registry(
    "routing.strategy", group="trmoe.routing", package=None, check=_check_plugin, extra=lambda: _BUILTIN
)
REGISTRY: dict[str, Strategy] = dict(STRATEGY_REGISTRY.items())
ALL_STRATEGIES: tuple[str, ...] = tuple(REGISTRY)  # every value routing.strategy takes
# the strategies with a route table that need nothing but the sizes and the seed
STRATEGIES: tuple[str, ...] = tuple(
    n
    for n, s in REGISTRY.items()
    if s.has_table and not s.needs_frequencies and not s.needs_embedding and not s.distilled
)
# distilled's table before a run sets it, and its rule for the token ids the pass never saw
DISTILL_FALLBACK = "balanced_hash"
MAX_TUPLES = 1 << 20  # balanced_hash_all_tuples enumerates its tuples


def strategy_table() -> str:
    """The registry as the markdown table docs/routing.md holds (a test keeps the two equal)."""
    rows = [
        "| `routing.strategy` | balance of token ids per expert and slot | from layer to layer "
        "| ordered pairs at E = 4, K = 2 | K = 2 rows of K = 4 | the old runner's name |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in _BUILTIN.items():  # trmoe's own: a user's plug-ins do not change its docs
        nested = "n/a" if s.learned or s.dense else ("yes" if s.nested_k else "no")
        rows.append(f"| `{name}` | {s.balance} | {s.layers} | {s.tuples} | {nested} | {s.origin} |")
    return "\n".join(rows) + "\n"


def build_route_table(
    strategy: str,
    vocab_size: int,
    num_experts: int,
    top_k: int,
    layer: int,
    seed: int = 0,
    hash_count: int = 2,
    frequencies: np.ndarray | torch.Tensor | None = None,
    embedding: str | None = None,
    routes: np.ndarray | torch.Tensor | None = None,
) -> torch.Tensor:
    """Route table of one layer: ``[top_k, vocab_size]`` tensor of expert ids, ``table[k, t]`` the
    k-th expert of token id t (distinct over k); dtype torch.uint8 if num_experts <= 256 else
    torch.int16. A pure function of its arguments; ``hash_count`` only affects ``multi_hash``,
    ``frequencies`` (token counts, length vocab_size) only ``frequency_balanced_secondary``, which
    needs them, ``embedding`` (a token embedding's source: trmoe.model.embedding_routing) only
    ``clustered_hash`` and ``dispersed_hash``, which need it, ``routes`` (a [top_k, vocab_size] table
    counted by trmoe.model.distill) only ``distilled``, which needs it. Raises ValueError on an unknown
    strategy, one without a table, or out-of-range sizes."""
    import torch

    name, vocab, experts, k, lay, sd, h = _validate(
        strategy, vocab_size, num_experts, top_k, layer, seed, hash_count
    )
    entry = REGISTRY[name]
    if not entry.has_table:
        raise ValueError(f"routing strategy {name!r} has no route table (a learned router or a hashed key)")
    if entry.needs_frequencies:
        if frequencies is None:
            raise ValueError(f"routing strategy {name!r} needs a token-frequency table (routing.frequencies)")
        frequencies = np.asarray(frequencies, dtype=np.int64)
        if frequencies.shape != (vocab,):
            raise ValueError(f"the token-frequency table has shape {frequencies.shape}, expected ({vocab},)")
    if entry.needs_embedding and embedding is None:
        raise ValueError(f"routing strategy {name!r} needs a token embedding (routing.embedding)")
    if name == "balanced_hash_all_tuples" and tuple_count(experts, k) > MAX_TUPLES:
        raise ValueError(
            f"balanced_hash_all_tuples: E!/(E-K)! = {tuple_count(experts, k)} tuples > {MAX_TUPLES}"
        )
    if routes is not None:
        routes = np.asarray(routes.cpu() if hasattr(routes, "cpu") else routes).astype(np.int64)
    args = TableArgs(vocab, experts, k, lay, sd, layer_salt(sd, lay), h, frequencies, embedding, routes)
    origin = STRATEGY_REGISTRY.origin(name)
    try:
        table = np.asarray(entry.build(args))
        _check_table(name, table, vocab, experts, k)
    except Exception as e:
        if not origin.plugin:
            raise
        # a plug-in's failure is the user's to fix: one line naming it (trmoe's own tables raise as bugs)
        raise UserError(
            f"routing.strategy={name}: the plug-in ({origin.dist} {origin.version}, {origin.entry_point}) "
            f"failed to build layer {lay}'s table: {type(e).__name__}: {e}"
        ) from None
    dtype = np.uint8 if experts <= 256 else np.int16
    return torch.from_numpy(np.ascontiguousarray(table.astype(dtype)))


def _check_table(name: str, table: np.ndarray, vocab: int, experts: int, top_k: int) -> None:
    """What every construction must give (a plug-in's too): [K, V] integer expert ids in [0, E), the K
    routes of each token distinct."""
    if table.shape != (top_k, vocab) or table.dtype.kind not in "iu":
        raise ValueError(
            f"routing strategy {name!r} built a {table.dtype} table of shape {table.shape}; "
            f"allowed: integers of shape ({top_k}, {vocab})"
        )
    if vocab and (int(table.min()) < 0 or int(table.max()) >= experts):
        raise ValueError(f"routing strategy {name!r} built expert ids outside 0..{experts - 1}")
    ordered = np.sort(table, axis=0)
    if top_k > 1 and bool((ordered[1:] == ordered[:-1]).any()):
        raise ValueError(f"routing strategy {name!r} routes a token twice to one expert")


def load_token_counts(path: str) -> np.ndarray:
    """The token-frequency table (int64 [V], how often each token id occurs in the training split) written
    by ``python -m trmoe.data.prepare``. ``path`` is the file itself: the config layer resolves a directory
    (routing.frequencies, data.path) to the file in it (``trmoe.config.validate.frequencies_path``), so the
    model never reads the data layer's file names."""
    counts = np.load(path, allow_pickle=False)
    if counts.ndim != 1 or counts.dtype.kind not in "iu":
        raise ValueError(
            f"{path}: a token-frequency table is a 1-D integer array, got {counts.dtype} {counts.shape}"
        )
    return counts.astype(np.int64)


def route_counts(
    table: torch.Tensor, num_experts: int, weights: np.ndarray | torch.Tensor | None = None
) -> torch.Tensor:
    """``[top_k, num_experts]`` int64: how many token ids each route slot k sends to each expert; with
    ``weights`` (one per token id, e.g. its occurrences in the training split) their sum instead."""
    import torch

    if table.dim() != 2:
        raise ValueError(f"route table must be 2-D [top_k, vocab_size], got shape {tuple(table.shape)}")
    experts = _check_int("num_experts", num_experts)
    if experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {experts}")
    ids = table.to(torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= experts):
        raise ValueError(f"route table holds expert ids outside 0..{experts - 1}")
    counts = torch.zeros((table.shape[0], experts), dtype=torch.int64)
    w = (
        torch.ones_like(ids)
        if weights is None
        else torch.as_tensor(weights, dtype=torch.int64).expand_as(ids)
    )
    counts.scatter_add_(1, ids, w)
    return counts


def balance_stats(
    table: torch.Tensor, num_experts: int, weights: np.ndarray | torch.Tensor | None = None
) -> dict[str, float]:
    """Per-layer balance figures: ``primary_max_over_mean`` and ``primary_min_over_mean`` (counts of
    slot 0 against their mean V/E), ``all_max_over_mean`` and ``all_min_over_mean`` (counts of all
    K slots summed, against their mean K*V/E); of token occurrences with ``weights`` (route_counts)."""
    import torch

    counts = route_counts(table, num_experts, weights).to(torch.float64)
    primary = counts[0]
    total = counts.sum(dim=0)
    p_mean = float(primary.mean())
    a_mean = float(total.mean())
    return {
        "primary_max_over_mean": float(primary.max()) / p_mean,
        "all_max_over_mean": float(total.max()) / a_mean,
        "primary_min_over_mean": float(primary.min()) / p_mean,
        "all_min_over_mean": float(total.min()) / a_mean,
    }


def tuple_grouping(table: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Whether a layer runs its routed experts grouped by route tuple (trmoe/model/moe.py), and with what:
    ``(tuples, tuple_of)`` when the ``[top_k, vocab_size]`` table holds no more distinct tuples
    (r_0, ..., r_{K-1}) than experts, else None. ``tuples`` ``[C, top_k]`` int64 (sorted), ``tuple_of``
    ``[vocab_size]`` the index of each token id's tuple, in the table's dtype. modulo_cyclic tables have
    exactly E tuples, any table at K = 1 at most E; hashed ones up to E!/(E-K)!."""
    import torch

    ids = table.to(torch.int64)
    top_k = ids.shape[0]
    if num_experts**top_k > torch.iinfo(torch.int64).max:  # the codes below would wrap: rows, exactly
        tuples, tuple_of = torch.unique(ids.T, dim=0, return_inverse=True)  # rows sorted as the codes are
        return (tuples, tuple_of.to(table.dtype)) if tuples.shape[0] <= num_experts else None
    # each tuple as one integer, r_0 its most significant base-E digit: a 1-D unique takes ~0.02 s for a
    # 200k-token table where a unique over rows took 0.42 s, and this runs for every layer of a new model
    code = torch.zeros_like(ids[0])
    for k in range(top_k):
        code = code * num_experts + ids[k]
    codes, tuple_of = torch.unique(code, return_inverse=True)
    if codes.shape[0] > num_experts:
        return None
    digits = [codes // num_experts**p % num_experts for p in range(top_k - 1, -1, -1)]
    return torch.stack(digits, dim=1), tuple_of.to(table.dtype)


@functools.lru_cache(maxsize=64)
def groups_by_tuple(
    strategy: str, vocab_size: int, num_experts: int, top_k: int, seed: int, hash_count: int
) -> bool:
    """`tuple_grouping` of layer 0's table is not None (the planner's question; every layer of the
    built-in strategies has the same number of tuples at a realistic vocabulary). A learned router groups
    by expert; so do a distilled table and the frequency-balanced secondary, whose greedy pass uses more
    tuples than experts (all E(E-1) at E = 4, K = 2) for any table but a degenerate one."""
    entry = REGISTRY[getattr(strategy, "value", strategy)]
    if entry.needs_embedding:
        return True  # E tuples (r_0, r_0 + 1, ...) by construction, whatever the embedding
    if not entry.has_table or entry.needs_frequencies or entry.distilled:
        return False  # (distilled: counted from a router, its tuples are as many as the router used)
    table = build_route_table(strategy, vocab_size, num_experts, top_k, 0, seed, hash_count)
    return tuple_grouping(table, num_experts) is not None


# A layer's learned routing state (a router's W_r, learned_v3's bias): it means what the strategy that trained
# it made of it
ROUTER_STATE = ("ffn.router", "ffn.route_bias")


def foreign_router_state(
    parent: tuple[str, ...] | None, ours: tuple[str, ...], names: set[str]
) -> tuple[int, str, str | None] | None:
    """(layer, tensor, the parent's strategy) of the first learned routing state among the model's `names`
    that a layer routing by another strategy than the parent's (`parent` per layer; None: unknown) would
    carry (a learned W_r in frozen_router stays frozen at the parent's trained one); None when none."""
    for layer, strategy in enumerate(ours):
        theirs = parent[layer] if parent is not None and layer < len(parent) else None
        carried = [f"blocks.{layer}.{n}" for n in ROUTER_STATE if f"blocks.{layer}.{n}" in names]
        if carried and theirs != strategy:
            return layer, carried[0], theirs
    return None
