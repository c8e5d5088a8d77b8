"""The one `moet: experts …` start-up line: tensor count, tier sizes and bits/weight, per process."""

from __future__ import annotations

import os

from moet.quant.stacked import StackedWeight
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

    def layer_created(self) -> None:
        self.created += 1

    def layer_done(self, w13: StackedWeight, w2: StackedWeight) -> None:
        self.done += 1
        self.tensors += 3 * w13.num_experts  # gate, up and down per expert
        for stack in (w13, w2):
            n, k = stack.shape
            self.weights += stack.num_experts * n * k
            self.base_bytes += stack.base_nbytes()
            self.tier_bytes += stack.tier_nbytes()
        if self.done == self.created:
            self.report()

    def line(self) -> str:
        bits = 8 * self.base_bytes / max(self.weights, 1)
        tier_bits = 8 * self.tier_bytes / max(self.weights, 1)
        return (
            f"moet: experts {self.tensors} tensors in {self.done} layers, {self.weights / 1e6:.1f}M weights; "
            f"2-bit base {self.base_bytes / 2**20:.1f} MiB ({bits:.2f} bits/weight); "
            f"FP4 tier {self.tier_bytes / 2**20:.1f} MiB ({tier_bits:.2f} bits/weight)"
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
            }
        )


SUMMARY = ExpertSummary()
