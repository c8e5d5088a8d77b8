"""The FP4 pool and the confidence gate inside the engine process.

MoE layers read the pool's `use_fp4[layer]` mask and report the experts each forward pass routes
to; the step hook calls `after_logits` once a step's logits exist. There, with the gate on, the step
goes through `moet.tier.gate.run_gated_step` (promote the step's experts, re-run, to a fixed point);
then the step's routing feeds the pool's decayed frequencies and the pool commits its promotions
and evictions — between steps only, so no forward ever sees a half-updated table.

On CPU every expert's FP4 tier sits in host memory beside its base, so a promotion is a table
update; the pool's size (VLLM_MOE_W2_DELTA_GB) still bounds how many experts run at FP4.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from moet.errors import ConfigError
from moet.knobs import Knobs
from moet.quant.stacked import StackedWeight
from moet.status import write_status
from moet.tier.gate import Gate, run_gated_step
from moet.tier.pool import FP4Pool, pool_slots

logger = logging.getLogger("moet")


class Fp4Runtime:
    """Pool, gate and the routing of the current pass for one engine process."""

    def __init__(self, knobs: Knobs, layers: int, experts: int, expert_tier_bytes: int) -> None:
        if knobs.delta_gb == "auto":
            raise ConfigError("VLLM_MOE_W2_DELTA_GB=auto needs the GPU pool (free memory after the KV cache); give GiB on CPU")
        slots = pool_slots(knobs.delta_gb, expert_tier_bytes, layers * experts)
        self.pool = FP4Pool(layers, experts, slots)
        self.gate = Gate.from_knobs(knobs) if knobs.gate else None
        self.routed = torch.zeros(layers, experts, dtype=torch.bool)
        self.kpi_secs = knobs.kpi_secs
        self._last_report = time.monotonic()
        if slots == layers * experts:  # the pool holds every expert: all of them run at FP4 from the start
            self.pool.request(torch.ones(layers, experts, dtype=torch.bool))
            self.pool.commit(rebalance=False)
        logger.warning("moet: FP4 pool of %d/%d experts, gate %s", slots, layers * experts,
                       self.gate.describe_tau() if self.gate else "off")

    def begin_pass(self) -> None:
        self.routed.zero_()

    def route(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """Record a pass's routing for `layer`; returns that layer's FP4 mask for the forward."""
        valid = ids[ids >= 0].long()
        self.routed[layer, valid] = True
        return self.pool.use_fp4[layer]

    def after_logits(self, logits: torch.Tensor, rerun: Callable[[], torch.Tensor] | None) -> torch.Tensor:
        """The step's final logits: gated to a fixed point when the gate is on (and the step can be
        re-run: `rerun` is None when its sampled rows are unknown); then the pool learns."""
        if self.gate is not None and rerun is not None:
            state = {"logits": logits, "first": True}

            def step() -> tuple[torch.Tensor, torch.Tensor]:
                if not state["first"]:
                    state["logits"] = rerun()
                state["first"] = False
                top1 = torch.softmax(state["logits"].float(), dim=-1).amax(dim=-1)
                return top1, self.routed.clone()

            outcome = run_gated_step(step, self.gate, self.pool, on_commit=lambda changes: None)
            logits = state["logits"]
            self.pool.record(outcome.routed)
        else:
            self.pool.record(self.routed)
        self.pool.propose()
        self.pool.commit(rebalance=True)
        self._maybe_report()
        return logits

    def counters(self) -> dict[str, float | int]:
        return {**self.pool.counters(), **(self.gate.counters() if self.gate else {})}

    def _maybe_report(self) -> None:
        now = time.monotonic()
        if now - self._last_report >= self.kpi_secs:
            self._last_report = now
            counters = self.counters()
            logger.warning("moet: fp4 %s", " ".join(f"{k}={v}" for k, v in counters.items()))
            write_status({"fp4": counters})


_RUNTIME: Fp4Runtime | None = None


def fp4_runtime(knobs: Knobs, layers: int, w13: StackedWeight, w2: StackedWeight) -> Fp4Runtime | None:
    """This process's runtime, built by the first MoE layer that finishes loading (None: FP4 tier off)."""
    global _RUNTIME
    if _RUNTIME is None and knobs.delta_gb != 0:
        per_expert = (w13.tier_nbytes() + w2.tier_nbytes()) // max(w13.num_experts, 1)
        _RUNTIME = Fp4Runtime(knobs, layers, w13.num_experts, per_expert)
    return _RUNTIME


def current_fp4_runtime() -> Fp4Runtime | None:
    return _RUNTIME
