"""Source expert matrix → QuantizedWeight: FP4 sources nibble by nibble, FP8/BF16 via the reference rule."""

from __future__ import annotations

from typing import Protocol

import torch

from moet.quant.codebook import QuantizedWeight, Tier, base_from_fp4, unpack_nibbles, zero_sign_stats
from moet.quant.reference import fp4_from_float
from moet.quant.scales import ScaleKind

FP8_BLOCK = 128


class Source(Protocol):
    """One expert matrix as a checkpoint stores it (moet.formats.source.SourceWeight is one): quant
    reads these fields and does not depend on the checkpoint readers."""

    kind: str  # "nvfp4" | "mxfp4" | "fp8_block" | "float"
    data: torch.Tensor
    scales: torch.Tensor | None
    scale_2: float | None
    zero_policy: tuple[str, int] | None


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn [N, K] × float32 weight_scale_inv per 128×128 block → float64 [N, K]."""
    n, k = weight.shape
    scale = scale_inv.to(torch.float64).repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
    return weight.to(torch.float64) * scale[:n, :k]


def requantize(src: Source, tier: Tier = Tier.NONE, zero_mode: str = "auto") -> QuantizedWeight:
    """The 2-bit base (and FP4 tier when `tier` is Tier.PLANES or Tier.REFINE) of one source matrix.

    `zero_mode` (VLLM_MOE_W2_ZERO_MODE) forces the zero policy ("sign" or "parity") instead of the
    per-tensor choice ("auto"); a slice of a fused tensor keeps the policy decided on the whole.
    """
    n = src.data.shape[0]
    if src.kind in ("nvfp4", "mxfp4"):
        kind = ScaleKind.of_source(src.kind)
        row = torch.full((n,), src.scale_2 if src.kind == "nvfp4" else 1.0, dtype=torch.float32)
        packed, scales = src.data, src.scales
    else:
        weight = dequantize_fp8_block(src.data, src.scales) if src.kind == "fp8_block" else src.data.to(torch.float64)
        packed, scales = fp4_from_float(weight)
        kind, row = ScaleKind.MX32, torch.ones(n, dtype=torch.float32)
    policy = src.zero_policy
    if policy is None and zero_mode != "auto":
        policy = (zero_mode, zero_sign_stats(unpack_nibbles(packed))[1])
    return base_from_fp4(packed, scales, kind, row, tier, policy)
