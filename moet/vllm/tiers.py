"""The expert tiers of one engine process: pack file, host store, device expert cache, replay driver.

Made once, when the first MoE layer finishes loading, from the knobs: with VLLM_MOE_W2_STORE_DIR
the pack is written on the first load (or reused: no re-quantization) and every layer's base is read
from it; with VLLM_MOE_W2_BASE_CACHE_GB the base stays in the host store and the device holds an
N-GiB cache of expert rows, each step replayed until no expert is missing (moet.store).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from moet.errors import ConfigError
from moet.knobs import Knobs
from moet.quant.stacked import StackedWeight
from moet.status import status_path

logger = logging.getLogger("moet")


@dataclass
class ExpertTiers:
    pack: object
    store: object
    cache: object | None
    driver: object | None

    def fill(self, layer: int, w13: StackedWeight, w2: StackedWeight) -> None:
        """Copy one MoE layer's 2-bit base out of the host store into resident stacked tensors."""
        keys = [(layer, e) for e in range(w13.num_experts)]
        capacity = self.store.capacity or len(keys)
        for at in range(0, len(keys), capacity):
            batch = keys[at : at + capacity]
            for (_, expert), row in zip(batch, self.store.rows(batch, False)):
                gate_up, down = self.store.layout.read_row(row)
                w13.put(expert, slice(None), gate_up)
                w2.put(expert, slice(None), down)

    def cache_weights(self, scale_kind: str) -> tuple[StackedWeight, StackedWeight]:
        """Stacked views over the device cache's slots (index them with slot ids from `lookup`)."""
        w13, w2 = self.cache.views
        return tuple(  # type: ignore[return-value]
            StackedWeight(v["codes"], v["scales"], v["row_scale"], scale_kind) for v in (w13, w2)
        )


_TIERS: ExpertTiers | None = None


def uses_tiers(knobs: Knobs) -> bool:
    return knobs.store_dir is not None or knobs.base_cache_gb > 0


def expert_tiers(knobs: Knobs, model_dir: str, tp_size: int, rank: int, device: torch.device) -> ExpertTiers:
    """This process's tiers, built on first use (the pack is written here on a first load)."""
    global _TIERS
    if _TIERS is not None:
        return _TIERS
    from moet.store import ExpertCache, ReplayDriver, open_store
    from moet.store.build import write_pack_from_checkpoint

    if knobs.store_dir is None:
        raise ConfigError(
            "VLLM_MOE_W2_BASE_CACHE_GB needs VLLM_MOE_W2_STORE_DIR: the device cache reads expert rows from the pack there"
        )
    if tp_size > 1:
        raise ConfigError("pack files hold whole experts per rank: VLLM_MOE_W2_STORE_DIR is not supported with tensor parallelism yet")
    pack = write_pack_from_checkpoint(model_dir, Path(knobs.store_dir), rank=rank)
    ram = None if knobs.base_ram_gb in (0, 0.0) else knobs.base_ram_gb
    store = open_store(pack, ram, knobs.store_threads, knobs.tier_direct, pin=device.type == "cuda")
    cache = driver = None
    if knobs.base_cache_gb > 0:
        cache = ExpertCache(store, gib=knobs.base_cache_gb, device=device)
        driver = ReplayDriver(cache, knobs.replay_mode, knobs.fp_max, knobs.base_miss_tol, knobs.kpi_secs, status_path())
        logger.warning("moet: device expert cache of %d rows over %s", cache.slots, type(store).__name__)
    _TIERS = ExpertTiers(pack, store, cache, driver)
    return _TIERS


def current_tiers() -> ExpertTiers | None:
    return _TIERS
