from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from rollout.batch.kv_pool import KVPool
from rollout.core.radix_cache import RadixCache


def make_pool(num_slots: int = 64) -> KVPool:
    return KVPool(num_slots=num_slots, num_layers=1, num_kv_heads=1, head_dim=1,
                  dtype=torch.float32)


def alloc(pool: KVPool, n: int) -> torch.Tensor:
    slots = pool.alloc(n)
    assert slots is not None
    return slots


def check(cache: RadixCache, pool: KVPool, held: int = 0) -> None:
    cache.check_integrity()
    pool.check_integrity()
    assert pool.used() == cache.total_size() + held
    assert not cache.all_slots() & set(pool._free)


# ------------------------------------------------------------------------------- unit tests
def test_empty_match_and_insert():
    pool = make_pool()
    cache = RadixCache(pool)
    slots, node = cache.match_prefix([1, 2, 3])
    assert slots.dtype == torch.int64 and slots.numel() == 0 and node is cache.root
    s = alloc(pool, 3)
    assert cache.insert([1, 2, 3], s) == 0
    assert cache.total_size() == 3 and cache.evictable_size() == 3
    got, node = cache.match_prefix([1, 2, 3, 4])
    assert got.tolist() == s.tolist() and node.key == (1, 2, 3)
    assert cache.insert([], torch.empty(0, dtype=torch.int64)) == 0
    check(cache, pool)


def test_match_mid_edge_splits_node():
    pool = make_pool()
    cache = RadixCache(pool)
    s = alloc(pool, 5)
    cache.insert([1, 2, 3, 4, 5], s)
    got, node = cache.match_prefix([1, 2, 3, 9])
    assert got.tolist() == s[:3].tolist()
    assert node.key == (1, 2, 3) and list(node.children.values())[0].key == (4, 5)
    got, _ = cache.match_prefix([1, 2, 3, 4, 5])
    assert got.tolist() == s.tolist()
    check(cache, pool)


def test_insert_returns_already_cached_prefix_len():
    pool = make_pool()
    cache = RadixCache(pool)
    a = alloc(pool, 4)
    assert cache.insert([1, 2, 3, 4], a) == 0
    b = alloc(pool, 6)
    n = cache.insert([1, 2, 3, 7, 8, 9], b)  # shares [1, 2, 3]; splits the edge
    assert n == 3
    pool.free(b[:n])  # caller's duplicates
    got, node = cache.match_prefix([1, 2, 3, 7, 8, 9])
    assert got.tolist() == a[:3].tolist() + b[3:].tolist()
    assert node.key == (7, 8, 9)
    c = alloc(pool, 2)
    assert cache.insert([1, 2], c) == 2  # fully cached: nothing taken
    pool.free(c)
    check(cache, pool)


def test_insert_ending_mid_edge():
    pool = make_pool()
    cache = RadixCache(pool)
    a = alloc(pool, 4)
    cache.insert([1, 2, 3, 4], a)
    b = alloc(pool, 2)
    assert cache.insert([1, 2], b) == 2
    pool.free(b)
    got, node = cache.match_prefix([1, 2])
    assert got.tolist() == a[:2].tolist() and node.key == (1, 2)
    check(cache, pool)


def test_cached_slots_are_isolated_from_caller_tensors():
    pool = make_pool()
    cache = RadixCache(pool)
    s = alloc(pool, 3)
    expect = s.tolist()
    cache.insert([1, 2, 3], s)
    s.fill_(0)
    got, _ = cache.match_prefix([1, 2, 3])
    assert got.tolist() == expect
    got.fill_(0)
    assert cache.match_prefix([1, 2, 3])[0].tolist() == expect
    assert cache.insert((4, 5), [10, 11]) == 0 and cache.match_prefix(torch.tensor([4, 5]))[0].tolist() == [10, 11]


def test_lock_protects_from_eviction():
    pool = make_pool()
    cache = RadixCache(pool)
    a = alloc(pool, 4)
    cache.insert([1, 2, 3, 4], a)
    b = alloc(pool, 3)
    pool.free(b[:2])
    cache.insert([1, 2, 5], b)  # tree: [1,2] -> {[3,4], [5]}
    _, node = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock(node)
    assert cache.protected_size() == 4 and cache.evictable_size() == 1
    assert cache.evict(100) == 1  # only the unlocked leaf [5]
    assert cache.match_prefix([1, 2, 5])[0].tolist() == a[:2].tolist()
    check(cache, pool)
    assert cache.flush() is False and cache.total_size() == 4
    cache.dec_lock(node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 4
    assert cache.evict(1) == 2  # whole leaf [3, 4]
    assert cache.evict(1) == 2  # then its parent [1, 2], now a leaf
    assert cache.total_size() == 0 and pool.used() == 0
    check(cache, pool)


def test_lock_counts_nest_and_survive_splits():
    pool = make_pool()
    cache = RadixCache(pool)
    cache.insert([1, 2, 3, 4], alloc(pool, 4))
    _, deep = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock(deep)
    cache.inc_lock(deep)
    _, mid = cache.match_prefix([1, 2])  # splits the locked node
    assert mid.lock_ref == 2 and deep.lock_ref == 2 and cache.protected_size() == 4
    cache.dec_lock(deep)
    assert cache.protected_size() == 4
    cache.dec_lock(deep)
    assert cache.protected_size() == 0
    with pytest.raises(AssertionError):
        cache.dec_lock(deep)


def test_evict_is_lru_over_leaves():
    pool = make_pool()
    cache = RadixCache(pool)
    sa, sb, sc = alloc(pool, 2), alloc(pool, 2), alloc(pool, 2)
    cache.insert([1, 1], sa)
    cache.insert([2, 2], sb)
    cache.insert([3, 3], sc)
    cache.match_prefix([1, 1])  # A is now the most recent
    assert cache.evict(1) == 2
    assert cache.all_slots() == set(sa.tolist()) | set(sc.tolist())  # B went first
    assert cache.evict(2) == 2
    assert cache.all_slots() == set(sa.tolist())
    check(cache, pool)


def test_evict_leaves_before_parents():
    pool = make_pool()
    cache = RadixCache(pool)
    a = alloc(pool, 3)
    cache.insert([1, 2, 3], a)
    b = alloc(pool, 3)
    assert cache.insert([1, 2, 4], b) == 2
    pool.free(b[:2])
    cache.match_prefix([1, 2])  # touches the parent; it still cannot go before its leaves
    assert cache.evict(1) == 1
    assert cache.evict(1) == 1
    assert cache.all_slots() == set(a[:2].tolist())
    assert cache.evict(0) == 0
    check(cache, pool)


def test_flush_frees_everything():
    pool = make_pool()
    cache = RadixCache(pool)
    cache.insert([1, 2, 3], alloc(pool, 3))
    cache.insert([4, 5], alloc(pool, 2))
    assert cache.flush() is True
    assert pool.used() == 0 and cache.total_size() == 0 and cache.all_slots() == set()
    assert cache.match_prefix([1, 2, 3])[0].numel() == 0
    check(cache, pool)


def test_flush_keeps_root_valid_for_holders():
    pool = make_pool()
    cache = RadixCache(pool)
    _, root = cache.match_prefix([1])  # nothing cached: the holder gets the root
    cache.inc_lock(root)
    cache.insert([2, 3], alloc(pool, 2))
    assert cache.flush() is True
    cache.dec_lock(root)
    cache.insert([1], alloc(pool, 1))
    assert cache.match_prefix([1])[1].parent is cache.root
    check(cache, pool)


def test_lock_after_eviction_is_caught():
    pool = make_pool()
    cache = RadixCache(pool)
    cache.insert([1, 2], alloc(pool, 2))
    _, node = cache.match_prefix([1, 2])
    cache.evict(2)
    with pytest.raises(AssertionError):
        cache.inc_lock(node)


def test_disabled_keeps_nothing():
    pool = make_pool()
    cache = RadixCache(pool, enabled=False)
    s = alloc(pool, 3)
    prefix, node = cache.match_prefix([1, 2, 3])
    assert prefix.numel() == 0 and node is cache.root
    cache.inc_lock(node)
    n = cache.insert([1, 2, 3], s)
    assert n == 3
    pool.free(s[len(prefix):n])  # the same rule as when enabled frees all of them
    cache.dec_lock(node)
    assert cache.match_prefix([1, 2, 3])[0].numel() == 0
    assert cache.total_size() == 0 and cache.evict(10) == 0 and cache.flush() is True
    assert pool.used() == 0
    check(cache, pool)


def test_request_protocol_with_concurrent_duplicate():
    pool = make_pool()
    cache = RadixCache(pool)
    cache.insert([1, 2], alloc(pool, 2))
    # request X matches [1, 2], computes [3, 4] itself
    x_prefix, x_node = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock(x_node)
    x_slots = torch.cat([x_prefix, alloc(pool, 2)])
    # request Y caches [1, 2, 3] meanwhile
    y_slots = torch.cat([cache.match_prefix([1, 2, 3])[0], alloc(pool, 1)])
    pool.free(y_slots[2:cache.insert([1, 2, 3], y_slots)])
    # X finishes: [1, 2] were the tree's, [3] is a duplicate, [4] is new
    m = len(x_prefix)
    n = cache.insert([1, 2, 3, 4], x_slots)
    assert (m, n) == (2, 3)
    pool.free(x_slots[m:n])
    cache.dec_lock(x_node)
    got, _ = cache.match_prefix([1, 2, 3, 4])
    assert got.tolist() == y_slots.tolist() + x_slots[3:].tolist()
    check(cache, pool)


def test_deep_tree_is_iterative():
    pool = make_pool(6000)
    cache = RadixCache(pool)
    tokens = list(range(5000))
    s = alloc(pool, 5000)
    cache.insert(tokens, s)
    for i in range(1, 5000, 2):  # a chain of ~2500 nodes, deeper than the recursion limit
        cache.match_prefix(tokens[:i])
    got, node = cache.match_prefix(tokens)
    assert got.tolist() == s.tolist()
    cache.inc_lock(node)
    cache.dec_lock(node)
    check(cache, pool)
    assert cache.evict(5000) == 5000 and pool.used() == 0
    check(cache, pool)


# ------------------------------------------------------------------------------- model test
TOKENS = st.lists(st.integers(0, 2), min_size=0, max_size=10)


class RadixCacheMachine(RuleBasedStateMachine):
    """Requests match, lock, allocate, extend, cache and finish against a reference dict that maps
    every cached prefix tuple to the slot of its last token."""

    def __init__(self):
        super().__init__()
        self.pool = make_pool(24)
        self.cache = RadixCache(self.pool)
        self.ref: dict[tuple[int, ...], int] = {}
        self.reqs: list[dict] = []  # tokens, slots, m (tree-owned leading slots), node
        self.holds: list[tuple] = []  # (node, prefix) locked by plain matches

    # ---- reference helpers
    def _expected_match(self, tokens: list[int]) -> list[int]:
        out = []
        for i in range(len(tokens)):
            slot = self.ref.get(tuple(tokens[:i + 1]))
            if slot is None:
                break
            out.append(slot)
        return out

    def _match(self, tokens: list[int]):
        slots, node = self.cache.match_prefix(tokens)
        assert slots.tolist() == self._expected_match(tokens)
        return slots, node

    def _insert(self, tokens: list[int], slots: torch.Tensor) -> int:
        expected = len(self._expected_match(tokens))
        n = self.cache.insert(tokens, slots)
        assert n == expected
        for i in range(n, len(tokens)):
            self.ref[tuple(tokens[:i + 1])] = int(slots[i])
        return n

    def _evict(self, k: int) -> int:
        before = self.cache.evictable_size()
        freed = self.cache.evict(k)
        assert freed >= min(k, before) and freed <= before
        assert self.cache.evictable_size() == before - freed
        kept = self.cache.all_slots()
        dropped = [p for p, s in self.ref.items() if s not in kept]
        assert len(dropped) == freed
        for p in dropped:
            del self.ref[p]
        return freed

    def _alloc(self, n: int) -> torch.Tensor | None:
        if self.pool.available() < n:
            self._evict(n - self.pool.available())
        return self.pool.alloc(n)

    # ---- rules
    @rule(tokens=TOKENS)
    def start_request(self, tokens):
        prefix, node = self._match(tokens)
        self.cache.inc_lock(node)
        own = self._alloc(len(tokens) - len(prefix))
        if own is None:
            self.cache.dec_lock(node)
            return
        self.reqs.append(dict(tokens=list(tokens), slots=torch.cat([prefix, own]),
                              m=len(prefix), node=node))

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 99), extra=st.lists(st.integers(0, 2), min_size=1, max_size=4))
    def extend_request(self, i, extra):
        req = self.reqs[i % len(self.reqs)]
        own = self._alloc(len(extra))
        if own is not None:
            req["tokens"] += extra
            req["slots"] = torch.cat([req["slots"], own])

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 99))
    def cache_unfinished_request(self, i):
        req = self.reqs[i % len(self.reqs)]
        m, tokens = req["m"], req["tokens"]
        n = self._insert(tokens, req["slots"])
        assert n >= m
        self.pool.free(req["slots"][m:n])
        slots, node = self._match(tokens)
        assert len(slots) == len(tokens)
        self.cache.inc_lock(node)
        self.cache.dec_lock(req["node"])
        req.update(slots=slots, m=len(tokens), node=node)

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 99), abort=st.booleans())
    def finish_request(self, i, abort):
        req = self.reqs.pop(i % len(self.reqs))
        m = req["m"]
        n = len(req["tokens"]) if abort else self._insert(req["tokens"], req["slots"])
        assert n >= m
        self.pool.free(req["slots"][m:n])
        self.cache.dec_lock(req["node"])

    @rule(tokens=TOKENS, hold=st.booleans())
    def match(self, tokens, hold):
        slots, node = self._match(tokens)
        if hold:
            self.cache.inc_lock(node)
            self.holds.append((node, tuple(tokens[:len(slots)])))

    @precondition(lambda self: self.holds)
    @rule(i=st.integers(0, 99))
    def release(self, i):
        node, _ = self.holds.pop(i % len(self.holds))
        self.cache.dec_lock(node)

    @rule(k=st.integers(0, 20))
    def evict(self, k):
        self._evict(k)

    @rule(roll=st.integers(0, 7))
    def flush(self, roll):
        if roll:  # rare, so the tree gets deep between flushes
            return
        locked = any(r["m"] for r in self.reqs) or any(p for _, p in self.holds)
        ok = self.cache.flush()
        assert ok == (not locked)
        if ok:
            self.ref.clear()

    # ---- invariants
    @invariant()
    def consistent(self):
        held = sum(len(r["slots"]) - r["m"] for r in self.reqs)
        check(self.cache, self.pool, held)
        assert self.cache.all_slots() == set(self.ref.values())
        assert all(p[:-1] in self.ref for p in self.ref if len(p) > 1), "not prefix-closed"
        locked_paths = [tuple(r["tokens"][:r["m"]]) for r in self.reqs] + [p for _, p in self.holds]
        protected = {p[:i] for p in locked_paths for i in range(1, len(p) + 1)}
        assert self.cache.protected_size() == len(protected)
        for r in self.reqs:
            tree_part = r["slots"][:r["m"]].tolist()
            assert tree_part == self._expected_match(r["tokens"])[:r["m"]]


TestRadixCacheMachine = RadixCacheMachine.TestCase
TestRadixCacheMachine.settings = settings(
    max_examples=300, stateful_step_count=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])


def test_cpu_kv_pool_is_zero_without_being_resident():
    """The pool's buffers read as zero, and constructing it leaves them unwritten: the process's
    resident memory grows by a small part of the pool's bytes (pages fault in as slots are used)."""
    if not Path("/proc/self/statm").exists():
        pytest.skip("resident memory is read from Linux's /proc/self/statm")

    def resident() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before = resident()
    pool = KVPool(num_slots=2**16, num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float32)
    grew = resident() - before
    nbytes = sum(b.numel() * b.element_size() for b in pool.kv_buffers)
    assert nbytes == 4 * (2**16 + 1) * 2 * 2 * 64 * 4
    assert grew < nbytes // 8, (grew, nbytes)
    assert all(bool((b == 0).all()) for b in pool.kv_buffers)
