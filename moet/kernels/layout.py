"""Stacked expert weights as the GPU kernels read them, and the load-time re-layout into that form.

The stored layout (docs/FORMAT.md, "Stacked expert tensors") is byte-oriented; the kernels want
32-bit words whose bits can be turned into bf16 pairs with one rotate and one LOP3 per pair:

* 2-bit codes: each 16 consecutive k of a row become one int32 word. Weight k = 2j + h (h = 0 the low
  bf16 half, 1 the high half) keeps its sign bit s (1 = negative) at bit (15 + 16h + r) mod 32 and
  its "big" bit b (|value| = 4) at bit (8 + 16h + r) mod 32, with r = 2j + 2. Rotating the word
  right by r and masking with 0x81008100 | 0x40004000 yields the bf16 pair (±2 or ±8, twice the
  base value: the kernels halve the result). Same bytes as the stored codes.
* FP4 planes: unchanged (an int64 view: 16 nibbles, low nibble = even k).
* Refinement: each 5-byte group (16 k) is split into its first four bytes (an int32 plane
  [E, N, K/16]) and its fifth byte (a uint8 plane [E, N, K/16]). Same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moet.quant.codebook import REFINE_BYTES, unpack_codes

BASE_PAIR_MASK = 0x81008100
BASE_PAIR_ONE = 0x40004000  # bf16 2.0 in both halves


def _base_bit_positions() -> tuple[list[int], list[int]]:
    """Bit positions (sign, big) of each of the 16 weights of a relaid word."""
    sign, big = [], []
    for k in range(16):
        j, h = divmod(k, 2)
        r = 2 * j + 2
        sign.append((15 + 16 * h + r) % 32)
        big.append((8 + 16 * h + r) % 32)
    return sign, big


SIGN_BITS, BIG_BITS = _base_bit_positions()


def relayout_codes(codes: torch.Tensor, chunk_rows: int = 1 << 12) -> torch.Tensor:
    """Stored 2-bit codes uint8 [..., N, K/4] → kernel words int32 [..., N, K/16] (in row chunks: int64 temporaries)."""
    flat = codes.reshape(-1, codes.shape[-1])
    words = [_relayout_rows(flat[i : i + chunk_rows]) for i in range(0, flat.shape[0], chunk_rows)]
    return torch.cat(words).view(*codes.shape[:-1], -1)


def _relayout_rows(codes: torch.Tensor) -> torch.Tensor:
    q = unpack_codes(codes).to(torch.int64)  # [..., N, K] codes 0..3 = −4, −1, +1, +4
    if q.shape[-1] % 16:
        raise ValueError(f"K must be a multiple of 16, got {q.shape[-1]}")
    negative = (q <= 1).to(torch.int64).unflatten(-1, (-1, 16))
    big = ((q == 0) | (q == 3)).to(torch.int64).unflatten(-1, (-1, 16))
    sign_shift = torch.tensor(SIGN_BITS, dtype=torch.int64, device=codes.device)
    big_shift = torch.tensor(BIG_BITS, dtype=torch.int64, device=codes.device)
    word = ((negative << sign_shift) | (big << big_shift)).sum(-1)
    return _as_int32(word)


def restore_codes(words: torch.Tensor) -> torch.Tensor:
    """Kernel words int32 [..., N, K/16] → stored 2-bit codes uint8 [..., N, K/4] (inverse of relayout_codes)."""
    from moet.quant.codebook import pack_codes

    w = words.to(torch.int64) & 0xFFFFFFFF
    sign_shift = torch.tensor(SIGN_BITS, dtype=torch.int64, device=words.device)
    big_shift = torch.tensor(BIG_BITS, dtype=torch.int64, device=words.device)
    negative = (w.unsqueeze(-1) >> sign_shift) & 1
    big = (w.unsqueeze(-1) >> big_shift) & 1
    code = torch.where(negative == 1, 1 - big, 2 + big).flatten(-2)
    return pack_codes(code.to(torch.uint8))


def _as_int32(word: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^32) → the int32 with the same bits."""
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def split_refinement(refine: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored refinement uint8 [..., N, K/16·5] → (int32 [..., N, K/16] of bytes 0-3, uint8 [..., N, K/16] byte 4)."""
    groups = refine.unflatten(-1, (-1, REFINE_BYTES))
    low = groups[..., :4].contiguous().view(torch.int32).squeeze(-1)
    return low, groups[..., 4].contiguous()


@dataclass
class StackedWeights:
    """One stacked projection (w13 or w2) of E experts in the kernels' layout.

    `words` int32 [E, N, K/16] (relaid 2-bit base), `scales` uint8 [E, N, K/B], `row_scale` f32 [E, N];
    optional FP4 tier: `fp4` int64 [E, N, K/16] (the source nibbles viewed as words) or
    `refine_lo` int32 [E, N, K/16] + `refine_hi` uint8 [E, N, K/16].
    """

    words: torch.Tensor
    scales: torch.Tensor
    scale_kind: str
    row_scale: torch.Tensor
    fp4: torch.Tensor | None = None
    refine_lo: torch.Tensor | None = None
    refine_hi: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        """(E, N, K)."""
        e, n, kw = self.words.shape
        return e, n, kw * 16

    @property
    def block(self) -> int:
        return 16 if self.scale_kind == "nv16" else 32

    @classmethod
    def from_stored(
        cls,
        codes: torch.Tensor,
        scales: torch.Tensor,
        scale_kind: str,
        row_scale: torch.Tensor,
        fp4: torch.Tensor | None = None,
        refine: torch.Tensor | None = None,
    ) -> "StackedWeights":
        """Re-lay stored stacked tensors (docs/FORMAT.md) into the kernels' layout, on their device."""
        if scale_kind not in ("nv16", "mx32"):
            raise ValueError(f"unknown scale kind {scale_kind!r}")
        refine_lo = refine_hi = None
        if refine is not None:
            refine_lo, refine_hi = split_refinement(refine)
        return cls(
            words=relayout_codes(codes).contiguous(),
            scales=scales.contiguous(),
            scale_kind=scale_kind,
            row_scale=row_scale.to(torch.float32).contiguous(),
            fp4=None if fp4 is None else fp4.contiguous().view(torch.int64),
            refine_lo=refine_lo,
            refine_hi=refine_hi,
        )

    def base_nbytes(self, experts: int = 1) -> int:
        """Bytes one expert's (or `experts` experts') 2-bit base occupies: what a decode step reads."""
        e = self.words.shape[0]
        total = self.words.numel() * 4 + self.scales.numel() + self.row_scale.numel() * 4
        return total * experts // e

    def tier_nbytes(self, tier: str, experts: int = 1) -> int:
        """Bytes an FP4-tier forward reads for `experts` experts ("fp4": planes + scales; "refine": base + digits)."""
        e = self.words.shape[0]
        scales_rows = self.scales.numel() + self.row_scale.numel() * 4
        if tier == "fp4":
            total = self.fp4.numel() * 8 + scales_rows
        elif tier == "refine":
            total = self.words.numel() * 4 + self.refine_lo.numel() * 4 + self.refine_hi.numel() + scales_rows
        else:
            raise ValueError(f"unknown tier {tier!r}")
        return total * experts // e
