"""Hybrid GPU + CPU experts: a device-cache miss computed on the host instead of fetched over PCIe.

With VLLM_MOE_W2_CACHE_MISS=cpu (or `both`) an MoE layer whose routed experts miss the GPU's
expert cache does not wait for a replay: it learns its misses (one host sync per layer), copies
the few token rows that need them to the host, queues the GPU kernels on its resident experts,
and while those run computes the missing experts on the CPU straight from the host store's rows
(moet.kernels.cpu: the C++ kernel when it is built), then adds their share to the GPU's output.
`both` splits a layer's misses between that and a fetch into the cache (which later steps hit)
so that both finish together, by the rates each path has measured so far (bytes of base per
second; until a path has run, the INITIAL_RATES guesses). The layer's misses are resolved here, so
the replay driver finds none and runs one pass per step.

Not graph-capturable (the host sync per layer): serve with vLLM's --enforce-eager. Bit-level
agreement with the all-GPU forward is not kept (the CPU computes in float32 and its share is added
in the activation dtype); the answer stays within the bf16 band of the resident one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from moet.kernels.cpu import moe_forward
from moet.kernels.oracle import select_moe_backend
from moet.quant.stacked import StackedWeight
from moet.store import ExpertCache

CACHE_MISS_MODES = ("replay", "cpu", "both")
INITIAL_RATES = {"cpu": 8e9, "fetch": 20e9}  # bytes/s before a path has been measured (PCIe 5 x16 ≈ 50 GB/s peak)


def split_misses(experts: Sequence[int], mode: str, cpu_rate: float, fetch_rate: float) -> tuple[list[int], list[int]]:
    """(experts computed on the CPU, experts fetched) for one layer's misses (all the same size).

    `cpu`: all on the CPU. `both`: the CPU takes the share n·c/(c+f) (rounded) that finishes when the
    fetch of the rest does, c and f the two rates; the rest are fetched."""
    experts = list(experts)
    if mode == "cpu":
        return experts, []
    if mode != "both":
        raise ValueError(f"cache miss mode {mode!r}: one of {CACHE_MISS_MODES[1:]}")
    on_cpu = round(len(experts) * cpu_rate / (cpu_rate + fetch_rate))
    return experts[:on_cpu], experts[on_cpu:]


@dataclass
class HybridCounts:
    layers_with_misses: int = 0
    cpu_experts: int = 0
    cpu_pairs: int = 0  # (token, expert) pairs computed on the CPU
    cpu_bytes: int = 0
    cpu_secs: float = 0.0
    fetched_experts: int = 0
    fetch_bytes: int = 0
    fetch_secs: float = 0.0


class HybridExperts:
    """Resolves one MoE layer's device-cache misses on the CPU (and, with `both`, by fetching some)."""

    def __init__(self, cache: ExpertCache, mode: str) -> None:
        if mode not in CACHE_MISS_MODES[1:]:
            raise ValueError(f"cache miss mode {mode!r}: one of {CACHE_MISS_MODES[1:]}")
        self.cache, self.mode = cache, mode
        self.counts = HybridCounts()

    def rates(self) -> tuple[float, float]:
        """(CPU, fetch) bytes of base per second, as measured so far."""
        c = self.counts
        cpu = c.cpu_bytes / c.cpu_secs if c.cpu_secs > 0 else INITIAL_RATES["cpu"]
        fetch = c.fetch_bytes / c.fetch_secs if c.fetch_secs > 0 else INITIAL_RATES["fetch"]
        return cpu, fetch

    def apply(self, layer: Any, x: torch.Tensor, topk_weights: torch.Tensor, ids: torch.Tensor, fp4: Any) -> torch.Tensor:
        """The layer's routed-expert output with every routed expert computed (ids: local expert ids, < 0:
        not on this rank); resident and fetched ones by the device kernels, the rest on the CPU."""
        from moet.vllm.moe_op import routed_moe, zero_weight_fillers

        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("VLLM_MOE_W2_CACHE_MISS=cpu/both syncs with the host in every layer and cannot be "
                               "captured in a CUDA graph: serve with --enforce-eager or set it to replay")
        cache, ordinal, c = self.cache, layer.moet_ordinal, self.counts
        valid = ids >= 0
        slots = cache.lookup(ordinal, ids)
        missed = ids[(slots < 0) & valid].unique().tolist()  # the one host sync of the layer
        cache.missed[ordinal].zero_()  # resolved here: the replay driver has nothing to replay
        on_cpu: list[int] = []
        if missed:
            c.layers_with_misses += 1
            on_cpu, fetch = split_misses(missed, self.mode, *self.rates())
            if fetch:  # what the cache has no room for (its slots hold this pass's experts) goes to the CPU too
                room = cache.room()
                on_cpu, fetch = on_cpu + fetch[room:], fetch[:room]
            if fetch:
                start = time.perf_counter()
                cache.fetch([(ordinal, e) for e in fetch])
                c.fetch_secs += time.perf_counter() - start
                c.fetched_experts += len(fetch)
                c.fetch_bytes += len(fetch) * cache.store.span
                slots = cache.slot_of[ordinal].index_select(0, ids.clamp(min=0).flatten()).view(ids.shape)
        on_gpu = valid & (slots >= 0)
        if on_cpu:
            cpu_ids = torch.full((cache.store.experts,), -1, dtype=torch.int64, device=ids.device)
            cpu_ids[torch.tensor(on_cpu, device=ids.device)] = torch.arange(len(on_cpu), device=ids.device)
            local = torch.where(valid & ~on_gpu, cpu_ids[ids.clamp(min=0).long()], -1)
            rows = (local >= 0).any(-1).nonzero().flatten()
            # the host's inputs are copied before the GPU kernels are queued (a copy after them would wait for them)
            host_x, host_w = x[rows].float().cpu(), topk_weights[rows].float().cpu()
            host_ids = local[rows].cpu()
        gpu_weights, gpu_ids = zero_weight_fillers(on_gpu, topk_weights, slots, cache.slots)
        out = routed_moe(x, gpu_weights, gpu_ids, layer.moet_w13, layer.moet_w2, layer.activation.value, fp4,
                         prefill_fp8=getattr(layer, "moet_prefill_fp8", False))
        if on_cpu:
            start = time.perf_counter()
            backend = select_moe_backend(host_x.device, host_x.shape[0])
            y = moe_forward(host_x, host_w, host_ids, *self._host_experts(ordinal, on_cpu), layer.activation.value, backend=backend)
            out.index_add_(0, rows, y.to(out.device, out.dtype))
            c.cpu_secs += time.perf_counter() - start
            c.cpu_experts += len(on_cpu)
            c.cpu_pairs += int((host_ids >= 0).sum())
            c.cpu_bytes += len(on_cpu) * cache.store.span
        return out

    def _host_experts(self, layer: int, experts: list[int]) -> tuple[StackedWeight, StackedWeight]:
        """The experts' base as stacked host tensors, from the store's rows (one copy of their bytes)."""
        store = self.cache.store
        w13, w2 = store.layout.stacked(torch.stack(store.rows([(layer, e) for e in experts])))
        return tuple(  # type: ignore[return-value]
            StackedWeight(v["codes"], v["scales"], v["row_scale"], store.layout.scale_kind) for v in (w13, w2)
        )

    def kpis(self) -> dict[str, Any]:
        cpu, fetch = self.rates()
        return {**asdict(self.counts), "cpu_gb_s": cpu / 1e9, "fetch_gb_s": fetch / 1e9, "mode": self.mode}
