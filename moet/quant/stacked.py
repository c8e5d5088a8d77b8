"""A layer's experts stacked along a leading axis (docs/FORMAT.md "Stacked expert tensors").

The MoE forward reads these; decoding here is bulk table lookups over whole experts, shared by
the CPU path and by the kernels' float references.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from moet.quant.codebook import (
    BASE_VALUES,
    E2M1_MAGNITUDES,
    QuantizedWeight,
    Tier,
    dequantize_base,
    dequantize_fp4,
    fp4_nibbles,
    pack_nibbles,
    unpack_codes,
    unpack_refinement,
)
from moet.quant.scales import SCALE_BLOCK, ScaleKind, apply_scales, lookup


def _byte_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """Per byte: its four 2-bit base values, and its two FP4 values (low nibble first)."""
    base = torch.tensor(BASE_VALUES, dtype=torch.float32)
    fp4 = torch.tensor(E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES), dtype=torch.float32)
    byte = torch.arange(256)
    base4 = torch.stack([base[(byte >> s) & 3] for s in (0, 2, 4, 6)], dim=-1)
    fp4x2 = torch.stack([fp4[byte & 0xF], fp4[byte >> 4]], dim=-1)
    return base4, fp4x2


BYTE_TO_BASE4, BYTE_TO_FP4X2 = _byte_tables()
_SMALL_MAGNITUDES = torch.tensor(E2M1_MAGNITUDES[:5], dtype=torch.float32)
_BIG_MAGNITUDES = torch.tensor(E2M1_MAGNITUDES[5:] + (0.0, 0.0), dtype=torch.float32)


@dataclass
class StackedWeight:
    """E experts' [N, K] matrices of one projection (w13 or w2), 2-bit base plus optional FP4 tier
    (byte counts: moet.quant.codebook.QuantizedWeight)."""

    codes: torch.Tensor  # uint8 [E, N, K/4]
    scales: torch.Tensor  # uint8 [E, N, K/B]
    row_scale: torch.Tensor  # float32 [E, N]
    scale_kind: ScaleKind
    fp4: torch.Tensor | None = None  # uint8 [E, N, K/2]
    refine: torch.Tensor | None = None  # uint8 [E, N, K/16*5]

    @classmethod
    def from_views(cls, fields: Mapping[str, torch.Tensor], scale_kind: ScaleKind) -> "StackedWeight":
        """The stack over one matrix's field views of a pool of pack rows (moet.store.layout.RowLayout.stacked)."""
        return cls(fields["codes"], fields["scales"], fields["row_scale"], scale_kind, fields.get("fp4"), fields.get("refine"))

    @property
    def num_experts(self) -> int:
        return self.codes.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[1], self.codes.shape[2] * 4

    def expert(self, e: int) -> QuantizedWeight:
        """One expert's matrix; the zero policy does not matter for values (±0 are equal)."""
        return QuantizedWeight(
            codes=self.codes[e],
            scales=self.scales[e],
            scale_kind=self.scale_kind,
            row_scale=self.row_scale[e],
            zero_policy="sign",
            fp4=None if self.fp4 is None else self.fp4[e],
            refine=None if self.refine is None else self.refine[e],
        )

    def dequantize(self, e: int, tier: Tier) -> torch.Tensor:
        """float64 [N, K] of expert e read as `tier` (NONE: the 2-bit base; PLANES / REFINE: the FP4 tier from
        the planes / from base + refinement), through moet.quant.codebook (the references' decode,
        independent of the bulk tables below)."""
        qw = self.expert(e)
        if tier == Tier.NONE:
            return dequantize_base(qw)
        if tier == Tier.PLANES:
            qw.refine = None
        elif tier == Tier.REFINE:
            qw.fp4 = None
        else:
            raise ValueError(f"unknown tier {tier!r}; one of {[t.value for t in Tier]}")
        return dequantize_fp4(qw)

    def _scale(self, experts: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """values [A, N, K] (float32, overwritten) × the block and row scales of `experts`."""
        return apply_scales(values, self.scales[experts], self.scale_kind, self.row_scale[experts], inplace=True)

    def dequantize_base(self, experts: torch.Tensor) -> torch.Tensor:
        """float32 [A, N, K] of the 2-bit base of `experts` (exact: ±1/±4 × e4m3 or 2^e × row scale)."""
        values = lookup(BYTE_TO_BASE4, self.codes[experts]).flatten(-2)
        return self._scale(experts, values)

    def dequantize_fp4(self, experts: torch.Tensor) -> torch.Tensor:
        """float32 [A, N, K] of the FP4 tier of `experts`, from whole planes or base + refinement."""
        if self.fp4 is not None:
            values = lookup(BYTE_TO_FP4X2, self.fp4[experts]).flatten(-2)
        elif self.refine is not None:
            values = self._refined_values(experts)
        else:
            raise ValueError("this layer holds no FP4 tier")
        return self._scale(experts, values)

    def _refined_values(self, experts: torch.Tensor) -> torch.Tensor:
        """FP4 values from base codes + base-5 digits; a zero's sign does not change its value."""
        codes = self.codes[experts]
        a, n, _ = codes.shape
        base = lookup(BYTE_TO_BASE4, codes).flatten(-2)
        digits = unpack_refinement(self.refine[experts].reshape(a * n, -1)).reshape(a, n, -1)
        big = base.abs() == 4.0
        magnitude = torch.where(
            big,
            _BIG_MAGNITUDES.to(codes.device)[digits.clamp(max=4)],
            _SMALL_MAGNITUDES.to(codes.device)[digits],
        )
        return magnitude * torch.sign(base)

    @classmethod
    def empty(
        cls, experts: int, n: int, k: int, scale_kind: ScaleKind, tier: Tier = Tier.NONE, device: torch.device | str | None = None
    ) -> "StackedWeight":
        """Zeroed tensors (on `device`; "meta" gives shapes and sizes without memory)."""
        block = SCALE_BLOCK[scale_kind]
        stacked = cls(
            codes=torch.zeros(experts, n, k // 4, dtype=torch.uint8, device=device),
            scales=torch.zeros(experts, n, k // block, dtype=torch.uint8, device=device),
            row_scale=torch.zeros(experts, n, dtype=torch.float32, device=device),
            scale_kind=scale_kind,
        )
        if tier == Tier.PLANES:
            stacked.fp4 = torch.zeros(experts, n, k // 2, dtype=torch.uint8, device=device)
        elif tier == Tier.REFINE:
            stacked.refine = torch.zeros(experts, n, k // 16 * 5, dtype=torch.uint8, device=device)
        return stacked

    def put(self, expert: int, rows: slice, qw: QuantizedWeight) -> None:
        """Store one expert's quantized rows (e.g. the gate half of w13)."""
        if qw.scale_kind != self.scale_kind:
            raise ValueError(f"scale kind {qw.scale_kind} does not match the layer's {self.scale_kind}")
        self.codes[expert, rows] = qw.codes
        self.scales[expert, rows] = qw.scales
        self.row_scale[expert, rows] = qw.row_scale
        if self.fp4 is not None:
            self.fp4[expert, rows] = fp4_nibbles(qw)
        if self.refine is not None:
            self.refine[expert, rows] = qw.refine

    def fp4_planes(self) -> torch.Tensor:
        """The FP4 tier as packed nibbles uint8 [E, N, K/2]: the planes, or rebuilt from base + refinement.

        A zero's sign comes from its base code (both signs of zero have the same value).
        """
        if self.fp4 is not None:
            return self.fp4
        if self.refine is None:
            raise ValueError("this layer holds no FP4 tier")
        e, n, _ = self.codes.shape
        codes = unpack_codes(self.codes.reshape(e * n, -1))
        digits = unpack_refinement(self.refine.reshape(e * n, -1))
        big = (codes == 0) | (codes == 3)
        nibbles = ((codes <= 1).to(torch.int64) << 3) | (digits + 5 * big.to(torch.int64))
        return pack_nibbles(nibbles.to(torch.uint8)).reshape(e, n, -1)

    def base_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.row_scale))

    def tier_nbytes(self) -> int:
        return sum(t.numel() for t in (self.fp4, self.refine) if t is not None)
