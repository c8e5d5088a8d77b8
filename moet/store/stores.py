"""Host-side expert stores the device cache fetches from: all pinned, pack only, or pack + arena.

Each hands out the first `span` bytes (the base) of the rows asked for as host views (pinned when
the device is a GPU), which the device cache copies straight into its slots: hits of the pinned
and arena stores are zero-copy, the pack-only store reads a batch into its staging buffer.
"""

from __future__ import annotations

import json
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

import torch

from moet.quant.codebook import QuantizedWeight
from moet.store.arena import Key, SegmentedLRU
from moet.store.atomic import replace_file
from moet.store.layout import RowLayout
from moet.store.pack import Pack
from moet.store.reader import RowReader, aligned_empty

log = logging.getLogger("moet.store")

AUTO_RAM_SHARE = 0.75  # base_ram_gb=auto: this share of MemAvailable at boot


@dataclass
class StoreStats:
    """Host-tier counters: arena hits and misses, and what the pack reads cost."""

    hits: int = 0
    misses: int = 0
    read_bytes: int = 0
    read_secs: float = 0.0


class ExpertStore(ABC):
    """All rows of a rank's routed experts, layers × experts, each `span` bytes handed out."""

    def __init__(self, layout: RowLayout, experts: int, layers: int, span: int) -> None:
        self.layout, self.experts, self.layers, self.span = layout, experts, layers, span
        self.stats = StoreStats()

    capacity: int | None = None  # most keys one `rows` call takes (None: any number)

    @abstractmethod
    def rows(self, keys: Sequence[Key], decode: bool = True) -> list[torch.Tensor]:
        """Host views (uint8 [span]) of the rows of distinct `keys`, valid until the next call.

        `decode` says the rows serve a decode step (the hot set) rather than a prefill scan.
        """

    @abstractmethod
    def host_bytes(self) -> int:
        """Host memory this store holds for rows."""

    def persist(self) -> None:
        """Save what the next boot should know (the arena's hot set); called with every KPI report."""

    def close(self) -> None:
        """Release files and threads."""


class PinnedStore(ExpertStore):
    """The whole base in (pinned) host memory: every row is a zero-copy view, no I/O."""

    def __init__(self, table: torch.Tensor, layout: RowLayout, experts: int, layers: int) -> None:
        super().__init__(layout, experts, layers, table.shape[1])
        self.table = table  # uint8 [layers · experts, span]

    @classmethod
    def from_weights(cls, layout: RowLayout, weights: Sequence[Sequence[Sequence[QuantizedWeight]]], pin: bool = False) -> "PinnedStore":
        """From quantized experts in memory, weights[layer][expert] = that expert's matrices (no pack)."""
        layers, experts = len(weights), len(weights[0])
        rows = aligned_empty(layers * experts, layout.base_span, pin)
        scratch = torch.empty(layout.stride, dtype=torch.uint8)
        for layer, per_expert in enumerate(weights):
            for expert, mats in enumerate(per_expert):
                layout.write_row(scratch, layer, expert, mats)
                rows[layer * experts + expert].copy_(scratch[: layout.base_span])
        return cls(rows, layout, experts, layers)

    @classmethod
    def from_pack(cls, pack: Pack, threads: int = 4, direct: bool = False, pin: bool = False) -> "PinnedStore":
        """Boot: read every row's base from the pack (no re-quantization)."""
        span = pack.layout.base_span
        rows = aligned_empty(pack.layers * pack.experts, span, pin)
        reader = RowReader(pack, threads, direct)
        try:
            keys = [(layer, expert) for layer in range(pack.layers) for expert in range(pack.experts)]
            reader.read(keys, list(rows))
        finally:
            reader.close()
        return cls(rows, pack.layout, pack.experts, pack.layers)

    def row(self, layer: int, expert: int) -> torch.Tensor:
        return self.table[layer * self.experts + expert]

    def rows(self, keys: Sequence[Key], decode: bool = True) -> list[torch.Tensor]:
        self.stats.hits += len(keys)
        return [self.table[layer * self.experts + expert] for layer, expert in keys]

    def host_bytes(self) -> int:
        return self.table.numel()


class PackStore(ExpertStore):
    """Nothing resident: every call reads its rows from the pack, in one batch on the reader pool."""

    def __init__(self, pack: Pack, threads: int = 4, direct: bool = False, pin: bool = False) -> None:
        super().__init__(pack.layout, pack.experts, pack.layers, pack.layout.base_span)
        self.pack, self.pin = pack, pin
        self.reader = RowReader(pack, threads, direct)
        self.staging = aligned_empty(0, self.span, pin)

    def rows(self, keys: Sequence[Key], decode: bool = True) -> list[torch.Tensor]:
        if self.staging.shape[0] < len(keys):
            self.staging = aligned_empty(max(len(keys), 2 * self.staging.shape[0]), self.span, self.pin)
        dests = list(self.staging[: len(keys)])
        self._read(keys, dests)
        return dests

    def _read(self, keys: Sequence[Key], dests: Sequence[torch.Tensor]) -> None:
        start = time.perf_counter()
        self.stats.read_bytes += self.reader.read(keys, dests)
        self.stats.read_secs += time.perf_counter() - start
        self.stats.misses += len(keys)

    def host_bytes(self) -> int:
        return 0

    def close(self) -> None:
        self.reader.close()


class ArenaStore(PackStore):
    """An MRU arena of host slots over the pack; hits are zero-copy views of the arena."""

    def __init__(self, pack: Pack, arena_bytes: int, threads: int = 4, direct: bool = False, pin: bool = False,
                 protected_share: float = 0.8) -> None:
        super().__init__(pack, threads, direct, pin)
        slots = arena_bytes // self.span
        if slots < 1:
            raise ValueError(f"an arena of {arena_bytes} bytes holds no row of {self.span} bytes")
        self.buffer = aligned_empty(slots, self.span, pin)
        self.lru = SegmentedLRU(slots, protected_share)
        self.capacity = slots
        self.heat_path = pack.path.with_suffix(".heat.json")

    def row(self, layer: int, expert: int, decode: bool = True) -> torch.Tensor:
        """A zero-copy view of the row in the arena (loaded first if absent)."""
        return self.buffer[self._resident([(layer, expert)], decode)[0]]

    def rows(self, keys: Sequence[Key], decode: bool = True) -> list[torch.Tensor]:
        if len(keys) > self.lru.slots:
            raise ValueError(f"{len(keys)} rows asked of an arena of {self.lru.slots} slots")
        return [self.buffer[slot] for slot in self._resident(keys, decode)]

    def preheat(self) -> int:
        """Load the hot set of the last run (heat file) into the protected segment; returns rows loaded."""
        try:
            heat = json.loads(self.heat_path.read_text())
        except (OSError, ValueError):
            return 0
        side = self.pack.sidecar
        if heat.get("identity") != side.identity or heat.get("abi") != side.abi:
            log.info("heat file %s is for another pack; ignored", self.heat_path)
            return 0
        keys = [(int(l), int(e)) for l, e in heat.get("hot", [])
                if 0 <= int(l) < self.layers and 0 <= int(e) < self.experts][: self.lru.protected_cap]
        self._resident(sorted(keys), decode=True)  # fewer than the arena's slots: one batch in file order
        return len(keys)

    def persist(self) -> None:
        self.save_heat()

    def save_heat(self) -> None:
        """Persist the decode hot set (most recent first) for the next boot's preheat."""
        side = self.pack.sidecar
        record = {"identity": side.identity, "abi": side.abi, "hot": [list(k) for k in self.lru.hot()]}
        replace_file(self.heat_path, json.dumps(record).encode())

    def host_bytes(self) -> int:
        return self.buffer.numel()

    def _resident(self, keys: Sequence[Key], decode: bool) -> list[int]:
        """Arena slots of `keys` (at most `slots` distinct), reading the absent ones in one batch."""
        pinned = frozenset(keys)
        slots, absent, absent_slots = [], [], []
        for key in keys:
            slot = self.lru.slot(key)
            if slot is None:
                slot, _ = self.lru.insert(key, pinned, decode)
                absent.append(key)
                absent_slots.append(slot)
            else:
                self.lru.touch(key, decode)
            slots.append(slot)
        self.stats.hits += len(keys) - len(absent)
        if absent:
            order = sorted(range(len(absent)), key=lambda i: (absent[i], absent_slots[i]))
            self._read([absent[i] for i in order], [self.buffer[absent_slots[i]] for i in order])
        return slots


def open_store(
    pack: Pack,
    ram_gb: Union[float, str, None],
    threads: int = 4,
    direct: bool = False,
    pin: bool = False,
    preheat: bool = True,
) -> ExpertStore:
    """The host tier for a pack: ram_gb None/0 → all pinned, 'auto' or N → arena of N GiB (all pinned if the base fits).

    A pack-only store (no host residency) is `PackStore(pack)`.
    """
    base = pack.layers * pack.experts * pack.layout.base_span
    if ram_gb in (None, 0, 0.0):
        return PinnedStore.from_pack(pack, threads, direct, pin)
    arena = int(_available_bytes() * AUTO_RAM_SHARE) if ram_gb == "auto" else int(float(ram_gb) * 2**30)
    if arena >= base:
        return PinnedStore.from_pack(pack, threads, direct, pin)
    store = ArenaStore(pack, arena, threads, direct, pin)
    if preheat:
        log.info("arena %s: preheated %d hot rows", store.heat_path, store.preheat())
    return store


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("no MemAvailable in /proc/meminfo")
