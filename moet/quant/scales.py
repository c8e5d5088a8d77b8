"""Block-scale kinds and bit patterns (float8_e4m3fn, UE8M0), decoded by their definitions, not by
torch casts; `apply_scales` is the one place values in e2m1 units meet their scales."""

from __future__ import annotations

from enum import StrEnum

import torch
import torch.nn.functional as F


class ScaleKind(StrEnum):
    """The block scales of a 2-bit base and its FP4 tier: e4m3 per 16 weights along K (NVFP4 keeps
    its own) or UE8M0 per 32 (MXFP4, and the reference rule's output for FP8/BF16 sources)."""

    NV16 = "nv16"
    MX32 = "mx32"

    @property
    def block(self) -> int:
        return SCALE_BLOCK[self]

    @classmethod
    def of_source(cls, source_kind: str) -> "ScaleKind":
        """The scale kind a source kind ("nvfp4", "mxfp4", "fp8_block", "float") quantizes to."""
        return cls.NV16 if source_kind == "nvfp4" else cls.MX32


SCALE_BLOCK = {ScaleKind.NV16: 16, ScaleKind.MX32: 32}


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


_TABLES: dict[tuple[str, torch.dtype], torch.Tensor] = {}


def scale_table(kind: str, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The 256 values of `kind`'s scale bytes in `dtype` (exact in float32 too: 2^-127 is a float32 subnormal)."""
    key = (str(kind), dtype)
    if key not in _TABLES:
        _TABLES[key] = (E4M3_VALUES if kind == ScaleKind.NV16 else UE8M0_VALUES).to(dtype)
    return _TABLES[key]


def scale_values(scales: torch.Tensor, kind: str) -> torch.Tensor:
    """Decode uint8 block-scale bytes of `kind` ("nv16" or "mx32") to float64."""
    if scales.dtype != torch.uint8:
        raise TypeError(f"block scales must be uint8 bit patterns, got {scales.dtype}")
    return scale_table(kind).to(scales.device)[scales.long()]


def lookup(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """table[index] for uint8 indices: `embedding` is several times faster than advanced indexing."""
    flat = table if table.dim() == 2 else table.unsqueeze(-1)
    out = F.embedding(index.to(torch.int32), flat.to(index.device))
    return out if table.dim() == 2 else out.squeeze(-1)


def apply_scales(
    values: torch.Tensor, scales: torch.Tensor, kind: str, row_scale: torch.Tensor, inplace: bool = False
) -> torch.Tensor:
    """values [..., N, K] in e2m1 units × block scales (uint8 [..., N, K/B]) × row scale [..., N], in
    values' dtype: e2m1 × e4m3 or × 2^e is exact, the row scale is the one rounding. Per block, no
    [..., N, K] scale tensor; `inplace` writes into `values`."""
    blocks = (values if inplace else values.clone()).unflatten(-1, (-1, SCALE_BLOCK[kind]))
    blocks.mul_(lookup(scale_table(kind, values.dtype), scales).unsqueeze(-1))
    blocks.mul_(row_scale.to(values.dtype)[..., None, None])
    return blocks.flatten(-2)


def expand_blocks(per_block: torch.Tensor, block: int) -> torch.Tensor:
    """Repeat a [..., K/B] per-block tensor to [..., K]."""
    return per_block.repeat_interleave(block, dim=-1)
