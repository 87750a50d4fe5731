"""Which expert sits in which cache slot: host-side bookkeeping only, shared by the cache and the simulator."""

from __future__ import annotations

from typing import Hashable

from .policy import CachePolicy

Key = Hashable


class SlotTable:
    """S slots, each empty or holding one (layer, expert). A slot in `pinned` is never evicted (the cache pins
    the experts the running layer computes with, the ones being fetched, and the ones fetched ahead for the next
    layer); the others leave in the order the policy says."""

    def __init__(self, num_slots: int, policy: CachePolicy):
        self.num_slots = num_slots
        self.policy = policy
        self.slot_of: dict[Key, int] = {}
        self.key_of: list[Key | None] = [None] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() gives the lowest slot first

    def __contains__(self, key: Key) -> bool:
        return key in self.slot_of

    def __len__(self) -> int:
        return len(self.slot_of)

    def place(self, key: Key, pinned: set[int]) -> tuple[int, Key | None] | None:
        """A slot for `key` (not resident): a free one, or the policy's victim among the unpinned.

        Returns (slot, evicted key or None), or None when every slot is pinned.
        """
        if self._free:
            slot, evicted = self._free.pop(), None
        else:
            candidates = [k for k, s in self.slot_of.items() if s not in pinned]
            if not candidates:
                return None
            evicted = self.policy.victim(candidates)
            slot = self.slot_of.pop(evicted)
        self.slot_of[key] = slot
        self.key_of[slot] = key
        self.policy.insert(key)
        return slot, evicted

    def drop(self, key: Key) -> None:
        """Forget `key` (a failed read): its slot becomes free."""
        slot = self.slot_of.pop(key)
        self.key_of[slot] = None
        self._free.append(slot)
