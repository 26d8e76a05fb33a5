"""RadixCache: a prefix cache of KV slots keyed by token ids (page size 1), with LRU eviction.

Ownership protocol (the caller is the scheduler):

1. ``slots, node = cache.match_prefix(tokens)``: ``slots`` ([m] int64) are the tree's slots for
   the longest cached prefix ``tokens[:m]``. ``cache.inc_lock(node)`` keeps them from eviction
   while the request uses them; the request must never free them.
2. The request allocates its own slots for ``tokens[m:]``.
3. ``n = cache.insert(tokens, all_slots)`` with ``all_slots = cat(slots, own_slots)``. The tree
   takes ownership of ``all_slots[n:]`` and never of ``all_slots[:n]``. Of those, ``all_slots[:m]``
   are the tree's own slots (from step 1) and ``all_slots[m:n]`` are the caller's duplicates of
   KV another request cached meanwhile: the caller frees exactly ``all_slots[m:n]``.
4. ``cache.dec_lock(node)`` when the request no longer reads the matched prefix.

When disabled, match_prefix returns nothing (m = 0, the root) and insert keeps nothing and
returns ``len(tokens)``, so the same rule "free ``all_slots[m:n]``" frees all of the caller's slots.
"""
from __future__ import annotations

import heapq
from typing import Sequence

import torch

from rollout.batch.kv_pool import SINK_SLOT, KVPool


class _Node:
    __slots__ = ("id", "parent", "children", "key", "value", "lock_ref", "last_access")

    def __init__(self, node_id: int, parent: "_Node | None", key: tuple[int, ...],
                 value: torch.Tensor, last_access: int):
        self.id = node_id
        self.parent = parent
        self.children: dict[int, _Node] = {}  # first token of the child's key -> child
        self.key = key
        self.value = value  # [len(key)] int64 KV slots
        self.lock_ref = 0
        self.last_access = last_access


def _common_len(tokens: tuple[int, ...], start: int, key: tuple[int, ...]) -> int:
    n = min(len(key), len(tokens) - start)
    if tokens[start:start + n] == key[:n]:
        return n
    i = 0
    while tokens[start + i] == key[i]:
        i += 1
    return i


def _as_key(token_ids: Sequence[int] | torch.Tensor) -> tuple[int, ...]:
    if isinstance(token_ids, torch.Tensor):
        return tuple(token_ids.tolist())
    return tuple(token_ids)


class RadixCache:
    """Radix tree over token ids; each node's value holds the KV slots of its key's tokens.

    A node is protected while its lock_ref > 0 (some request reads it); protected nodes are
    never evicted. Eviction frees unlocked leaves in least-recently-used order into kv_pool.
    """

    def __init__(self, kv_pool: KVPool, enabled: bool = True):
        self.kv_pool = kv_pool
        self.enabled = enabled
        self._clock = 0  # NOTE: a counter, not wall time, so eviction order is deterministic
        self._next_id = 0
        self.root = self._new_node(None, (), torch.empty(0, dtype=torch.int64))
        self.root.lock_ref = 1  # NOTE: the root is never evicted or counted in any size
        self._reset()

    # ----------------------------------------------------------------- bookkeeping
    def _reset(self) -> None:
        # NOTE: keeps the root object: requests that matched nothing hold it as their node
        # and call dec_lock(root) after a flush.
        self.root.children = {}
        self._evictable = 0
        self._protected = 0

    def _new_node(self, parent: _Node | None, key: tuple[int, ...], value: torch.Tensor) -> _Node:
        node = _Node(self._next_id, parent, key, value, self._clock)
        self._next_id += 1
        return node

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    # ----------------------------------------------------------------- match / insert
    def match_prefix(self, token_ids: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, _Node]:
        """Longest cached prefix of token_ids: ([m] int64 slots, node ending exactly at m).

        A match ending mid-edge splits that node so the returned node covers exactly the match.
        """
        if not self.enabled:
            return torch.empty(0, dtype=torch.int64), self.root
        path, _ = self._path(_as_key(token_ids), touch=True)
        # NOTE: always a fresh tensor (cat copies, in order), so the caller cannot write into
        # the tree's values.
        values = [node.value for node in path]
        return (torch.cat(values) if values else torch.empty(0, dtype=torch.int64)), (path[-1] if path else self.root)

    def match_len(self, token_ids: Sequence[int] | torch.Tensor) -> int:
        """How many leading tokens of token_ids are cached (match_prefix's m), without touching the
        tree: no split, no access time (a scheduling policy's look at the waiting requests)."""
        return self._path(_as_key(token_ids), touch=False)[1] if self.enabled else 0

    def _path(self, tokens: tuple[int, ...], *, touch: bool) -> tuple[list[_Node], int]:
        """The nodes along tokens' longest cached prefix and its length. touch: the path's nodes are
        accessed now, and a match ending mid-edge splits that edge so the last node ends at it;
        else the path stops before that edge (the length counts it)."""
        now = self._tick() if touch else 0
        node = self.root
        path: list[_Node] = []
        pos = 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = _common_len(tokens, pos, child.key)
            if n < len(child.key):
                if not touch:
                    return path, pos + n
                child = self._split(child, n)
            if touch:
                child.last_access = now
            path.append(child)
            node = child
            pos += n
        return path, pos

    def insert(self, token_ids: Sequence[int] | torch.Tensor,
               slots: torch.Tensor | Sequence[int]) -> int:
        """Caches token_ids -> slots; returns n, the number of leading tokens NOT taken.

        Enabled: n is the length of the prefix that was already cached; the tree keeps its own
        slots for it and ignores slots[:n], and takes ownership of slots[n:]. Disabled: nothing
        is kept and n == len(token_ids). See the module docstring for which of slots[:n] the
        caller must free.
        """
        tokens = _as_key(token_ids)
        slots = torch.as_tensor(slots, dtype=torch.int64)
        assert slots.dim() == 1 and len(slots) == len(tokens), (len(slots), len(tokens))
        if not self.enabled:
            return len(tokens)
        now = self._tick()
        node = self.root
        pos = 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                # NOTE: clone so a caller that later writes into its slots buffer (e.g. a
                # req_to_token row) cannot change cached slots; clone keeps the order.
                leaf = self._new_node(node, tokens[pos:], slots[pos:].clone())
                leaf.last_access = now
                node.children[tokens[pos]] = leaf
                self._evictable += len(leaf.key)
                return pos
            n = _common_len(tokens, pos, child.key)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            node = child
            pos += n
        return pos

    def _split(self, child: _Node, n: int) -> _Node:
        """Splits child's edge after n tokens (0 < n < len); returns the new upper node."""
        assert 0 < n < len(child.key)
        parent = child.parent
        upper = self._new_node(parent, child.key[:n], child.value[:n])
        # NOTE: upper is an ancestor of everything child's lock_ref counts, so it inherits it;
        # the sizes do not change since both halves share one lock state.
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        upper.children = {child.key[n]: child}
        child.parent = upper
        child.key = child.key[n:]
        child.value = child.value[n:]
        parent.children[upper.key[0]] = upper
        return upper

    # ----------------------------------------------------------------- locks
    def inc_lock(self, node: _Node) -> None:
        """Protects node and its ancestors from eviction (counted; pair with dec_lock).

        NOTE: lock the node from match_prefix before anything can evict it (any evict, flush
        or alloc-driven eviction in between); locking an evicted node is an assertion error.
        """
        while node is not self.root:
            assert node.parent.children.get(node.key[0]) is node, "node is no longer in the tree"
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock(self, node: _Node) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, "dec_lock without a matching inc_lock"
            if node.lock_ref == 1:
                self._protected -= len(node.key)
                self._evictable += len(node.key)
            node.lock_ref -= 1
            node = node.parent

    # ----------------------------------------------------------------- eviction
    def evict(self, num_tokens: int) -> int:
        """Frees at least num_tokens slots (fewer only if nothing else is evictable) into kv_pool,
        unlocked leaves first in LRU order; returns how many were freed."""
        if num_tokens <= 0 or self._evictable == 0:
            return 0
        heap = [(n.last_access, n.id, n) for n in self._nodes()
                if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        num_freed = 0
        while num_freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            freed.append(leaf.value)
            num_freed += len(leaf.key)
            self._evictable -= len(leaf.key)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        if freed:
            self.kv_pool.free(torch.cat(freed))
        return num_freed

    def flush(self) -> bool:
        """Frees every cached slot and empties the tree; False (and no change) if any is locked."""
        if self._protected > 0:
            return False
        values = [n.value for n in self._nodes() if n is not self.root]
        if values:
            self.kv_pool.free(torch.cat(values))
        self._reset()
        return True

    # ----------------------------------------------------------------- inspection
    def _nodes(self) -> list[_Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def all_slots(self) -> set[int]:
        slots: set[int] = set()
        for node in self._nodes():
            slots.update(node.value.tolist())
        return slots

    def check_integrity(self) -> None:
        evictable = protected = 0
        seen: set[int] = set()
        count = 0
        for node in self._nodes():
            if node is self.root:
                assert node.parent is None and not node.key and node.lock_ref >= 1
            else:
                assert len(node.key) > 0, "empty edge"
                assert node.parent.children.get(node.key[0]) is node, "child keyed wrongly"
                assert node.lock_ref >= 0, "negative lock_ref"
                if node.parent is not self.root:
                    assert node.parent.lock_ref >= node.lock_ref, "ancestor less locked than child"
                if node.lock_ref > 0:
                    protected += len(node.key)
                else:
                    evictable += len(node.key)
            assert node.value.dtype == torch.int64 and node.value.dim() == 1
            assert len(node.value) == len(node.key), "key and value lengths differ"
            values = node.value.tolist()
            count += len(values)
            seen.update(values)
        assert len(seen) == count, "a slot is cached twice"
        assert SINK_SLOT not in seen, "the sink slot is cached"
        assert evictable == self._evictable, (evictable, self._evictable)
        assert protected == self._protected, (protected, self._protected)
        assert evictable + protected == self.total_size() == count
        assert count <= self.kv_pool.used()
