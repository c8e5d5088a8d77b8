"""The byte layout of one pack row: one expert's matrices at fixed, aligned offsets (docs/STORE.md).

Every tier (pack file, host arena, device cache) holds rows as flat uint8 buffers, so moving an
expert is one memcpy and a pool of rows reads as stacked [S, N, K/4] tensors without repacking.
The base fields of all matrices come first, so the first `base_span` bytes of a row are all a
2-bit forward needs; the FP4 tier (when packed) follows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from moet.quant.codebook import REFINE_BYTES, REFINE_GROUP, QUANT_ABI, QuantizedWeight, Tier
from moet.quant.scales import SCALE_BLOCK, ScaleKind

ROW_VERSION = 1
ROW_MAGIC = 0x4D4F4552  # "REOM" little-endian: catches rows that were never written
FIELD_ALIGN = 64
PAGE = 4096
HEADER_WORDS = 16  # int32: magic, version, layer, expert, n_matrices, then (policy | sign << 8, n_flips) per matrix
MAX_MATRICES = (HEADER_WORDS - 5) // 2
TIERS = tuple(t.value for t in Tier)
ZERO_POLICIES = ("sign", "parity")


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class Field:
    """One tensor of a row: matrix index, name (codes/scales/row_scale/fp4/refine), place and type."""

    matrix: int
    name: str
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * torch.empty(0, dtype=self.dtype).element_size()


@dataclass(frozen=True)
class RowLayout:
    """Where each field of an expert's matrices lives in its row.

    matrices: (name, N, K) in row order, e.g. (("w13", 2I, H), ("w2", H, I)).
    tier: Tier.NONE (base only), PLANES (FP4 nibbles) or REFINE (base-5 refinement of the base).
    """

    matrices: tuple[tuple[str, int, int], ...]
    scale_kind: ScaleKind
    tier: Tier = Tier.NONE

    def __post_init__(self) -> None:
        if self.scale_kind not in SCALE_BLOCK:
            raise ValueError(f"unknown scale kind {self.scale_kind!r}")
        if self.tier not in TIERS:
            raise ValueError(f"unknown FP4 tier {self.tier!r}; one of {TIERS}")
        if not 1 <= len(self.matrices) <= MAX_MATRICES:
            raise ValueError(f"a row holds 1..{MAX_MATRICES} matrices, got {len(self.matrices)}")
        block = SCALE_BLOCK[self.scale_kind]
        for name, n, k in self.matrices:
            if k % max(block, REFINE_GROUP if self.tier == Tier.REFINE else 4):
                raise ValueError(f"{name}: K={k} is not a multiple of the {self.scale_kind} block")

    @classmethod
    def for_moe(cls, hidden: int, inter: int, scale_kind: str, tier: Tier = Tier.NONE) -> "RowLayout":
        """The usual FusedMoE expert: w13 [2I, H] (gate rows then up rows) and w2 [H, I]."""
        return cls((("w13", 2 * inter, hidden), ("w2", hidden, inter)), scale_kind, tier)

    @cached_property
    def fields(self) -> tuple[Field, ...]:
        block = SCALE_BLOCK[self.scale_kind]
        specs: list[tuple[int, str, tuple[int, ...], torch.dtype]] = []
        for m, (_, n, k) in enumerate(self.matrices):
            specs += [(m, "codes", (n, k // 4), torch.uint8), (m, "scales", (n, k // block), torch.uint8),
                      (m, "row_scale", (n,), torch.float32)]
        for m, (_, n, k) in enumerate(self.matrices):
            if self.tier == Tier.PLANES:
                specs.append((m, "fp4", (n, k // 2), torch.uint8))
            elif self.tier == Tier.REFINE:
                specs.append((m, "refine", (n, k // REFINE_GROUP * REFINE_BYTES), torch.uint8))
        fields, offset = [], HEADER_WORDS * 4
        for m, name, shape, dtype in specs:
            offset = round_up(offset, FIELD_ALIGN)
            field = Field(m, name, offset, shape, dtype)
            fields.append(field)
            offset += field.nbytes
        return tuple(fields)

    @cached_property
    def slot_bytes(self) -> int:
        """Bytes of a row that carry data (header and fields, padding to 64 B included)."""
        last = self.fields[-1]
        return round_up(last.offset + last.nbytes, FIELD_ALIGN)

    @cached_property
    def base_span(self) -> int:
        """Bytes from the row's start that hold the header and every base field, rounded to 4 KiB."""
        end = max(f.offset + f.nbytes for f in self.fields if f.name in ("codes", "scales", "row_scale"))
        return round_up(end, PAGE)

    @cached_property
    def stride(self) -> int:
        """Distance between rows in a pack file: slot_bytes rounded up to 4 KiB (O_DIRECT, page cache)."""
        return round_up(self.slot_bytes, PAGE)

    def describe(self) -> str:
        mats = " ".join(f"{name}[{n}x{k}]" for name, n, k in self.matrices)
        fields = ",".join(f"{f.name}@{f.offset}" for f in self.fields)
        return f"row/{ROW_VERSION} {self.scale_kind} tier={self.tier} {mats} {fields}"

    def abi(self) -> str:
        """The quantizer ABI string a pack is keyed on: the quantizer's constant and this layout."""
        return f"{QUANT_ABI}; {self.describe()}"

    def write_row(self, row: torch.Tensor, layer: int, expert: int, weights: Sequence[QuantizedWeight]) -> None:
        """Serialize one expert's matrices into `row` (uint8 [≥ slot_bytes], host); padding is zeroed."""
        if len(weights) != len(self.matrices):
            raise ValueError(f"expected {len(self.matrices)} matrices, got {len(weights)}")
        row.zero_()
        header = [ROW_MAGIC, ROW_VERSION, layer, expert, len(weights)]
        for (name, n, k), qw in zip(self.matrices, weights):
            if qw.shape != (n, k) or qw.scale_kind != self.scale_kind:
                raise ValueError(f"{name}: got {qw.shape} {qw.scale_kind}, layout wants ({n}, {k}) {self.scale_kind}")
            n_flips = int(qw.zero_flips.numel()) if self.tier == Tier.REFINE else 0
            header += [ZERO_POLICIES.index(qw.zero_policy) | (qw.zero_sign << 8), n_flips]
        header += [0] * (HEADER_WORDS - len(header))
        row[: HEADER_WORDS * 4].view(torch.int32).copy_(torch.tensor(header, dtype=torch.int32))
        for field in self.fields:
            source = getattr(weights[field.matrix], field.name)
            if source is None:
                raise ValueError(f"{self.matrices[field.matrix][0]} has no {field.name} but the pack tier is {self.tier}")
            self._view(row, field).copy_(source.reshape(field.shape))

    def header(self, row: torch.Tensor) -> list[int]:
        """The row's header words; raises ValueError when the row was never written."""
        words = row[: HEADER_WORDS * 4].view(torch.int32).tolist()
        if words[0] != ROW_MAGIC or words[1] != ROW_VERSION or words[4] != len(self.matrices):
            raise ValueError("not a written pack row (bad magic, version or matrix count)")
        return words

    def read_row(self, row: torch.Tensor, flips: Sequence[torch.Tensor] | None = None) -> list[QuantizedWeight]:
        """Zero-copy QuantizedWeight views of a row (its first base_span bytes suffice for the base).

        Tier fields are present only when the row holds them; refinement zero flips come from the pack.
        """
        words = self.header(row)
        out = []
        for m in range(len(self.matrices)):
            meta, n_flips = words[5 + 2 * m], words[6 + 2 * m]
            parts = {f.name: self._view(row, f) for f in self.fields
                     if f.matrix == m and f.offset + f.nbytes <= row.numel()}
            qw = QuantizedWeight(
                codes=parts["codes"], scales=parts["scales"], scale_kind=self.scale_kind,
                row_scale=parts["row_scale"], zero_policy=ZERO_POLICIES[meta & 0xFF],
                fp4=parts.get("fp4"), refine=parts.get("refine"), zero_sign=meta >> 8,
            )
            if flips is not None:
                qw.zero_flips = flips[m]
            elif n_flips and "refine" in parts:
                raise ValueError("this row's refinement needs zero flips from its pack")
            out.append(qw)
        return out

    def stacked(self, pool: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        """Per matrix, each field as a stacked view [S, ...] over a pool of rows uint8 [S, width]."""
        slots, width = pool.shape
        out: list[dict[str, torch.Tensor]] = [{} for _ in self.matrices]
        for field in self.fields:
            if field.offset + field.nbytes > width:
                continue
            size = torch.empty(0, dtype=field.dtype).element_size()
            typed = pool.view(field.dtype)  # [S, width / size]; width is a multiple of 64
            inner = typed[:, field.offset // size : (field.offset + field.nbytes) // size]
            out[field.matrix][field.name] = inner.unflatten(1, field.shape)
        return out

    @staticmethod
    def _view(row: torch.Tensor, field: Field) -> torch.Tensor:
        return row[field.offset : field.offset + field.nbytes].view(field.dtype).view(field.shape)
