"""The host arena's replacement policy: which (layer, expert) rows occupy its slots.

Segmented LRU: new rows enter a probation segment; a row touched by a decode step moves to the
protected segment (the decode hot set). Victims come from probation first, so a prefill scan
that streams every expert through the arena churns probation and leaves the hot set in place.
The protected keys, most recent first, are what the heat file persists.
"""

from __future__ import annotations

from collections import OrderedDict

Key = tuple[int, int]


class SegmentedLRU:
    """Slot bookkeeping for `slots` rows; `protected_share` of them may hold the decode hot set."""

    def __init__(self, slots: int, protected_share: float = 0.8) -> None:
        if slots < 1:
            raise ValueError("an arena needs at least one slot")
        self.slots = slots
        self.protected_cap = min(int(slots * protected_share), slots - 1)  # one probation slot always remains
        self.probation: OrderedDict[Key, int] = OrderedDict()  # LRU first
        self.protected: OrderedDict[Key, int] = OrderedDict()
        self.free = list(range(slots - 1, -1, -1))

    def __contains__(self, key: Key) -> bool:
        return key in self.probation or key in self.protected

    def __len__(self) -> int:
        return len(self.probation) + len(self.protected)

    def slot(self, key: Key) -> int | None:
        return self.protected.get(key, self.probation.get(key))

    def touch(self, key: Key, decode: bool) -> None:
        """Record a hit: decode hits join (or refresh) the hot set, other hits only refresh."""
        if key in self.protected:
            self.protected.move_to_end(key)
        elif decode and self.protected_cap:
            self.protected[key] = self.probation.pop(key)
            if len(self.protected) > self.protected_cap:
                old, slot = self.protected.popitem(last=False)
                self.probation[old] = slot  # demoted rows are the next victims after probation's LRU
                self.probation.move_to_end(old, last=False)
        else:
            self.probation.move_to_end(key)

    def insert(self, key: Key, pinned: frozenset[Key] = frozenset(), decode: bool = False) -> tuple[int, Key | None]:
        """A slot for a new key and the key it evicted (None if a slot was free); never evicts `pinned`."""
        evicted = None
        if self.free:
            slot = self.free.pop()
        else:
            evicted = self._victim(pinned)
            slot = self.probation.pop(evicted) if evicted in self.probation else self.protected.pop(evicted)
        self.probation[key] = slot
        if decode:
            self.touch(key, decode=True)
        return slot, evicted

    def hot(self) -> list[Key]:
        """The decode hot set, most recently used first."""
        return list(reversed(self.protected))

    def _victim(self, pinned: frozenset[Key]) -> Key:
        for segment in (self.probation, self.protected):
            for key in segment:
                if key not in pinned:
                    return key
        raise RuntimeError("every arena slot is pinned by the current request")
