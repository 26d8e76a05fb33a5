"""Which requests of one prefill step share an uncached prompt prefix (so that a later one waits a
step and finds it in the prefix cache instead of computing it again)."""
from __future__ import annotations

from rollout.core.request import Req


class SharedPrefixes:
    """The requests scheduled so far in one prefill step, indexed by their leading tokens.

    A candidate with `cache_len` cached tokens shares at least `min_shared` uncached tokens with a
    scheduled request exactly when both hold the same first `cache_len + min_shared` tokens (in the
    same cache namespace). The scheduled requests' prefixes of each such length are kept in a set,
    built the first time a candidate asks for that length and extended as requests are added: a
    step costs O(requests x distinct lengths x length) instead of a common-prefix scan of every
    candidate against every scheduled request, with a list copy of both, O(requests^2 x length)."""

    def __init__(self, min_shared: int):
        self.min_shared = min_shared
        self._reqs: list[Req] = []
        self._by_key: dict[tuple[int, int], set[tuple[int, ...]]] = {}   # (namespace, length) -> prefixes

    def add(self, req: Req) -> None:
        self._reqs.append(req)
        for (ns, n), prefixes in self._by_key.items():
            if req.cache_ns == ns and req.seq_len >= n:
                prefixes.add(tuple(req.token_span(0, n)))

    def shares(self, req: Req) -> bool:
        """Whether `req` shares at least `min_shared` tokens after its cached ones with a request added."""
        n = req.cache_len + self.min_shared
        if req.seq_len < n or not self._reqs:
            return False
        key = (req.cache_ns, n)
        prefixes = self._by_key.get(key)
        if prefixes is None:
            prefixes = self._by_key[key] = {tuple(o.token_span(0, n)) for o in self._reqs
                                            if o.cache_ns == req.cache_ns and o.seq_len >= n}
        return tuple(req.token_span(0, n)) in prefixes
