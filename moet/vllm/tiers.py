"""The expert tiers of one MoE model: pack file, host store, device expert cache, replay driver.

Made once per model (moet.vllm.engine.MoetEngine), when its first MoE layer finishes loading, from
the knobs: with VLLM_MOE_W2_STORE_DIR the rank's pack is written on the first load (or reused: no
re-quantization), with the FP4 tier when the pool is on, and every layer's experts are read from
it; with VLLM_MOE_W2_BASE_CACHE_GB the base stays in a host store and the device holds an N-GiB
cache of experts, each step replayed until no expert is missing (moet.store). On a GPU the cache's
slots hold the kernels' layout (moet.kernels.cache_slots), converted on the device as rows arrive.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from moet.kernels.cache_slots import KernelSlots
from moet.kernels.layout import StackedWeights, fp4_host_words
from moet.knobs import Knobs
from moet.quant.stacked import StackedWeight
from moet.status import write_status
from moet.vllm.hybrid import HybridExperts
from moet.store import ExpertCache, ExpertStore, Pack, ReplayDriver, open_store
from moet.store.cache import RowSlots
from moet.store.build import write_pack_from_checkpoint
from moet.store.reader import RowReader, aligned_empty
from moet.store.replay import Agree

logger = logging.getLogger("moet")
FILL_ROWS = 64  # rows read per batch when a layer is filled from the pack (bounds the transient buffer)


@dataclass
class ExpertTiers:
    pack: Pack
    knobs: Knobs
    store: ExpertStore | None = None  # with the device cache only
    cache: ExpertCache | None = None
    driver: ReplayDriver | None = None
    hybrid: HybridExperts | None = None  # VLLM_MOE_W2_CACHE_MISS=cpu/both (GPU)

    def fill(self, layer: int, w13: StackedWeight, w2: StackedWeight) -> None:
        """Copy one MoE layer's experts (base and, when the pack holds it, FP4 tier) out of the pack
        into resident stacked tensors, with the reader threads and O_DIRECT the knobs ask for."""
        pack, experts = self.pack, w13.num_experts
        reader = RowReader(pack, self.knobs.store_threads, self.knobs.tier_direct)
        try:
            rows = aligned_empty(min(FILL_ROWS, experts), pack.stride)
            for at in range(0, experts, FILL_ROWS):
                batch = range(at, min(at + FILL_ROWS, experts))
                reader.read([(layer, e) for e in batch], list(rows[: len(batch)]))
                for expert, row in zip(batch, rows):
                    gate_up, down = pack.layout.read_row(row, pack.flips(layer, expert))
                    w13.put(expert, slice(None), gate_up)
                    w2.put(expert, slice(None), down)
        finally:
            reader.close()

    def hybrid_kpis(self) -> dict:
        """The CPU-computed and fetched misses under VLLM_MOE_W2_CACHE_MISS=cpu/both ({} otherwise)."""
        return {} if self.hybrid is None else {"hybrid": self.hybrid.kpis()}

    def fp4_host_words(self, layer: int, shape13: StackedWeight, shape2: StackedWeight, device: torch.device) -> list[torch.Tensor]:
        """Under the device cache on a GPU, the FP4 pool's host copies of one layer, read from the pack (which
        holds the tier when the pool is on); `shape13`/`shape2` give the layer's shapes."""
        tier = self.pack.layout.tier
        stacks = [StackedWeight.empty(s.num_experts, *s.shape, s.scale_kind, tier, "cpu") for s in (shape13, shape2)]
        self.fill(layer, *stacks)
        return fp4_host_words(*stacks, device)

    def cache_weights(self) -> tuple[StackedWeight | StackedWeights, StackedWeight | StackedWeights]:
        """What the forward reads from the device cache's slots (index it with slot ids from `lookup`):
        the kernels' layout on a GPU, stacked views over the pack rows on CPU."""
        storage = self.cache.storage
        if isinstance(storage, KernelSlots):
            return storage.w13, storage.w2
        scale_kind = self.pack.layout.scale_kind
        w13, w2 = storage.views
        return tuple(  # type: ignore[return-value]
            StackedWeight(v["codes"], v["scales"], v["row_scale"], scale_kind) for v in (w13, w2)
        )


def uses_tiers(knobs: Knobs) -> bool:
    return knobs.store_dir is not None


def build_tiers(knobs: Knobs, model_dir: str, tier: str, tp_size: int, rank: int, device: torch.device, *,
                expert_ids: Sequence[int] | None = None, agree: Agree | None = None) -> ExpertTiers:
    """The rank's pack (written here on a first load, with FP4 tier `tier`; its slice of every expert under
    tensor parallelism, the experts `expert_ids` under expert parallelism) and, with the device cache, the
    host store, the cache and its replay driver, which replays a step when any rank missed (`agree`)."""
    pack = write_pack_from_checkpoint(model_dir, Path(knobs.store_dir), rank=rank, tier=tier, ranks=tp_size,
                                      experts=expert_ids)
    tiers = ExpertTiers(pack, knobs)
    if knobs.base_cache_gb > 0:
        ram = None if knobs.base_ram_gb in (0, 0.0) else knobs.base_ram_gb
        tiers.store = open_store(pack, ram, knobs.store_threads, knobs.tier_direct, pin=device.type == "cuda")
        storage = KernelSlots if device.type == "cuda" else RowSlots
        tiers.cache = ExpertCache(tiers.store, gib=knobs.base_cache_gb, device=device, storage=storage)
        tiers.driver = ReplayDriver(tiers.cache, knobs.replay_mode, knobs.fp_max, knobs.base_miss_tol, knobs.kpi_secs,
                                    on_report=lambda kpis: write_status({"tiers": {**kpis, **tiers.hybrid_kpis()}}),
                                    agree=agree)
        if knobs.cache_miss != "replay":
            tiers.hybrid = HybridExperts(tiers.cache, knobs.cache_miss)
        logger.warning("moet: device expert cache of %d experts (%.2f GiB on %s) over %s", tiers.cache.slots,
                       tiers.cache.storage.nbytes / 2**30, device, type(tiers.store).__name__)
    return tiers
