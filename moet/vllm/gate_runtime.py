"""The FP4 pool and the confidence gate inside the engine process.

MoE layers report the experts each forward pass routes to (`route`, device ops only: no host sync
per layer) and read back what their forward needs: on CPU the pool's `use_fp4[layer]` mask (every
expert's FP4 tier sits in host memory beside its base, so a promotion is a table update), on the
GPU the slot table and slot planes of `moet.tier.slots.DeviceSlots`. The step hook calls
`after_logits` once a step's logits exist. There, with the gate on, the step goes through
`moet.tier.gate.run_gated_step` (promote the step's experts, re-run, to a fixed point); then the
step's routing feeds the pool's decayed frequencies and the pool commits its promotions and
evictions — between steps only, so no forward ever sees a half-updated table. On the GPU each
commit is published by `DeviceSlots.apply` (side-stream copies, then the table).

Pool size: VLLM_MOE_W2_DELTA_GB GiB of slots (a slot = one expert's FP4 copy, 4 bits/weight on the
GPU), or on the GPU `auto` = the memory left free once vLLM has allocated its KV cache, minus a
reserve (`auto_pool_bytes`): the pool is allocated then (`allocate`), before CUDA graphs are captured.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from moet.kernels.layout import Fp4Slots
from moet.knobs import Knobs
from moet.status import write_status
from moet.tier.gate import Gate, run_gated_step
from moet.tier.pool import GIB, Changes, FP4Pool, pool_slots
from moet.tier.slots import DeviceSlots

logger = logging.getLogger("moet")

AUTO_RESERVE_BYTES = GIB  # left free by delta_gb=auto: allocator fragmentation, NCCL, late workspaces
# On a GPU a rebalancing swap is a copy over PCIe that the next step waits for (an expert of
# DeepSeek-V4-Flash is 12 MiB at FP4: 0.24 ms at 50 GB/s), and near-uniform routing makes heats trade
# places often: rebalance every REBALANCE_STEPS steps, at most REBALANCE_SWAPS swaps (the H200 run of
# 2026-12-03 copied 155 MiB per step with a proposal every step). On the CPU a swap is a table update.
REBALANCE_STEPS = 16
REBALANCE_SWAPS = 8


def auto_pool_bytes(free_bytes: int, reserve_bytes: int = AUTO_RESERVE_BYTES) -> int:
    """delta_gb=auto: the GPU memory still free after the KV cache (and everything else vLLM holds) was
    allocated, minus `reserve_bytes`. Measured after vLLM sized the KV cache from its
    gpu_memory_utilization budget, so the pool only takes what vLLM left outside that budget."""
    return max(0, free_bytes - reserve_bytes)


class Fp4Runtime:
    """Pool, gate, the routing of the current pass and (on a GPU) the slots in VRAM, for one MoE model."""

    def __init__(self, knobs: Knobs, layers: int, experts: int, slot_bytes: int, device: torch.device,
                 agree: Callable[[int], int] | None = None) -> None:
        """`agree`: the largest of a count over the ranks that run each forward together (moet.tier.gate)."""
        self.device = torch.device(device)
        self.agree = agree
        self.on_gpu = self.device.type == "cuda"
        knobs.check_placement(self.device.type)
        self.layers, self.experts, self.slot_bytes = layers, experts, slot_bytes
        self.knobs = knobs
        self.gate = gate_from_knobs(knobs) if knobs.gate else None
        self.routed = torch.zeros(layers, experts + 1, dtype=torch.bool, device=self.device)  # column E: no expert
        self.kpi_secs = knobs.kpi_secs
        self._last_report = time.monotonic()
        self.steps = 0
        self.slots: DeviceSlots | None = None
        self._host: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.pool = FP4Pool(layers, experts, 0)
        self._sized = knobs.delta_gb != "auto"
        if self._sized:
            self._make_pool(pool_slots(knobs.delta_gb, slot_bytes, layers * experts))

    def _make_pool(self, slots: int) -> None:
        self.pool = FP4Pool(self.layers, self.experts, slots)
        if slots == self.layers * self.experts:  # the pool holds every expert: all of them run at FP4 from the start
            self.pool.request(torch.ones(self.layers, self.experts, dtype=torch.bool))
            self.pool.commit(rebalance=False)
        self._make_device_slots()
        logger.warning("moet: FP4 pool of %d/%d experts (%.2f GiB), gate %s", slots, self.layers * self.experts,
                       slots * self.slot_bytes / GIB, self.gate.describe_tau() if self.gate else "off")

    def _make_device_slots(self) -> None:
        """On the GPU, once the pool is sized and every layer's host copies are known: the slots in VRAM,
        filled with what the pool already holds."""
        if not self.on_gpu or self.slots is not None or not self.pool.slots or len(self._host) < self.layers:
            return
        w13, w2 = self._host[0]
        self.slots = DeviceSlots(self.pool.slots, self.layers, self.experts, tuple(w13.shape[1:]), tuple(w2.shape[1:]), self.device)
        for layer, (h13, h2) in self._host.items():
            self.slots.set_host(layer, h13, h2)
        self.slots.apply(Changes(promoted=self.pool.resident()), self.pool.slot_table)

    def add_layer(self, layer: int, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """One MoE layer's FP4 copies on the host (GPU only: pinned int32 words [E, ...] in the kernels' layout)."""
        self._host[layer] = (w13, w2)
        self._make_device_slots()

    def allocate(self) -> None:
        """delta_gb=auto on the GPU: size and allocate the pool now, from the memory left free (call after
        the KV cache is allocated and before graphs are captured)."""
        if self.knobs.delta_gb != "auto" or self._sized:
            return
        self._sized = True
        free, _ = torch.cuda.mem_get_info(self.device)
        budget = auto_pool_bytes(free)
        logger.warning("moet: delta_gb=auto: %.2f GiB free after the KV cache, %.2f GiB kept in reserve",
                       free / GIB, AUTO_RESERVE_BYTES / GIB)
        self._make_pool(min(self.layers * self.experts, budget // self.slot_bytes))

    def begin_pass(self) -> None:
        self.routed.zero_()

    def route(self, layer: int, ids: torch.Tensor, owners: torch.Tensor | None = None) -> torch.Tensor | Fp4Slots | None:
        """Record a pass's routing for `layer` (expert ids; < 0: not on this rank); return what its forward
        reads: the FP4 mask (CPU), the slots (GPU), or None while the GPU pool is empty. Under the device
        expert cache the forward indexes by cache slot: `owners` [slots] holds each slot's layer·E + expert
        (layers·E when empty), and the table returned is per cache slot (GPU only)."""
        flat = ids.reshape(-1).long()
        self.routed[layer].index_fill_(0, torch.where(flat < 0, self.experts, flat), True)
        if not self.on_gpu:
            if owners is not None:
                raise RuntimeError("the FP4 pool over the device expert cache runs on a GPU only")
            return self.pool.use_fp4[layer]
        if self.slots is None:
            return None
        if owners is None:
            return Fp4Slots(*self.slots.layer_slots(layer))
        return Fp4Slots(*self.slots.cache_slots(owners))

    def _publish(self, changes: Changes) -> None:
        if self.slots is not None:
            self.slots.apply(changes, self.pool.slot_table)

    def after_logits(self, logits: torch.Tensor, rerun: Callable[[], torch.Tensor] | None) -> torch.Tensor:
        """The step's final logits: gated to a fixed point when the gate is on (and the step can be
        re-run: `rerun` is None when its sampled rows are unknown); then the pool learns."""
        self.allocate()  # delta_gb=auto without captured graphs (eager): the first step sizes the pool
        if self.gate is not None and rerun is not None and self.pool.slots:
            state = {"logits": logits, "first": True}

            def step() -> tuple[torch.Tensor, torch.Tensor]:
                if not state["first"]:
                    state["logits"] = rerun()
                state["first"] = False
                top1 = torch.softmax(state["logits"].float(), dim=-1).amax(dim=-1)
                return top1, self.routed[:, : self.experts].cpu()

            outcome = run_gated_step(step, self.gate, self.pool, on_commit=self._publish, agree=self.agree)
            logits = state["logits"]
            self.pool.record(outcome.routed)
        else:
            self.pool.record(self.routed[:, : self.experts])
        self.steps += 1
        if not self.on_gpu:
            self.pool.propose()
        elif self.steps % REBALANCE_STEPS == 0:
            self.pool.propose(max_swaps=REBALANCE_SWAPS)
        self._publish(self.pool.commit(rebalance=True))
        self._maybe_report()
        return logits

    def counters(self) -> dict[str, float | int]:
        copied = {} if self.slots is None else {"pool_copied_bytes": self.slots.copied_bytes}
        return {**self.pool.counters(), **copied, **(self.gate.counters() if self.gate else {})}

    def _maybe_report(self) -> None:
        now = time.monotonic()
        if now - self._last_report >= self.kpi_secs:
            self._last_report = now
            counters = self.counters()
            logger.warning("moet: fp4 %s", " ".join(f"{k}={v}" for k, v in counters.items()))
            write_status({"fp4": counters})


def gate_from_knobs(knobs: Knobs) -> Gate:
    """The confidence gate the VLLM_MOE_W2_GATE* knobs describe."""
    return Gate(knobs.gate_tau, knobs.gate_tau_file, knobs.gate_fp_max, knobs.gate_promote_max)
