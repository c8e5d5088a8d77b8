"""Where each part of a model goes on given hardware, whether it fits, and the decode speed to expect.

Per GPU, under tensor parallelism over N GPUs (vLLM takes GPU_MEMORY_UTILIZATION of each card for
weights and KV cache; what the plan puts in VRAM must fit that budget):
- dense weights / N and the 2-bit experts / N, or with VLLM_MOE_W2_BASE_CACHE_GB a cache of that
  many GiB over the host store;
- the FP4 pool: VLLM_MOE_W2_DELTA_GB GiB, or with 'auto' what vLLM leaves outside its budget minus
  1 GiB (moet.vllm.gate_runtime.auto_pool_bytes), at most every expert's FP4 copy;
- the KV cache of one sequence of L tokens (GQA heads split over the ranks, an MLA latent replicated).
Host RAM (all ranks together): the load's staging (one layer's source and its 2-bit result); under
the device cache or a pack, the host store of the 2-bit base (all of it pinned, or an arena of
VLLM_MOE_W2_BASE_RAM_GB over the pack); on a GPU with a pool, the FP4 copies the pool promotes from.
NVMe: the pack (VLLM_MOE_W2_STORE_DIR or --nvme), one 4 KiB-aligned base row per expert.
Without a GPU (vLLM's CPU build) what would be in VRAM is in host RAM.

"Certainly impossible" (what `moet serve` refuses on) counts weights and stores against the whole
card, the whole RAM and the disk's free space; KV cache, pool and vLLM's budget only make a plan
not fit, which `moet plan` refuses and `moet serve` leaves to vLLM.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from moet.knobs import Knobs
from moet.planning.geometry import Geometry
from moet.planning.measured import Measured
from moet.quant.codebook import Tier
from moet.store.atomic import free_bytes
from moet.store.pack import pack_path
from moet.store.stores import AUTO_RAM_SHARE
from moet.tier.pool import GIB
from moet.vllm.gate_runtime import auto_pool_bytes

GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default --gpu-memory-utilization
MAX_SUGGESTED_GPUS = 16
DEFAULT_CONTEXT = 4096  # when config.json names no max_position_embeddings


@dataclass(frozen=True)
class Resources:
    gpus: int
    gpu_bytes: int | None  # per GPU; None: no GPU, vLLM's CPU build
    ram_bytes: int
    store_dir: Path | None
    max_len: int | None  # tokens of KV cache to plan for; None: the model's context window


@dataclass(frozen=True)
class Part:
    name: str
    where: str  # "vram" (per GPU), "ram" or "nvme"
    bytes: int
    note: str


@dataclass
class Plan:
    geometry: Geometry
    device: str  # "gpu" or "cpu"
    gpus: int
    tokens: int
    parts: list[Part]
    capacity: dict[str, int]  # where → what it can hold (VRAM: vLLM's budget per GPU)
    problems: list[str] = field(default_factory=list)  # why it does not fit, with what to try
    impossible: list[str] = field(default_factory=list)  # what no setting of vLLM can make fit
    notes: list[str] = field(default_factory=list)
    tok_s: float | None = None
    constants: list[str] = field(default_factory=list)

    def need(self, where: str) -> int:
        return sum(p.bytes for p in self.parts if p.where == where)

    @property
    def fits(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["need"] = {w: self.need(w) for w in self.capacity}
        out["fits"] = self.fits
        return out


def gib(nbytes: float) -> str:
    """GiB with one decimal, or two below 1 GiB (a small model's parts are not all 0.0)."""
    return f"{nbytes / GIB:.1f}" if nbytes >= GIB else f"{nbytes / GIB:.2f}"


def _pool_bytes(knobs: Knobs, geo: Geometry, gpus: int, outside_budget: int) -> int:
    """The FP4 pool per GPU: knob GiB or 'auto', capped at every expert's FP4 copy."""
    if knobs.delta_gb in (0, 0.0):
        return 0
    every = geo.routed_experts * geo.tier_bytes_per_expert(Tier.PLANES) // gpus
    wanted = auto_pool_bytes(outside_budget) if knobs.delta_gb == "auto" else int(float(knobs.delta_gb) * GIB)
    return min(wanted, every)


def _vram_parts(geo: Geometry, knobs: Knobs, res: Resources, gpus: int, tokens: int) -> list[Part]:
    per = f"1/{gpus} per GPU" if gpus > 1 else "all of it"
    if knobs.base_cache_gb > 0:
        experts = Part("2-bit experts (device cache)", "vram", int(knobs.base_cache_gb * GIB),
                       f"VLLM_MOE_W2_BASE_CACHE_GB={knobs.base_cache_gb:g} over the host store")
    else:
        experts = Part("2-bit experts", "vram", geo.routed_experts * geo.base_bytes_per_expert // gpus,
                       f"{geo.routed_experts} experts × {geo.base_bytes_per_expert / 2**20:.2f} MiB "
                       f"({geo.base_bits_per_weight:.3f} bits/weight), {per}")
    outside = int(res.gpu_bytes * (1 - GPU_MEMORY_UTILIZATION)) if res.gpu_bytes else 0
    pool = _pool_bytes(knobs, geo, gpus, outside) if res.gpu_bytes is not None else 0
    slot = geo.tier_bytes_per_expert(Tier.PLANES)
    if knobs.delta_gb in (0, 0.0):
        pool_note = "off (VLLM_MOE_W2_DELTA_GB=0)"
    elif res.gpu_bytes is None:
        pool_note = "on CPU a table over the host FP4 tier: no bytes of its own"
    else:
        pool_note = (f"VLLM_MOE_W2_DELTA_GB={knobs.delta_gb}: {pool // slot} slots of {slot / 2**20:.2f} MiB"
                     + (", outside vLLM's budget" if knobs.delta_gb == "auto" else ""))
    kv_per_token = geo.kv_bytes(1, gpus)
    return [
        Part("dense weights", "vram", geo.dense_bytes // gpus, f"attention, shared experts, embeddings in the model dtype, {per}"),
        experts,
        Part("FP4 pool", "vram", pool if knobs.delta_gb != "auto" else 0, pool_note),
        Part("KV cache", "vram", geo.kv_bytes(tokens, gpus),
             f"{geo.attention}, {tokens} tokens × {geo.layers} layers × {kv_per_token // geo.layers} B"),
    ]


def _host_parts(geo: Geometry, knobs: Knobs, res: Resources, on_gpu: bool) -> list[Part]:
    expert_source = geo.expert_source_bytes // geo.routed_experts
    parts = [Part("load staging", "ram", expert_source + geo.experts * geo.base_bytes_per_expert,
                  "one layer's 2-bit result and one expert's source, transient")]
    base_rows = geo.routed_experts * geo.layout().base_span
    if knobs.base_cache_gb > 0 or knobs.store_dir is not None or res.store_dir is not None:
        if knobs.base_ram_gb in (0, 0.0):
            arena, how = base_rows, "every base row pinned"
        else:
            arena = int(res.ram_bytes * AUTO_RAM_SHARE) if knobs.base_ram_gb == "auto" else int(float(knobs.base_ram_gb) * GIB)
            arena, how = min(arena, base_rows), f"arena VLLM_MOE_W2_BASE_RAM_GB={knobs.base_ram_gb} over the pack"
        parts.append(Part("host store (2-bit base)", "ram", arena, how))
    if knobs.delta_gb not in (0, 0.0):
        tier = Tier.PLANES if on_gpu else Tier(knobs.fp4_tier)
        parts.append(Part("FP4 tier (host)", "ram", geo.routed_experts * geo.tier_bytes_per_expert(tier),
                          "copies the GPU pool promotes from" if on_gpu else f"{tier}, beside the base"))
    return parts


def _nvme_parts(geo: Geometry, knobs: Knobs, res: Resources) -> tuple[list[Part], Path | None]:
    store = res.store_dir or (Path(knobs.store_dir) if knobs.store_dir else None)
    if store is None:
        return [], None
    layout = geo.layout()
    return [Part("pack", "nvme", geo.routed_experts * layout.stride,
                 f"{store}: {geo.routed_experts} rows of {layout.stride / 2**20:.2f} MiB")], store


def _disk_free(store: Path) -> int:
    """Free bytes where the pack goes, plus a pack already there (it is rewritten in place)."""
    existing = pack_path(store, 0)
    probe = store
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return free_bytes(probe) + (existing.stat().st_size if existing.is_file() else 0)


def _vram_need(geo: Geometry, knobs: Knobs, res: Resources, gpus: int, tokens: int) -> int:
    return sum(p.bytes for p in _vram_parts(geo, knobs, res, gpus, tokens))


def _vram_problem(plan: Plan, knobs: Knobs, res: Resources) -> str:
    geo, gpus, tokens = plan.geometry, plan.gpus, plan.tokens
    budget = plan.capacity["vram"]
    what = " + ".join(f"{p.name} {gib(p.bytes)}" for p in plan.parts if p.where == "vram" and p.bytes)
    tries = []
    counts = [2**p for p in range(1, MAX_SUGGESTED_GPUS.bit_length()) if 2**p > gpus]  # TP splits the heads evenly
    more = next((g for g in counts if _vram_need(geo, knobs, res, g, tokens) <= budget), None)
    if more is not None:
        tries.append(f"--gpus {more}")
    # the device cache takes the room the weights do not; on CPU it does not run beside the FP4 pool (moet.knobs)
    rest = sum(p.bytes for p in plan.parts if p.where == "vram" and p.name in ("dense weights", "KV cache"))
    cache = math.floor((budget - rest) / GIB * 10) / 10
    step_rows = geo.moe_layers * geo.top_k * geo.layout().base_span  # one decode step's experts must fit the cache
    if cache * GIB >= step_rows and (knobs.base_cache_gb == 0 or cache < knobs.base_cache_gb):
        tries.append(f"VLLM_MOE_W2_BASE_CACHE_GB={cache:g} with VLLM_MOE_W2_STORE_DIR (device cache)")
    kv = geo.kv_bytes(tokens, gpus)
    if tokens > DEFAULT_CONTEXT and plan.need("vram") - kv + geo.kv_bytes(DEFAULT_CONTEXT, gpus) <= budget:
        tries.append(f"--max-model-len {DEFAULT_CONTEXT}")
    hint = f"; try {' or '.join(tries)}" if tries else ""
    return (f"needs {gib(plan.need('vram'))} GiB of VRAM per GPU for {what}; have {gib(budget)} "
            f"({GPU_MEMORY_UTILIZATION:g} × {gib(res.gpu_bytes)}){hint}")


def _ram_problem(plan: Plan, knobs: Knobs, res: Resources) -> str:
    """Host RAM over: keep only what is left in RAM of the 2-bit base, the rest on NVMe behind an arena (on
    a GPU), or behind the device cache and an arena (on CPU, where the "device" is host memory too)."""
    ram = [p for p in plan.parts if p.where == "ram" and p.bytes]
    what = " + ".join(f"{p.name} {gib(p.bytes)}" for p in ram)
    experts = sum(p.bytes for p in ram if p.name.startswith(("2-bit experts", "host store")))
    left = math.floor((res.ram_bytes - (plan.need("ram") - experts)) / GIB * 10) / 10
    tries = []
    if left > 0 and plan.device == "gpu":
        tries.append(f"VLLM_MOE_W2_BASE_RAM_GB={left:g} with VLLM_MOE_W2_STORE_DIR on NVMe")
    elif left > 0:
        tries.append(f"VLLM_MOE_W2_BASE_CACHE_GB={left / 2:g} VLLM_MOE_W2_BASE_RAM_GB={left / 2:g} with VLLM_MOE_W2_STORE_DIR on NVMe")
    if knobs.delta_gb not in (0, 0.0):
        tries.append("VLLM_MOE_W2_DELTA_GB=0")
    hint = f"; try {' or '.join(tries)}" if tries else ""
    return f"needs {gib(plan.need('ram'))} GiB of host RAM for {what}; have {gib(res.ram_bytes)}{hint}"


def predict(plan: Plan, knobs: Knobs, m: Measured) -> tuple[float, list[str]]:
    """Decode tok/s at batch 1 on an H200: LM head + every layer's non-expert time + the step's active experts
    at the measured 2-bit bandwidth (split over GPUs; all-reduce not measured); under the device cache a step
    with a miss is replayed once after fetching its misses (uniform routing: pessimistic)."""
    geo = plan.geometry
    bw = m.moe_bandwidth(geo.base_bytes_per_expert)
    moe_us = geo.top_k * geo.base_bytes_per_expert / (bw.value * 1e3) / plan.gpus
    head_us = m.head_us.value * geo.vocab * geo.hidden * geo.dtype_bytes / m.head_bytes
    step = head_us + geo.layers * m.layer_other_us.value + geo.moe_layers * moe_us
    used = [bw.describe("2-bit MoE bandwidth"), m.layer_other_us.describe("rest of a layer"), m.head_us.describe("LM head")]
    if knobs.base_cache_gb > 0:
        row = geo.layout().base_span
        share = min(1.0, int(knobs.base_cache_gb * GIB) // row / geo.routed_experts)
        misses = geo.moe_layers * geo.top_k * (1 - share)
        if misses > 0:
            host = next((p.bytes for p in plan.parts if p.name.startswith("host store")), 0)
            from_disk = 1 - min(1.0, host / (geo.routed_experts * row))
            step = 2 * step + misses * row / (m.fetch_gbs.value * 1e3) + from_disk * misses * row / (m.pack_read_gbs.value * 1e3)
            used += [m.fetch_gbs.describe("device-cache fetch"), m.pack_read_gbs.describe("pack read")]
    return 1e6 / step, used


def make_plan(geo: Geometry, knobs: Knobs, res: Resources, constants: Measured | None) -> Plan:
    """The plan for `geo` under `knobs` on `res`; `constants` (None: no prediction) feed the tok/s estimate."""
    on_gpu = res.gpu_bytes is not None
    gpus = res.gpus if on_gpu else 1
    tokens = res.max_len or geo.context or DEFAULT_CONTEXT
    device_parts = _vram_parts(geo, knobs, res, gpus, tokens)
    if not on_gpu:
        device_parts = [Part(p.name, "ram", p.bytes, p.note) for p in device_parts]
    nvme, store = _nvme_parts(geo, knobs, res)
    parts = device_parts + _host_parts(geo, knobs, res, on_gpu) + nvme
    capacity = {"ram": res.ram_bytes}
    if on_gpu:
        capacity["vram"] = int(res.gpu_bytes * GPU_MEMORY_UTILIZATION)
    if store is not None:
        capacity["nvme"] = _disk_free(store)
    plan = Plan(geo, "gpu" if on_gpu else "cpu", gpus, tokens, parts, capacity)
    weights = ("dense weights", "2-bit experts", "2-bit experts (device cache)", "host store (2-bit base)", "FP4 tier (host)", "pack")
    if on_gpu:
        if plan.need("vram") > capacity["vram"]:
            plan.problems.append(_vram_problem(plan, knobs, res))
        resident = sum(p.bytes for p in parts if p.where == "vram" and p.name in weights)
        if resident > res.gpu_bytes:
            plan.impossible.append(f"needs {gib(resident)} GiB of VRAM per GPU for its weights alone; a GPU has {gib(res.gpu_bytes)}")
    if plan.need("ram") > res.ram_bytes:
        plan.problems.append(_ram_problem(plan, knobs, res))
        resident = sum(p.bytes for p in parts if p.where == "ram" and p.name in weights)
        if resident > res.ram_bytes:
            plan.impossible.append(f"needs {gib(resident)} GiB of host RAM for its weights alone; the host has {gib(res.ram_bytes)}")
    if store is not None and plan.need("nvme") > capacity["nvme"]:
        line = f"needs {gib(plan.need('nvme'))} GiB on {store} for the pack; have {gib(capacity['nvme'])} free"
        plan.problems.append(f"{line}; free space or point VLLM_MOE_W2_STORE_DIR elsewhere")
        plan.impossible.append(line)
    if geo.skipped_layers:
        plan.notes.append(f"layers {', '.join(map(str, geo.skipped_layers))} (MTP, {gib(geo.skipped_bytes)} GiB in the checkpoint) are not loaded")
    if on_gpu and constants is not None:
        plan.tok_s, plan.constants = predict(plan, knobs, constants)
    return plan
