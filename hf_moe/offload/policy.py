"""Eviction policies of the expert cache. Keys are (MoE layer, expert).

Chosen by measurement on routing traces (benchmarks/offload.py replays recorded traces through each policy with
`simulate.py`; the numbers are in the README). The pattern is unusual for a cache: every decoding step visits the
layers in order, so the distance to an expert's next use is about one full sweep for all of them, and recency says
little (LRU degenerates on a loop longer than the cache). What an expert is worth is how often its layer picks it.

    lru        least recently used
    lfu        least frequently used, counting every use since loading (ties: least recent)
    lfu_decay  frequency with exponential forgetting, half-life `half_life` uses (ties: least recent)
    next_use   the default: the expert whose next use is expected farthest away, from its frequency and where its
               layer is in the loop (an online estimate of Belady's rule)

next_use is the default because it had the highest hit rate of the online policies on the routing traces replayed
by benchmarks/offload.py, closest to the offline optimum (Belady); LRU suffers most when the layer loop is longer
than the cache (the numbers: docs/offload.md).
"""

from __future__ import annotations

import math
from typing import Hashable, Iterable

Key = Hashable


class CachePolicy:
    """Decides which resident expert leaves when a slot is needed."""

    name = "base"

    def __init__(self):
        self.clock = 0
        self.last: dict[Key, int] = {}

    def visit(self, layer: int, num_layers: int) -> None:
        """A forward of MoE layer `layer` (of `num_layers`) begins; its uses follow."""

    def use(self, key: Key) -> None:
        """A layer used the expert (whether it was resident or not)."""
        self.clock += 1
        self.last[key] = self.clock

    def insert(self, key: Key) -> None:
        """The expert became resident (fetched on demand or ahead)."""
        self.last.setdefault(key, self.clock)

    def score(self, key: Key) -> float:
        """Higher is kept longer."""
        raise NotImplementedError

    def victim(self, candidates: Iterable[Key]) -> Key:
        return min(candidates, key=lambda k: (self.score(k), self.last.get(k, -1)))


class LRU(CachePolicy):
    name = "lru"

    def insert(self, key: Key) -> None:
        self.last[key] = self.clock  # a fetched expert counts as just used

    def score(self, key: Key) -> float:
        return self.last.get(key, -1)


class LFU(CachePolicy):
    name = "lfu"

    def __init__(self):
        super().__init__()
        self.count: dict[Key, int] = {}

    def use(self, key: Key) -> None:
        super().use(key)
        self.count[key] = self.count.get(key, 0) + 1

    def score(self, key: Key) -> float:
        return self.count.get(key, 0)


class DecayedLFU(LFU):
    """Each use adds 2**(clock / half_life); comparing these sums is comparing frequencies that halve every
    `half_life` uses, without touching every entry at each step. Rescaled before the numbers overflow."""

    name = "lfu_decay"

    def __init__(self, half_life: float = 4096):
        super().__init__()
        self.half_life = half_life
        self.weight: dict[Key, float] = {}
        self._base = 0

    def use(self, key: Key) -> None:
        super().use(key)
        exponent = (self.clock - self._base) / self.half_life
        if exponent > 512:  # rescale everything by 2**-exponent
            factor = 2.0 ** -exponent
            self.weight = {k: w * factor for k, w in self.weight.items()}
            self._base = self.clock
            exponent = 0.0
        self.weight[key] = self.weight.get(key, 0.0) + math.pow(2.0, exponent)

    def score(self, key: Key) -> float:
        return self.weight.get(key, 0.0)


class NextUse(LFU):
    """Belady's rule with an estimated future: evict the expert whose next use is expected farthest away.

    The layers run in a loop, so expert e of layer j is next wanted, if at all, when layer j next runs: d layer
    steps from now (d = (j - current) mod L, 0 < d <= L), then once per sweep with probability p, the share of
    layer j's forwards that used it (counted, smoothed). Expected distance: d + L * (1 - p) / p. LFU ranks by p
    alone; this also evicts, among equally likely experts, the one whose layer has just run (LFU's ties go to
    recency, which picks the opposite in a loop).
    """

    name = "next_use"

    def __init__(self):
        super().__init__()
        self.visits: dict[int, int] = {}
        self.layer, self.num_layers = 0, 1

    def visit(self, layer: int, num_layers: int) -> None:
        self.layer, self.num_layers = layer, num_layers
        self.visits[layer] = self.visits.get(layer, 0) + 1

    def score(self, key: Key) -> float:
        layer = key[0]
        p = (self.count.get(key, 0) + 0.5) / (self.visits.get(layer, 0) + 1.0)
        p = min(p, 1.0)
        d = (layer - self.layer - 1) % self.num_layers + 1
        return -(d + self.num_layers * (1.0 - p) / p)


POLICIES = {"lru": LRU, "lfu": LFU, "lfu_decay": DecayedLFU, "next_use": NextUse}
DEFAULT_POLICY = "next_use"


def make_policy(name: str, **options) -> CachePolicy:
    if name not in POLICIES:
        raise ValueError(f"Unknown expert cache policy {name!r}: choose one of {', '.join(POLICIES)}.")
    return POLICIES[name](**options)
