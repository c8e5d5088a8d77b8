"""Block-scale bit patterns (float8_e4m3fn, UE8M0) decoded by their definitions, not by torch casts."""

from __future__ import annotations

import torch

SCALE_BLOCK = {"nv16": 16, "mx32": 32}


def _e4m3_table() -> torch.Tensor:
    """All 256 float8_e4m3fn bit patterns as float64: bias 7, subnormals at e=0, S.1111.111 is NaN."""
    values = []
    for bits in range(256):
        sign = -1.0 if bits & 0x80 else 1.0
        exponent = (bits >> 3) & 0xF
        mantissa = bits & 0x7
        if exponent == 0xF and mantissa == 0x7:
            values.append(float("nan"))
        elif exponent == 0:
            values.append(sign * mantissa / 8.0 * 2.0**-6)
        else:
            values.append(sign * (1.0 + mantissa / 8.0) * 2.0 ** (exponent - 7))
    return torch.tensor(values, dtype=torch.float64)


def _ue8m0_table() -> torch.Tensor:
    """All 256 UE8M0 exponents as float64: 2^(b-127); 255 is NaN."""
    values = [2.0 ** (b - 127) for b in range(255)] + [float("nan")]
    return torch.tensor(values, dtype=torch.float64)


E4M3_VALUES = _e4m3_table()
UE8M0_VALUES = _ue8m0_table()


def scale_values(scales: torch.Tensor, kind: str) -> torch.Tensor:
    """Decode uint8 block-scale bytes of `kind` ("nv16" or "mx32") to float64."""
    if scales.dtype != torch.uint8:
        raise TypeError(f"block scales must be uint8 bit patterns, got {scales.dtype}")
    table = E4M3_VALUES if kind == "nv16" else UE8M0_VALUES
    return table.to(scales.device)[scales.long()]


def expand_blocks(per_block: torch.Tensor, block: int) -> torch.Tensor:
    """Repeat a [..., K/B] per-block tensor to [..., K]."""
    return per_block.repeat_interleave(block, dim=-1)
