"""The one `moet: experts …` start-up line of an MoE model: tensor count, tier sizes and bits/weight."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from moet.quant.stacked import StackedWeight

if TYPE_CHECKING:
    from moet.kernels.layout import StackedWeights
from moet.status import write_status


class ExpertSummary:
    """Counts MoE layers as vLLM creates and finishes them; logs once the last one is built."""

    def __init__(self) -> None:
        self.created = 0
        self.done = 0
        self.tensors = 0
        self.weights = 0
        self.base_bytes = 0
        self.tier_bytes = 0
        self.device = "cpu"

    def layer_created(self) -> None:
        self.created += 1

    def layer_done(
        self, w13: "StackedWeight | StackedWeights", w2: "StackedWeight | StackedWeights", device: torch.device,
        fp4_host: list[torch.Tensor] | None = None,
    ) -> None:
        """Count one finished layer: its base where it is served from (`device`), its FP4 tier (the CPU
        path's planes or refinement, or on a GPU the pinned host copies the pool's slots are filled from)."""
        self.done += 1
        self.device = str(device)
        for stack in (w13, w2):
            if isinstance(stack, StackedWeight):
                experts, (n, k) = stack.num_experts, stack.shape
                self.tier_bytes += stack.tier_nbytes()
            else:
                experts, n, k = stack.shape
            self.base_bytes += stack.base_nbytes()
            self.weights += experts * n * k
        self.tensors += 3 * experts  # gate, up and down per expert
        self.tier_bytes += sum(t.numel() * t.element_size() for t in fp4_host or ())
        if self.done == self.created:
            self.report()

    def line(self) -> str:
        bits = 8 * self.base_bytes / max(self.weights, 1)
        tier_bits = 8 * self.tier_bytes / max(self.weights, 1)
        tier_where = "host copies for the GPU pool" if self.device.startswith("cuda") else self.device
        return (
            f"moet: experts {self.tensors} tensors in {self.done} layers, {self.weights / 1e6:.1f}M weights; "
            f"2-bit base {self.base_bytes / 2**20:.1f} MiB on {self.device} ({bits:.2f} bits/weight); "
            f"FP4 tier {self.tier_bytes / 2**20:.1f} MiB on {tier_where} ({tier_bits:.2f} bits/weight)"
        )

    def report(self) -> None:
        print(self.line(), flush=True)
        write_status(
            {
                "pid": os.getpid(),
                "expert_tensors": self.tensors,
                "expert_weights": self.weights,
                "base_bytes": self.base_bytes,
                "tier_bytes": self.tier_bytes,
                "base_device": self.device,
            }
        )

