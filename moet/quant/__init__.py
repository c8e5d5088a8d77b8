"""Requantization of routed experts: FP4 nibbles → sign-symmetric 2-bit base + FP4 tier (docs/FORMAT.md)."""

from moet.quant.codebook import (
    BASE_VALUES,
    QUANT_ABI,
    QuantizedWeight,
    base_from_fp4,
    decode_base,
    decode_fp4,
    dequantize_base,
    dequantize_fp4,
    nibbles_from_refinement,
    refinement_from_fp4,
)
from moet.quant.reference import fp4_from_float

__all__ = [
    "BASE_VALUES",
    "QUANT_ABI",
    "QuantizedWeight",
    "base_from_fp4",
    "decode_base",
    "decode_fp4",
    "dequantize_base",
    "dequantize_fp4",
    "fp4_from_float",
    "nibbles_from_refinement",
    "refinement_from_fp4",
]
