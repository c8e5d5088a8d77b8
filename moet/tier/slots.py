"""The FP4 pool's slots in VRAM: FP4 copies filled on commit from pinned host copies, and the device slot table.

moet.tier.pool decides which experts hold a slot (on the host); this module makes the GPU agree
with it between steps, without a host synchronisation inside any forward:

* `apply(changes, table)` runs after `FP4Pool.commit()`. On a side stream it copies each promoted
  expert's FP4 words (both projections) from its pinned host copy into its slot, then the new
  table (from a pinned buffer) into the device table; the compute stream waits on an event
  before the next forward. Copies into slots the last table still pointed at (evictions) first wait
  for the work already queued on the compute stream, so no running forward sees a slot change;
  copies into free slots overlap it.
* The forward reads `layer_slots(layer)`: views of fixed storage (table row, slot planes), so a
  captured CUDA graph keeps reading the current table.

The CPU serving path needs none of this (every FP4 tier is in host memory: the pool's mask is used
directly); on a CPU device the class still works, copying synchronously, which is how its tests run.
"""

from __future__ import annotations

import torch

from moet.tier.pool import Changes


class DeviceSlots:
    """`slots` FP4 copies of one expert's w13 and w2 words on `device`, for `layers` × `experts` experts."""

    def __init__(
        self,
        slots: int,
        layers: int,
        experts: int,
        w13_shape: tuple[int, ...],
        w2_shape: tuple[int, ...],
        device: torch.device,
    ) -> None:
        self.device = torch.device(device)
        self.w13 = torch.zeros(max(slots, 1), *w13_shape, dtype=torch.int32, device=self.device)
        self.w2 = torch.zeros(max(slots, 1), *w2_shape, dtype=torch.int32, device=self.device)
        # layers·E entries then one −1: the entry an empty device-cache slot reads (`cache_slots`)
        self._flat = torch.full((layers * experts + 1,), -1, dtype=torch.int32, device=self.device)
        self.table = self._flat[:-1].view(layers, experts)
        self._by_cache_slot: torch.Tensor | None = None
        self.host13: list[torch.Tensor | None] = [None] * layers
        self.host2: list[torch.Tensor | None] = [None] * layers
        cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self._tables = [torch.full((layers, experts), -1, dtype=torch.int32, pin_memory=cuda) for _ in range(2)]
        self._done: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self.copied_bytes = 0

    @property
    def nbytes(self) -> int:
        """VRAM the slots take (the table is negligible)."""
        return self.w13.numel() * 4 + self.w2.numel() * 4

    def set_host(self, layer: int, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """The pinned host FP4 words [E, ...] of one layer's experts (copied from on promotion)."""
        self.host13[layer], self.host2[layer] = w13, w2

    def layer_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(slot table row int32 [E], w13 slot words, w2 slot words): what moet.kernels.layout.Fp4Slots holds."""
        return self.table[layer], self.w13, self.w2

    def cache_slots(self, owners: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Under the device expert cache: (table per cache slot int32 [S], w13, w2), where `owners` [S] int64
        holds the layer·E + expert each cache slot holds (layers·E: none). Gathered on the device into one
        fixed buffer, so a captured graph recomputes it from the current tables on every replay."""
        if self._by_cache_slot is None or self._by_cache_slot.shape != owners.shape:
            self._by_cache_slot = torch.empty(owners.shape, dtype=torch.int32, device=self.device)
        torch.index_select(self._flat, 0, owners, out=self._by_cache_slot)
        return self._by_cache_slot, self.w13, self.w2

    def apply(self, changes: Changes, table: torch.Tensor) -> None:
        """Make the device hold `table` (the pool's committed host table) and the promoted experts' copies."""
        if not changes:
            return
        if self.stream is None:
            self._copy(changes.promoted)
            self.table.copy_(table)
            return
        compute = torch.cuda.current_stream(self.device)
        queued = torch.cuda.Event()
        queued.record(compute)
        pinned = self._tables[self._turn]
        if self._done[self._turn] is not None:
            self._done[self._turn].synchronize()  # the copy that last read this buffer (two commits ago)
        pinned.copy_(table)
        reused = {slot for _, _, slot in changes.evicted}
        with torch.cuda.stream(self.stream):
            if reused & {slot for _, _, slot in changes.promoted}:
                self.stream.wait_event(queued)
            self._copy(changes.promoted)
            self.stream.wait_event(queued)
            self.table.copy_(pinned, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        self._done[self._turn] = done
        self._turn ^= 1
        compute.wait_event(done)

    def _copy(self, promoted: list[tuple[int, int, int]]) -> None:
        for layer, expert, slot in promoted:
            for planes, host in ((self.w13, self.host13[layer]), (self.w2, self.host2[layer])):
                if host is None:
                    raise RuntimeError(f"layer {layer} has no host FP4 copies: set_host() it before promoting its experts")
                planes[slot].copy_(host[expert], non_blocking=self.stream is not None)
                self.copied_bytes += host[expert].numel() * 4
