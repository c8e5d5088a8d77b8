"""The engine state of one MoE model: its start-up summary, expert tiers and FP4 runtime.

vLLM builds a model's MoE layers through one quantization config (`MoetConfig`), which makes one
`MoetEngine` when the first layer is created; every layer holds it (`layer.moet_engine`) and the
step hook hangs it on the loaded model (`model.moet_engine`). Nothing is process-wide, so a second
MoE model in the same process (a draft model for speculative decoding, a reload) keeps its own
pack, pool, gate and counters. vLLM-free: stand-in models and tests build the same state.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moet.formats.source import SourceWeight, shard_for_rank
from moet.knobs import Knobs
from moet.quant.codebook import QuantizedWeight, Tier
from moet.quant.requant import requantize
from moet.store import ReplayDriver
from moet.store.replay import Agree
from moet.vllm.gate_runtime import Fp4Runtime
from moet.vllm.summary import ExpertSummary
from moet.vllm.tiers import ExpertTiers, build_tiers, uses_tiers


class MoetEngine:
    """What the MoE layers of one model share: knobs, FP4 tier kind, summary, tiers and FP4 runtime."""

    def __init__(self, knobs: Knobs, model_dir: str, tp_size: int = 1, tp_rank: int = 0, *,
                 expert_ids: Sequence[int] | None = None, rank: int | None = None, agree: Agree | None = None) -> None:
        """`tp_size`/`tp_rank`: the slice of every expert's intermediate rows this rank serves; `expert_ids`: the
        global ids of the experts it holds, in local order (expert parallelism, where vLLM gives the MoE layers
        one tensor-parallel rank; None: all); `rank`: its pack file (default `tp_rank`; the expert-parallel
        rank); `agree`: the largest of a count over the ranks that run each forward together (None: one rank)."""
        self.knobs, self.model_dir, self.tp_size, self.tp_rank = knobs, model_dir, tp_size, tp_rank
        self.expert_ids = None if expert_ids is None else list(expert_ids)
        self.rank = tp_rank if rank is None else rank
        self.agree = agree
        self.tier = Tier(knobs.fp4_tier) if knobs.delta_gb != 0 else Tier.NONE
        self.summary = ExpertSummary()
        self.tiers: ExpertTiers | None = None
        self.fp4: Fp4Runtime | None = None

    def add_layer(self) -> int:
        """Count a newly created MoE layer; returns its ordinal (its pack layer and pool row)."""
        ordinal = self.summary.created
        self.summary.layer_created()
        return ordinal

    def quantize(self, src: SourceWeight, sharded: bool = False) -> QuantizedWeight:
        """This rank's slice of one expert projection as the 2-bit base plus the model's FP4 tier;
        `sharded`: `src` is that slice already (vLLM narrows gpt-oss's fused tensors itself)."""
        part = src if sharded else shard_for_rank(src, self.tp_rank, self.tp_size)
        return requantize(part, self.tier, self.knobs.zero_mode)

    def expert_tiers(self, device: torch.device) -> ExpertTiers | None:
        """The model's pack and tiers (None without VLLM_MOE_W2_STORE_DIR), built on first use."""
        if self.tiers is None and uses_tiers(self.knobs):
            self.tiers = build_tiers(self.knobs, self.model_dir, self.tier, self.tp_size, self.rank, device,
                                     expert_ids=self.expert_ids, agree=self.agree)
        return self.tiers

    def fp4_runtime(self, experts: int, slot_bytes: int, device: torch.device) -> Fp4Runtime | None:
        """The FP4 pool and gate over every MoE layer created so far (None: FP4 tier off), built by the
        first layer that finishes loading. `slot_bytes`: one expert's FP4 tier as the forward holds it."""
        if self.fp4 is None and self.knobs.delta_gb != 0:
            self.fp4 = Fp4Runtime(self.knobs, self.summary.created, experts, slot_bytes, device, self.agree)
        return self.fp4

    @property
    def replay(self) -> ReplayDriver | None:
        return None if self.tiers is None else self.tiers.driver
