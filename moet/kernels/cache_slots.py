"""The device expert cache's slots in the GPU kernels' layout, filled from pack rows on the device.

The host tiers (pack, arena, pinned rows) keep the pack's row bytes, which is what crosses PCIe on
a miss: 2 bits/weight plus scales, no more than the kernels read. The kernels read the mma layout
(moet.kernels.layout), so each arriving row is converted on the GPU, a few rows at a time through a
small staging buffer, and the result is written into the cache's slots. The slots are two
StackedWeights of `slots` experts (w13, w2) at fixed addresses, so a captured CUDA graph keeps
reading them while `fetch` rewrites their contents between passes; the kernels index them with
the slot ids `ExpertCache.lookup` returns.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moet.kernels.layout import StackedWeights
from moet.quant.stacked import StackedWeight
from moet.store.layout import RowLayout

STAGING_ROWS = 16  # rows converted per batch: bounds the staging buffer and the conversion's temporaries


class KernelSlots:
    """`slots` experts of an MoE layer shape (w13 [2I, H], w2 [H, I]) in the kernels' layout on `device`."""

    def __init__(self, layout: RowLayout, slots: int, span: int, device: torch.device) -> None:
        if [name for name, _, _ in layout.matrices] != ["w13", "w2"]:
            raise ValueError(f"the GPU cache holds MoE rows (w13, w2), not {layout.describe()}")
        self.layout = layout
        self.w13, self.w2 = (self._empty(slots, index, device) for index in range(2))
        self.staging = torch.empty(min(STAGING_ROWS, slots), span, dtype=torch.uint8, device=device)
        self.nbytes = self.w13.base_nbytes() + self.w2.base_nbytes()

    def _empty(self, slots: int, matrix: int, device: torch.device) -> StackedWeights:
        """Zeroed slots of one projection, shaped by converting one zero expert (the layout owns the shapes)."""
        _, n, k = self.layout.matrices[matrix]
        probe = StackedWeight.empty(1, n, k, self.layout.scale_kind)
        one = StackedWeights.from_stacked(probe, torch.device("cpu"), gate_up=matrix == 0)
        return StackedWeights(
            words=torch.zeros(slots, *one.words.shape[1:], dtype=one.words.dtype, device=device),
            scales=torch.zeros(slots, *one.scales.shape[1:], dtype=one.scales.dtype, device=device),
            scale_kind=one.scale_kind,
            row_scale=torch.zeros(slots, *one.row_scale.shape[1:], dtype=torch.float32, device=device),
        )

    def write(self, slots: Sequence[int], rows: Sequence[torch.Tensor]) -> None:
        """Copy the rows up (from pinned memory, asynchronously) and convert them into `slots`; all queued on
        the current stream, so the staging buffer is reused in order."""
        device = self.staging.device
        for at in range(0, len(rows), self.staging.shape[0]):
            chunk = rows[at : at + self.staging.shape[0]]
            for i, row in enumerate(chunk):
                self.staging[i].copy_(row[: self.staging.shape[1]], non_blocking=True)
            views = self.layout.stacked(self.staging[: len(chunk)])
            target = torch.tensor(list(slots[at : at + len(chunk)]), dtype=torch.int64, device=device)
            for stack, view, gate_up in ((self.w13, views[0], True), (self.w2, views[1], False)):
                laid = StackedWeights.from_stacked(StackedWeight.from_views(view, stack.scale_kind), device, gate_up)
                for dest, src in ((stack.words, laid.words), (stack.scales, laid.scales), (stack.row_scale, laid.row_scale)):
                    dest.index_copy_(0, target, src)
