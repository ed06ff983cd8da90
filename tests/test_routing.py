"""Tests of the fixed token-id route tables (trmoe.model.routing)."""

from __future__ import annotations

import functools
import hashlib

import numpy as np
import pytest
import torch

from trmoe.model import routing
from trmoe.model.routing import (
    REGISTRY,
    STRATEGIES,
    balance_stats,
    build_route_table,
    layer_salt,
    mix32,
    route_counts,
    tuple_grouping,
)

V_REAL = 200_019  # the o200k vocabulary size used by the models
HASHED = ("random", "affine_hash", "multi_hash")  # statistically balanced strategies
EXACT = (
    "modulo_cyclic",
    "balanced_hash",
    "balanced_secondary",
    "contiguous_blocks",
)  # up to one token per expert and slot
NEAR = ("balanced_hash_all_tuples",)  # up to one token per tuple, two per expert and slot


@functools.cache
def _table(strategy: str, vocab: int, experts: int, top_k: int, layer: int, seed: int = 0, hc: int = 2):
    return build_route_table(strategy, vocab, experts, top_k, layer, seed=seed, hash_count=hc)


def _ref_mix32(x: int) -> int:
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) % 2**32
    x ^= x >> 15
    x = (x * 0x846CA68B) % 2**32
    x ^= x >> 16
    return x


# ---------------------------------------------------------------------------------------------- mix32


def test_mix32_matches_reference_for_ints_and_arrays():
    xs = [0, 1, 2, 12345, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0xDEADBEEF]
    expected = [_ref_mix32(x) for x in xs]
    assert [mix32(x) for x in xs] == expected
    assert mix32(np.array(xs, dtype=np.uint32)).tolist() == expected
    assert mix32(np.array(xs, dtype=np.int64)).tolist() == expected
    assert mix32(2**32 + 5) == _ref_mix32(5)
    assert mix32(0) == 0  # the finalizer fixes zero


def test_layer_salt_formula():
    for seed, layer in [(0, 0), (0, 1), (7, 3), (2**31, 11)]:
        assert layer_salt(seed, layer) == _ref_mix32(_ref_mix32(seed) ^ ((layer * 0x9E3779B1) % 2**32))
    assert len({layer_salt(0, layer) for layer in range(64)}) == 64


# ------------------------------------------------------------------------------ shape, dtype, range


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_shape_dtype_range(strategy):
    t = _table(strategy, V_REAL, 4, 2, 0)
    assert t.shape == (2, V_REAL)
    assert t.dtype == torch.uint8
    assert t.is_contiguous()
    assert int(t.min()) >= 0 and int(t.max()) <= 3
    big = build_route_table(strategy, 500, 300, 2, 1)
    assert big.dtype == torch.int16
    assert big.shape == (2, 500)
    assert int(big.min()) >= 0 and int(big.max()) < 300


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("experts", [3, 4, 8])
def test_routes_of_a_token_are_distinct(strategy, experts):
    vocab = 5003
    for top_k in sorted({1, 2, experts}):
        for layer in (0, 1):
            t = build_route_table(strategy, vocab, experts, top_k, layer).to(torch.int64)
            assert t.shape == (top_k, vocab)
            assert int(t.min()) >= 0 and int(t.max()) < experts
            s = torch.sort(t, dim=0).values
            assert bool((s[1:] != s[:-1]).all()), (strategy, experts, top_k, layer)
            if top_k == experts:  # every token uses every expert exactly once
                assert torch.equal(s, torch.arange(experts)[:, None].expand(experts, vocab))


@pytest.mark.parametrize("strategy", [s for s in STRATEGIES if REGISTRY[s].nested_k])
def test_larger_k_extends_smaller_k(strategy):
    """The routes of K=2 are the first two routes of K=4 (slots do not depend on K)."""
    t2 = build_route_table(strategy, 3001, 8, 2, 2, seed=5)
    t4 = build_route_table(strategy, 3001, 8, 4, 2, seed=5)
    assert torch.equal(t4[:2], t2)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_tiny_vocab_and_single_expert(strategy):
    one = build_route_table(strategy, 1000, 1, 1, 3, seed=9)
    assert one.shape == (1, 1000)
    assert int(one.abs().sum()) == 0
    small = build_route_table(strategy, 3, 8, 8, 0)  # fewer tokens than experts
    assert torch.equal(torch.sort(small.to(torch.int64), dim=0).values, torch.arange(8)[:, None].expand(8, 3))
    assert build_route_table(strategy, 1, 4, 2, 0).shape == (2, 1)


# ------------------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_deterministic(strategy):
    a = build_route_table(strategy, V_REAL, 4, 2, 1, seed=3)
    b = build_route_table(strategy, V_REAL, 4, 2, 1, seed=3)
    assert torch.equal(a, b)


@pytest.mark.parametrize("strategy", [s for s in STRATEGIES if s != "modulo_cyclic"])
def test_layer_changes_table(strategy):
    t0 = _table(strategy, V_REAL, 4, 2, 0)
    t1 = _table(strategy, V_REAL, 4, 2, 1)
    same = (t0 == t1).all(dim=0).double().mean().item()
    # Independent tables agree on both routes of a token with probability 1/(E*(E-1)) = 1/12.
    assert same < 0.2, same


def test_modulo_cyclic_keeps_partition_across_layers():
    vocab, experts = V_REAL, 4
    tables = [_table("modulo_cyclic", vocab, experts, 2, layer) for layer in range(4)]
    cls = torch.arange(vocab) % experts
    labellings = set()
    for t in tables:
        r0 = t[0].to(torch.int64)
        # r_0 is constant on every class {t : t mod E = c} and a bijection of the classes.
        label = r0[:experts]
        assert torch.equal(r0, label[cls])
        assert sorted(label.tolist()) == list(range(experts))
        assert torch.equal(t[1].to(torch.int64), (r0 + 1) % experts)
        labellings.add(tuple(label.tolist()))
    assert len(labellings) > 1  # the labels are drawn per layer


def test_balanced_hash_partition_changes_across_layers():
    experts = 4
    p0 = _table("balanced_hash", V_REAL, experts, 2, 0)[0]
    p1 = _table("balanced_hash", V_REAL, experts, 2, 1)[0]
    frac = (p0 == p1).double().mean().item()
    assert abs(frac - 1 / experts) < 0.01, frac
    # Also as a partition (label-free): the classes of layer 0 are split over all classes of layer 1.
    pairs = torch.unique(p0.to(torch.int64) * experts + p1.to(torch.int64))
    assert pairs.numel() == experts * experts


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_seed_changes_table(strategy):
    experts = 8  # with E=8 two label permutations coincide with probability 1/8!
    a = build_route_table(strategy, 20_000, experts, 2, 0, seed=0)
    b = build_route_table(strategy, 20_000, experts, 2, 0, seed=1)
    assert not torch.equal(a, b)


def test_hash_count_only_matters_for_multi_hash():
    for strategy in STRATEGIES:
        a = build_route_table(strategy, 5000, 8, 2, 0, hash_count=1)
        b = build_route_table(strategy, 5000, 8, 2, 0, hash_count=3)
        assert torch.equal(a, b) == (strategy != "multi_hash"), strategy


def test_str_enum_strategy_is_accepted():
    from enum import Enum

    class Strategy(str, Enum):
        multi_hash = "multi_hash"

    assert torch.equal(
        build_route_table(Strategy.multi_hash, 999, 4, 2, 0), _table("multi_hash", 999, 4, 2, 0)
    )


# Fingerprints of small tables: the same bytes on every machine and process. A change here means
# tables (and therefore checkpoints) built by different versions of the code or of NumPy differ.
GOLDEN_SHA256_PREFIX = {
    "modulo_cyclic": "6f902de2127e296a",
    "random": "a8997a68519c4df4",
    "balanced_hash": "5eb0db60ce56d211",
    "affine_hash": "d6197a39ae3e2f83",
    "multi_hash": "983a2406dfdf9594",
    "random_shared": "9f8b39f879bdfdfc",
    "balanced_hash_all_tuples": "8463d1063903b83c",
    "balanced_secondary": "d032e9185798fcf8",
    "contiguous_blocks": "ef524ac644714214",
}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_golden_fingerprint(strategy):
    t = build_route_table(strategy, 1000, 8, 3, 2, seed=7, hash_count=3)
    digest = hashlib.sha256(t.numpy().tobytes()).hexdigest()[:16]
    assert digest == GOLDEN_SHA256_PREFIX[strategy]


# ------------------------------------------------------------------------------ reference semantics


def _ref_salt(seed: int, layer: int) -> int:
    return _ref_mix32(_ref_mix32(seed) ^ ((layer * 0x9E3779B1) % 2**32))


def _units(experts: int) -> list[int]:
    return [u for u in range(1, experts) if np.gcd(u, experts) == 1] or [0]


def test_multi_hash_matches_scalar_reference():
    vocab, experts, layer, seed, hc = 300, 8, 2, 11, 3
    salt = _ref_salt(seed, layer)
    salts = [(salt + h * 0x85EBCA77) % 2**32 for h in range(hc)]
    t = build_route_table("multi_hash", vocab, experts, experts, layer, seed=seed, hash_count=hc)
    for tok in range(vocab):
        score = [
            sum(_ref_mix32(tok ^ _ref_mix32((e + (s ^ 0xC2B2AE3D)) % 2**32) ^ s) for s in salts)
            for e in range(experts)
        ]
        expected = sorted(range(experts), key=lambda e: (-score[e], e))
        assert t[:, tok].tolist() == expected, tok
    for top_k in (1, 2, 5):  # the top-k selection paths give the same prefix as a full sort
        tk = build_route_table("multi_hash", vocab, experts, top_k, layer, seed=seed, hash_count=hc)
        assert torch.equal(tk, t[:top_k])


def test_affine_hash_matches_scalar_reference():
    vocab, experts, layer, seed = 400, 6, 1, 4
    salt = _ref_salt(seed, layer)
    units = _units(experts)
    t = build_route_table("affine_hash", vocab, experts, 3, layer, seed=seed)
    for tok in range(vocab):
        base = _ref_mix32(tok ^ salt) % experts
        stride = units[_ref_mix32((tok + (salt ^ 0x85EBCA77)) % 2**32) % len(units)]
        assert t[:, tok].tolist() == [(base + k * stride) % experts for k in range(3)]


@pytest.mark.parametrize("strategy", ["modulo_cyclic", "contiguous_blocks", "random", "balanced_hash"])
def test_permutation_strategies_match_scalar_references(strategy):
    """The strategies that draw from the layer's generator, token by token as docs/routing.md writes them
    (the golden fingerprints above can only say that a table changed, not which of code and doc is right)."""
    vocab, experts, top_k, layer, seed = 523, 6, 3, 2, 9
    salt = _ref_salt(seed, layer)
    rng = np.random.Generator(np.random.PCG64(salt))
    table = build_route_table(strategy, vocab, experts, top_k, layer, seed=seed).to(torch.int64)
    if strategy == "modulo_cyclic":
        labels = rng.permutation(experts)
        expected = [[(labels[t % experts] + k) % experts for k in range(top_k)] for t in range(vocab)]
    elif strategy == "contiguous_blocks":  # E blocks of consecutive ids: block floor(t E / V)
        labels = rng.permutation(experts)
        expected = [
            [(labels[t * experts // vocab] + k) % experts for k in range(top_k)] for t in range(vocab)
        ]
    elif strategy == "random":  # E uniform keys per token, in token order; the K smallest, smallest first
        keys = rng.random((vocab, experts))
        expected = [sorted(range(experts), key=lambda e, t=t: keys[t, e])[:top_k] for t in range(vocab)]
    else:
        sigma = rng.permutation(vocab)
        labels = rng.permutation(experts)
        rank = {int(token): r for r, token in enumerate(sigma)}
        units = _units(experts)
        expected = []
        for t in range(vocab):
            block, position = divmod(rank[t], experts)
            stride = units[_ref_mix32(block ^ salt) % len(units)]
            expected.append([labels[(position + k * stride) % experts] for k in range(top_k)])
    assert table.T.tolist() == [[int(e) for e in routes] for routes in expected]


def test_balanced_hash_blocks_are_exact():
    """Within every full block of E ranks each slot uses each expert exactly once."""
    vocab, experts, top_k, layer, seed = 10_007, 6, 3, 2, 1
    t = build_route_table("balanced_hash", vocab, experts, top_k, layer, seed=seed).to(torch.int64)
    rng = np.random.Generator(np.random.PCG64(_ref_salt(seed, layer)))
    sigma = torch.from_numpy(rng.permutation(vocab))  # sigma[rank] = token id
    by_rank = t[:, sigma]
    full = (vocab // experts) * experts
    blocks = by_rank[:, :full].reshape(top_k, -1, experts)
    assert torch.equal(torch.sort(blocks, dim=2).values, torch.arange(experts).expand_as(blocks))


# ------------------------------------------------------------------------------------------ balance


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_balance_at_real_vocab(strategy):
    vocab, experts, top_k = V_REAL, 4, 2
    tol = 1e-4 if strategy in EXACT + NEAR else 0.03
    for layer in range(4):
        t = _table(strategy, vocab, experts, top_k, layer)
        counts = route_counts(t, experts)
        assert counts.shape == (top_k, experts)
        assert counts.dtype == torch.int64
        assert torch.equal(counts.sum(dim=1), torch.full((top_k,), vocab))
        per_slot = counts.double() / (vocab / experts)
        assert float(per_slot.max()) <= 1 + tol and float(per_slot.min()) >= 1 - tol, (layer, per_slot)
        if strategy in EXACT + NEAR:
            assert int(counts.max() - counts.min()) <= (1 if strategy in EXACT else 2)
        stats = balance_stats(t, experts)
        assert set(stats) == {
            "primary_max_over_mean",
            "all_max_over_mean",
            "primary_min_over_mean",
            "all_min_over_mean",
        }
        for key, value in stats.items():
            assert isinstance(value, float)
            assert abs(value - 1) <= tol, (strategy, layer, key, value)


def test_route_counts_and_balance_stats_on_a_known_table():
    t = torch.tensor([[0, 0, 1, 2, 0, 1], [1, 2, 0, 0, 2, 2]], dtype=torch.uint8)
    counts = route_counts(t, 3)
    assert counts.tolist() == [[3, 2, 1], [2, 1, 3]]
    stats = balance_stats(t, 3)
    assert stats["primary_max_over_mean"] == pytest.approx(1.5)
    assert stats["primary_min_over_mean"] == pytest.approx(0.5)
    assert stats["all_max_over_mean"] == pytest.approx(5 / 4)  # summed [5, 3, 4], mean 4
    assert stats["all_min_over_mean"] == pytest.approx(3 / 4)
    assert route_counts(t, 5).tolist() == [[3, 2, 1, 0, 0], [2, 1, 3, 0, 0]]
    with pytest.raises(ValueError, match="0..1"):
        route_counts(t, 2)


# ------------------------------------------------------------------------------------------- errors


def test_unknown_strategy_names_the_allowed_values():
    with pytest.raises(ValueError) as info:
        build_route_table("zipf", 100, 4, 2, 0)
    msg = str(info.value)
    assert "zipf" in msg
    for name in STRATEGIES:
        assert name in msg


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        (dict(top_k=5), "top_k must be in 1..num_experts (1..4)"),
        (dict(top_k=0), "top_k"),
        (dict(num_experts=0, top_k=1), "num_experts"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(hash_count=0), "hash_count must be in 1..8"),
        (dict(hash_count=9), "hash_count must be in 1..8"),
        (dict(layer=-1), "layer"),
        (dict(top_k=2.0), "top_k must be an integer"),
    ],
)
@pytest.mark.parametrize("strategy", ["modulo_cyclic", "multi_hash"])
def test_bad_arguments_raise(strategy, kwargs, fragment):
    args = dict(vocab_size=100, num_experts=4, top_k=2, layer=0, seed=0, hash_count=2)
    args.update(kwargs)
    with pytest.raises(ValueError) as info:
        build_route_table(strategy, **args)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    "experts, top_k",
    [(4, 2), (8, 1), (32, 12), (32, 13), (64, 16)],  # E**K from 16 to 2**96: past 2**63 the rows are compared
)
def test_tuple_grouping_reproduces_the_table(experts, top_k):
    table = build_route_table("modulo_cyclic", 1_000, experts, top_k, 3, seed=0, hash_count=2)
    tuples, tuple_of = tuple_grouping(table, experts)
    assert tuples.shape == (experts, top_k) and tuple_of.dtype == table.dtype
    assert torch.equal(tuples[tuple_of.long()].T, table.long())
    assert torch.equal(tuples, torch.unique(tuples, dim=0))  # sorted, each tuple once


def test_tuple_grouping_declines_more_tuples_than_experts():
    table = build_route_table("random", 1_000, 4, 2, 0, seed=0, hash_count=2)
    assert tuple_grouping(table, 4) is None
    wide = build_route_table("random", 1_000, 64, 16, 0, seed=0, hash_count=2)
    assert tuple_grouping(wide, 64) is None


# ------------------------------------------ the old runner's constructions against its own tables
# Vectors from /work/shared/reference/reference-formats-and-routing.md (2.0-2.5): the runner draws its
# permutations and random choices with torch's CPU generator; fed those draws, trmoe's constructions must give
# its tables bit for bit (fingerprint: sha256[:16] of the [2, V] int64 table, little-endian, row 0 first).


def _fingerprint(table) -> str:
    return hashlib.sha256(np.ascontiguousarray(np.asarray(table, dtype="<i8")).tobytes()).hexdigest()[:16]


def _torch_perm(n: int, seed: int) -> np.ndarray:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).numpy()


def _runner_labels(layer: int) -> np.ndarray:
    return _torch_perm(4, 0xC0DE + layer)


def _pairs(table, a: int, b: int) -> int:
    return int(((table[0] == a) & (table[1] == b)).sum())


def _digits(table, ids) -> str:
    return " ".join(f"{table[0, t]}{table[1, t]}" for t in ids)


def test_runner_label_permutations():
    assert [_runner_labels(layer).tolist() for layer in (0, 1, 9)] == [
        [2, 0, 3, 1],
        [3, 0, 2, 1],
        [3, 2, 1, 0],
    ]


def test_greedy_order_breaks_ties_as_the_runner():
    order = routing.greedy_order(np.ones(V_REAL))
    assert order[:3].tolist() == [133351, 133339, 133340]
    assert _fingerprint(order) == "a19893f6d7384306"


@pytest.mark.parametrize(
    ("layer", "digest", "first", "pairs"),
    [
        (
            0,
            "b0818e00471d70ae",
            "23 02 30 13 21 02 30 13 21 02 30 13 21 02 30 13",
            {(3, 0): 34458, (1, 0): 2739},
        ),
        (
            1,
            "dc9ff8873a45800f",
            "30 02 23 10 31 02 23 10 31 02 23 10 31 02 23 10",
            {(1, 2): 35392, (3, 2): 2782},
        ),
    ],
)
def test_count_balanced_secondary_is_the_runners(layer, digest, first, pairs):
    primary = _runner_labels(layer)[np.arange(V_REAL) % 4]
    table = routing.greedy_routes(primary, 4, 2, routing.greedy_order(np.ones(V_REAL)), None)
    assert _fingerprint(table) == digest
    assert _digits(table, range(16)) == first
    for (a, b), count in pairs.items():
        assert _pairs(table, a, b) == count
    assert np.bincount(table[1], minlength=4).tolist() == [50005, 50005, 50005, 50004]


T1 = (np.arange(V_REAL, dtype=np.int64) + 1) * 2_654_435_761 % 2**32
T2 = 100_000 // (1 + np.arange(V_REAL, dtype=np.int64) * 40_503 % V_REAL)


@pytest.mark.parametrize(
    ("name", "layer", "digest", "first"),
    [
        ("T1", 0, "d16524eda68ba9e2", "20 02 32 12 20 02 31 10 20 03 30 12 20 03 32 13"),
        ("T1", 1, "7f4097f8d481ad46", "31 02 21 13 32 02 20 13 30 02 21 13 32 01 21 12"),
        ("T2", 0, "75009fc5bad2c3b8", "21 03 30 12 21 01 30 12 21 01 30 10 20 01 31 10"),
        ("T2", 1, "826295f31c6cbb46", "31 02 23 10 30 03 23 12 30 02 21 12 30 02 20 10"),
    ],
)
def test_frequency_balanced_secondary_is_the_runners(name, layer, digest, first):
    freq = {"T1": T1, "T2": T2}[name]
    primary = _runner_labels(layer)[np.arange(V_REAL) % 4]
    table = routing.greedy_routes(primary, 4, 2, routing.greedy_order(freq), freq)
    assert _fingerprint(table) == digest
    assert _digits(table, range(16)) == first
    if name == "T2" and layer == 0:  # the secondary balances occurrences, not ids
        mass = np.bincount(table[1], weights=freq, minlength=4).astype(np.int64).tolist()
        assert mass == [328095, 328094, 328094, 328094]


@pytest.mark.parametrize(("layer", "digest"), [(0, "aa8d30e50c0ce578"), (1, "f9128fb08c2468dd")])
def test_random_shared_is_the_runners_random(layer, digest):
    draws = torch.randint(0, 4, (V_REAL,), generator=torch.Generator().manual_seed(0xA61A710)).numpy()
    choice = torch.randint(0, 3, (V_REAL,), generator=torch.Generator().manual_seed(0xA61A710 + 7919)).numpy()
    table = routing.random_shared_routes(draws, [choice], _runner_labels(layer))
    assert _fingerprint(table) == digest
    assert _pairs(table, 0, 1) == 16557


@pytest.mark.parametrize(("layer", "digest"), [(0, "2848db97f3b75b91"), (1, "55762e464914f4cb")])
def test_balanced_hash_all_tuples_is_the_runners_legacy_hash(layer, digest):
    sigma = _torch_perm(V_REAL, 0x71D5A17 + 104_729 * layer)
    order = _torch_perm(12, 0x5EC0D + 104_729 * layer)
    table = routing.tuple_hash_routes(sigma, order, routing.all_tuples(4, 2))
    assert _fingerprint(table) == digest
    assert len({(a, b) for a in range(4) for b in range(4) if _pairs(table, a, b)}) == 12


def test_trmoe_builds_share_the_runners_structure():
    """trmoe's own draws (seeded PCG64) keep what defines each construction: random_shared keeps one
    12-class pair partition in every layer, balanced_secondary one primary partition with a re-balanced
    secondary, balanced_hash_all_tuples uses all 12 ordered pairs; the table-building entry point agrees
    with the constructions it is made of."""
    vocab = 20_000
    rs = [_table("random_shared", vocab, 4, 2, layer).numpy().astype(np.int64) for layer in (0, 1)]
    classes = [np.unique(t[0] * 4 + t[1], return_inverse=True)[1] for t in rs]
    assert len(np.unique(classes[0] * 12 + classes[1])) == 12  # the same classes, relabelled
    bs = [_table("balanced_secondary", vocab, 4, 2, layer).numpy().astype(np.int64) for layer in (0, 1)]
    assert len(np.unique(bs[0][0] * 4 + bs[1][0])) == 4  # the same primary partition
    for t in bs:
        assert np.bincount(t[1], minlength=4).tolist() == [5000] * 4
    bh = _table("balanced_hash_all_tuples", vocab, 4, 2, 0).numpy().astype(np.int64)
    assert len(np.unique(bh[0] * 4 + bh[1])) == 12
    bh8 = _table("balanced_hash", vocab, 4, 2, 0).numpy().astype(np.int64)
    assert len(np.unique(bh8[0] * 4 + bh8[1])) == 8


def test_frequency_strategy_needs_its_table():
    with pytest.raises(ValueError, match="token-frequency table"):
        build_route_table("frequency_balanced_secondary", 100, 4, 2, 0)
    with pytest.raises(ValueError, match="shape"):
        build_route_table(
            "frequency_balanced_secondary", 100, 4, 2, 0, frequencies=np.ones(99, dtype=np.int64)
        )
    freq = np.arange(100) % 7
    table = build_route_table("frequency_balanced_secondary", 100, 4, 2, 0, frequencies=freq).numpy()
    mass = np.bincount(table[1], weights=freq, minlength=4)
    assert mass.max() - mass.min() <= freq.max()
    with pytest.raises(ValueError, match="learned router"):
        build_route_table("learned", 100, 4, 2, 0)


def test_docs_tabulate_the_registry():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "routing.md").read_text()
    assert routing.strategy_table() in doc, "docs/routing.md's strategy table differs from strategy_table()"
    for name in REGISTRY:
        assert f"`{name}`" in doc
