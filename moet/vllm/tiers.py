"""The expert tiers of one MoE model: pack file, host store, device expert cache, replay driver.

Made once per model (moet.vllm.engine.MoetEngine), when its first MoE layer finishes loading, from
the knobs: with VLLM_MOE_W2_STORE_DIR the rank's pack is written on the first load (or reused: no
re-quantization), with the FP4 tier when the pool is on, and every layer's experts are read from
it; with VLLM_MOE_W2_BASE_CACHE_GB the base stays in a host store and the device holds an N-GiB
cache of expert rows, each step replayed until no expert is missing (moet.store).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from moet.knobs import Knobs
from moet.quant.stacked import StackedWeight
from moet.status import write_status
from moet.store import ExpertCache, ExpertStore, Pack, ReplayDriver, open_store
from moet.store.build import write_pack_from_checkpoint
from moet.store.reader import RowReader, aligned_empty

logger = logging.getLogger("moet")
FILL_ROWS = 64  # rows read per batch when a layer is filled from the pack (bounds the transient buffer)


@dataclass
class ExpertTiers:
    pack: Pack
    knobs: Knobs
    store: ExpertStore | None = None  # with the device cache only
    cache: ExpertCache | None = None
    driver: ReplayDriver | None = None

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

    def cache_weights(self, scale_kind: str) -> tuple[StackedWeight, StackedWeight]:
        """Stacked views over the device cache's slots (index them with slot ids from `lookup`)."""
        w13, w2 = self.cache.views
        return tuple(  # type: ignore[return-value]
            StackedWeight(v["codes"], v["scales"], v["row_scale"], scale_kind) for v in (w13, w2)
        )


def uses_tiers(knobs: Knobs) -> bool:
    return knobs.store_dir is not None


def build_tiers(knobs: Knobs, model_dir: str, tier: str, tp_size: int, rank: int, device: torch.device) -> ExpertTiers:
    """The rank's pack (written here on a first load, with FP4 tier `tier`) and, with the device
    cache, the host store, the cache and its replay driver."""
    pack = write_pack_from_checkpoint(model_dir, Path(knobs.store_dir), rank=rank, tier=tier, ranks=tp_size)
    tiers = ExpertTiers(pack, knobs)
    if knobs.base_cache_gb > 0:
        ram = None if knobs.base_ram_gb in (0, 0.0) else knobs.base_ram_gb
        tiers.store = open_store(pack, ram, knobs.store_threads, knobs.tier_direct, pin=device.type == "cuda")
        tiers.cache = ExpertCache(tiers.store, gib=knobs.base_cache_gb, device=device)
        tiers.driver = ReplayDriver(tiers.cache, knobs.replay_mode, knobs.fp_max, knobs.base_miss_tol, knobs.kpi_secs,
                                    on_report=lambda kpis: write_status({"tiers": kpis}))
        logger.warning("moet: device expert cache of %d rows over %s", tiers.cache.slots, type(tiers.store).__name__)
    return tiers
