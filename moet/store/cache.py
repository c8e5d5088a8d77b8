"""The device expert cache: `slots` expert slots in VRAM (plain tensors on CPU) and its slot table.

The forward asks `lookup(layer, ids)` for slot ids; a missing expert gets −1, so the forward can
compute it as exactly zero, and is recorded on the device: lookup only runs device ops on tensors
it owns (no host sync, no Python value baked in), so it can be captured in a CUDA graph.
After the pass, `fetch` moves all recorded misses as one batch of host→device copies with a single
synchronization.

What a slot holds is the storage's business (`SlotStorage`): by default the pack's own row bytes
(`RowSlots`, what the CPU kernels and the float64 models read); on a GPU the kernels' layout
(moet.kernels.cache_slots), converted on the device as the rows arrive.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from moet.errors import ConfigError, MoetError
from moet.quant.codebook import QuantizedWeight
from moet.store.arena import Key
from moet.store.layout import RowLayout
from moet.store.stores import ExpertStore


class CacheTooSmall(MoetError):
    """One step routes to more experts than the device cache has slots."""


class SlotStorage(Protocol):
    """Where the cache's slots keep their experts, in the form the forward reads."""

    nbytes: int  # device memory the slots take

    def write(self, slots: Sequence[int], rows: Sequence[torch.Tensor]) -> None:
        """Put the host rows (uint8 [span], pack layout) into `slots`, queued on the current stream."""


class RowSlots:
    """Slots as pack rows: one uint8 [span] row per slot, read as stacked views without repacking."""

    def __init__(self, layout: RowLayout, slots: int, span: int, device: torch.device) -> None:
        self.layout = layout
        self.pool = torch.zeros(slots, span, dtype=torch.uint8, device=device)
        self.views = layout.stacked(self.pool)  # per matrix, per field: [slots, ...]
        self.nbytes = self.pool.numel()

    def write(self, slots: Sequence[int], rows: Sequence[torch.Tensor]) -> None:
        for slot, row in zip(slots, rows):
            self.pool[slot].copy_(row, non_blocking=self.pool.is_cuda)


StorageFactory = Callable[[RowLayout, int, int, torch.device], SlotStorage]  # (layout, slots, span, device)


class ExpertCache:
    """`slots` experts (rows of `store.span` bytes each, for sizing) on `device`, any (layer, expert) in any slot."""

    def __init__(self, store: ExpertStore, gib: float | None = None, slots: int | None = None,
                 device: str | torch.device = "cpu", storage: StorageFactory = RowSlots) -> None:
        self.store = store
        self.device = torch.device(device)
        total = store.layers * store.experts
        if slots is None:
            if gib is None:
                raise ValueError("give the cache size in GiB or in slots")
            slots = int(gib * 2**30) // store.span
        slots = min(slots, total)
        if slots < 1:
            raise ConfigError(f"VLLM_MOE_W2_BASE_CACHE_GB={gib} holds no expert row of {store.span / 2**20:.2f} MiB")
        self.slots = slots
        self.storage = storage(store.layout, slots, store.span, self.device)
        self.slot_of = torch.full((store.layers, store.experts), -1, dtype=torch.int64, device=self.device)
        self.missed = torch.zeros(store.layers, store.experts, dtype=torch.int32, device=self.device)
        self.last_use = torch.zeros(slots + 1, dtype=torch.int64, device=self.device)  # [slots] is a sink for misses
        self.counters = torch.zeros(2, dtype=torch.int64, device=self.device)  # lookups, misses
        self.owner: list[Key | None] = [None] * slots
        self.empty_owner = store.layers * store.experts  # `owner_index` of a slot that holds nothing
        self.owner_index = torch.full((slots,), self.empty_owner, dtype=torch.int64, device=self.device)  # layer·E + expert
        self.tick = 0  # one per pass: what the current pass uses cannot be evicted by its fetch
        self.tick_now = torch.zeros((), dtype=torch.int64, device=self.device)  # the same, read by lookup (graph safe)
        self.fetch_bytes = 0
        self.fetch_secs = 0.0
        self.fetches = 0

    def begin_step(self) -> None:
        """A new decode or prefill step (its first pass)."""
        self.begin_pass()

    def begin_pass(self) -> None:
        """A new pass of the current step: misses are recorded afresh."""
        self.tick += 1
        self.tick_now.fill_(self.tick)
        self.missed.zero_()

    def lookup(self, layer: int, expert_ids: torch.Tensor) -> torch.Tensor:
        """Slot ids (int64, −1 = miss) of the experts `expert_ids` of `layer`; misses are recorded. An id < 0
        (an expert of another rank under expert parallelism) gets −1 and is neither looked up nor missed."""
        ids = expert_ids.to(self.device, torch.int64).flatten()
        ours = ids >= 0
        ids = ids.clamp(min=0)
        slots = torch.where(ours, self.slot_of[layer].index_select(0, ids), -1)
        miss = (slots < 0) & ours
        self.missed[layer].index_add_(0, ids, miss.to(torch.int32))
        used = torch.where(ours & ~miss, slots, self.slots)
        self.last_use.index_copy_(0, used, self.tick_now.expand(used.numel()))  # index_fill_ would read the tick on the host
        self.counters[0] += ours.sum()
        self.counters[1] += miss.sum()
        return slots.view(expert_ids.shape)

    def pending(self) -> list[Key]:
        """The distinct (layer, expert) that missed since the pass began (one device→host sync)."""
        return [tuple(k) for k in torch.nonzero(self.missed).tolist()]

    def fetch(self, keys: Sequence[Key], decode: bool = True) -> None:
        """Bring `keys` into the pool as one batch, evicting the least recently used experts that the
        current pass did not use.

        Each row goes host → device straight from where the store holds it (pinned rows, arena slots,
        or the pack reader's pinned staging): the copies are queued back to back on one stream and
        synchronized once, so no host-side gather runs in series with the DMA.
        """
        keys = list(dict.fromkeys(keys))
        if keys:
            present = self.slot_of[tuple(torch.tensor(keys).T)].cpu().tolist()
            keys = [k for k, slot in zip(keys, present) if slot < 0]
        if not keys:
            return
        start = time.perf_counter()
        victims = self._victims(len(keys))
        cuda = self.device.type == "cuda"
        batch = self.store.capacity or len(keys)
        for at in range(0, len(keys), batch):
            if at and cuda:
                torch.cuda.current_stream(self.device).synchronize()  # the store reuses its buffers per call
            self.storage.write(victims[at : at + batch], self.store.rows(keys[at : at + batch], decode))
        target = torch.tensor(victims, dtype=torch.int64, device=self.device)
        gone = [self.owner[s] for s in victims if self.owner[s] is not None]
        if gone:
            self.slot_of[tuple(torch.tensor(gone).T)] = -1
        self.slot_of[tuple(torch.tensor(keys).T)] = target
        self.owner_index[target] = torch.tensor([layer * self.store.experts + e for layer, e in keys], device=self.device)
        for slot, key in zip(victims, keys):
            self.owner[slot] = key
        self.last_use[target] = self.tick
        if cuda:
            torch.cuda.current_stream(self.device).synchronize()
        self.fetch_secs += time.perf_counter() - start
        self.fetch_bytes += len(keys) * self.store.span
        self.fetches += 1

    def expert_weights(self, layer: int, expert_ids: Sequence[int]) -> list[list[QuantizedWeight] | None]:
        """Per expert, its matrices as views of the pool (None for a miss, which is recorded)."""
        slots = self.lookup(layer, torch.tensor(list(expert_ids), dtype=torch.int64)).tolist()
        pool = self.storage.pool  # type: ignore[attr-defined]  # RowSlots: the pack rows themselves
        return [None if s < 0 else self.store.layout.read_row(pool[s]) for s in slots]

    def counts(self) -> tuple[int, int]:
        """(lookups, misses) since start."""
        lookups, misses = self.counters.tolist()
        return lookups, misses

    def room(self) -> int:
        """Slots a fetch may fill now: free ones and those the current pass has not used (one host sync)."""
        last = self.last_use[: self.slots].cpu().tolist()
        return sum(1 for s, k in enumerate(self.owner) if k is None or last[s] < self.tick)

    def _victims(self, n: int) -> list[int]:
        free = [s for s, k in enumerate(self.owner) if k is None]
        if len(free) >= n:
            return free[:n]
        last = self.last_use[: self.slots].cpu().tolist()
        evictable = sorted((s for s, k in enumerate(self.owner) if k is not None and last[s] < self.tick), key=last.__getitem__)
        if len(free) + len(evictable) < n:
            busy = self.slots - len(free) - len(evictable)
            raise CacheTooSmall(
                f"one pass needs {busy + n} experts but the device cache holds {self.slots} "
                f"({self.slots * self.store.span / 2**30:.2f} GiB): raise VLLM_MOE_W2_BASE_CACHE_GB"
            )
        return free + evictable[: n - len(free)]
