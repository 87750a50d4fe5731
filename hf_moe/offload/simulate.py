"""Replaying routing traces through the expert cache, to compare policies and prefetching by measurement.

A trace is what `ExpertCache.trace` records: one [layer, experts used, experts predicted for layer + 1] per MoE
layer forward. `simulate` drives a real `ExpertCache` (same placement, pinning and prefetch code) over a store that
reads nothing, so the hit rates are those the cache would have had. `Belady` (evict the expert used farthest in the
future) needs the whole trace: it is the upper bound the online policies are measured against.
"""

from __future__ import annotations

import bisect
from collections import defaultdict

import torch

from .cache import ExpertCache
from .fetch import InlineFetcher
from .policy import CachePolicy, make_policy
from .stats import CacheStats
from .store import ExpertLayout


class Belady(CachePolicy):
    """Offline optimum for demand fetching: evict the expert whose next use is farthest away (or never)."""

    name = "belady"

    def __init__(self, trace: list):
        super().__init__()
        self._uses: dict[tuple[int, int], list[int]] = defaultdict(list)
        position = 0
        for layer, experts, _ in trace:
            for e in experts:
                self._uses[layer, e].append(position)
                position += 1
        self._now = 0

    def use(self, key) -> None:
        super().use(key)
        self._now += 1

    def score(self, key) -> float:
        uses = self._uses.get(key, [])
        i = bisect.bisect_left(uses, self._now)
        return -(uses[i] if i < len(uses) else float("inf"))  # lower score leaves first: the farthest next use


class _NullStore:
    directory = "(trace)"

    def dtype(self) -> torch.dtype:
        return torch.float32

    def read_into(self, layer, expert, dst) -> int:
        return 0

    def close(self) -> None:
        pass


def simulate(trace: list, num_experts: int, num_slots: int, top_k: int, policy: str | CachePolicy,
             prefetch: bool) -> CacheStats:
    """Stats of a cache of `num_slots` experts with `policy` ("belady" for the offline bound) over `trace`."""
    num_layers = 1 + max(layer for layer, _, _ in trace)
    layout = ExpertLayout({"gate_up_proj": (2, 1), "down_proj": (1, 1)}, tuple(map(str, range(num_layers))),
                          num_experts, top_k, True, False, "silu")
    if policy == "belady":
        policy = Belady(trace)
    elif isinstance(policy, str):
        policy = make_policy(policy)
    cache = ExpertCache(_NullStore(), layout, num_slots * layout.expert_bytes(torch.float32), [None] * num_layers,
                        torch.device("cpu"), torch.float32, policy=policy, prefetch=prefetch,
                        fetcher_class=InlineFetcher)
    for layer, experts, predicted in trace:
        passes = cache.begin(layer, experts)
        for chunk in passes:
            cache.acquire(layer, chunk, predicted if prefetch and len(passes) == 1 else None)
            cache.release()
    return cache.stats
