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

The CUDA decode kernels (kernels/moe_decode.cu) read a second, "mma" layout: per expert, 16-row
blocks × 128-k chunks, each chunk 32 lanes' operands of mma.sync m16n8k16 in lane order. Lane
(g, t) holds rows g and g+8 of the block for the 32 consecutive k 32t..32t+31 of the chunk, whose
positions in the MMA are permuted (k16 step s, operand half b, element h ↔ k offset 4s + 2b + h),
so that the lane's activations are one contiguous run and its block scales one per row. For w13
a block is 8 gate rows (g) and the matching 8 up rows (g+8). See docs/KERNELS.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moet.quant.codebook import REFINE_BYTES, unpack_codes, unpack_nibbles, unpack_refinement

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
    return _pack_base_words(q.unflatten(-1, (-1, 16)))


def _pack_base_words(q: torch.Tensor) -> torch.Tensor:
    """Codes int64 [..., 16] (0..3 = −4, −1, +1, +4), in word order → int32 [...] with the sign and "big"
    bit of weight i at SIGN_BITS[i] / BIG_BITS[i]."""
    negative = (q <= 1).to(torch.int64)
    big = ((q == 0) | (q == 3)).to(torch.int64)
    sign_shift = torch.tensor(SIGN_BITS, dtype=torch.int64, device=q.device)
    big_shift = torch.tensor(BIG_BITS, dtype=torch.int64, device=q.device)
    return _as_int32(((negative << sign_shift) | (big << big_shift)).sum(-1))


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


MMA_CHUNK = 128  # k per chunk of the mma layout


def _mma_blocks(rows: torch.Tensor, gate_up: bool) -> torch.Tensor:
    """[N, ...] → [N/16, 2, 8, ...]: each 16-row block as (rows g, rows g+8); for w13 gate and up rows."""
    n = rows.shape[0]
    if n % 16:
        raise ValueError(f"rows must be a multiple of 16, got {n}")
    if gate_up:
        return rows.view(2, n // 16, 8, *rows.shape[1:]).transpose(0, 1)
    return rows.view(n // 16, 2, 8, *rows.shape[1:])


def _mma_check_k(k: int) -> None:
    if k % MMA_CHUNK:
        raise ValueError(f"K must be a multiple of {MMA_CHUNK} for the decode kernels, got {k}")


def mma_base_words(codes: torch.Tensor, gate_up: bool) -> torch.Tensor:
    """Stored 2-bit codes uint8 [E, N, K/4] → int32 [E, N/16, K/128, 32, 4] (4 words per lane and chunk).

    Word w of a lane covers k offsets 8w..8w+7 of its run; its weight 2p + h (p = 4·s + 2·b + r: step s,
    operand half b, row half r) keeps sign and "big" bits at SIGN_BITS / BIG_BITS as in relayout_codes.
    """
    out = [_pack_base_words(_mma_pair_order(unpack_codes(c).to(torch.int64), gate_up)) for c in codes]
    return torch.stack([words.flatten(2, 3) for words in out])


def _mma_pair_order(values: torch.Tensor, gate_up: bool) -> torch.Tensor:
    """One expert's per-weight values [N, K] → [N/16, K/128, 8 g, 4 t, 4 words, 16]: each lane's base words,
    weight 2p + h of word w at k offset 8w + 4s + 2b + h of row g + 8r (p = 4s + 2b + r)."""
    _mma_check_k(values.shape[-1])
    x = _mma_blocks(values, gate_up).unflatten(-1, (-1, 4, 4, 2, 2, 2))  # [NB, r, g, KC, t, w, s, b, h]
    return x.permute(0, 3, 2, 4, 5, 6, 7, 1, 8).flatten(-4)  # [NB, KC, g, t, w, (s, b, r, h)]


FP4_FIELD_SHIFTS = (0, 3, 6, 9)  # e2m1 exponent+mantissa of operand register r at bit 3r (+16 for h = 1)
FP4_SIGN_SHIFTS = (12, 13, 14, 15)  # its sign at bit 12 + r (+16)


def mma_fp4_words(fp4: torch.Tensor, gate_up: bool) -> torch.Tensor:
    """FP4 planes uint8 [E, N, K/2] → int32 [E, N/16, K/128, 32, 8]: word s of a lane is k16 step s.

    Operand register r = 2·b + (row half) of the step; see decode_fp4 in kernels/moe_decode.cu.
    """
    out = []
    for expert_fp4 in fp4:
        nib = unpack_nibbles(expert_fp4).to(torch.int64)
        _mma_check_k(nib.shape[-1])
        x = _mma_blocks(nib, gate_up)  # [NB, rh, g, K]
        x = x.unflatten(-1, (-1, 4, 8, 2, 2))  # K → (chunk, t, s, b, h)
        x = x.permute(0, 3, 2, 4, 5, 6, 1, 7).flatten(-3)  # [NB, KC, g, t, s, (b, rh, h)]
        reg = torch.arange(4, device=fp4.device).repeat_interleave(2)
        half = torch.arange(2, device=fp4.device).repeat(4) * 16
        field_shift = torch.tensor(FP4_FIELD_SHIFTS, device=fp4.device)[reg] + half
        sign_shift = torch.tensor(FP4_SIGN_SHIFTS, device=fp4.device)[reg] + half
        word = (((x & 7) << field_shift) | ((x >> 3) << sign_shift)).sum(-1)
        out.append(_as_int32(word).flatten(2, 3))
    return torch.stack(out)


REFINE_GROUP_BITS = 10  # four base-5 digits


def mma_refine_planes(refine: torch.Tensor, gate_up: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored refinement uint8 [E, N, K/16·5] → (int32 [E, N/16, K/128, 32, 4], int32 [E, N/16, K/128, 32]).

    A lane's 64 digits per chunk, in the order of its base pairs (word q, pair p, half h), become 16
    groups j = 4q + p//2 of four digits, d(p, 0) + 5·d(p, 1) + 25·d(p+1, 0) + 125·d(p+1, 1), packed at
    bits 10j..10j+9 of the lane's 160 bits: words 0-3 in the first plane, word 4 in the second. Same bytes.
    """
    planes_a, planes_b = [], []
    for expert_refine in refine:
        x = _mma_pair_order(unpack_refinement(expert_refine), gate_up)  # [NB, KC, g, t, w, (p, h)]
        x = x.unflatten(-1, (4, 4))  # (p//2, (p%2, h))
        groups = (x * torch.tensor([1, 5, 25, 125], device=refine.device)).sum(-1).flatten(-2)  # [.., 16]
        words = []
        for i in range(5):
            word = torch.zeros(groups.shape[:-1], dtype=torch.int64, device=refine.device)
            for j in range(16):
                shift = REFINE_GROUP_BITS * j - 32 * i
                if -REFINE_GROUP_BITS < shift < 32:
                    part = groups[..., j] << shift if shift >= 0 else groups[..., j] >> -shift
                    word |= part & 0xFFFFFFFF
            words.append(_as_int32(word))
        planes_a.append(torch.stack(words[:4], dim=-1).flatten(2, 3))
        planes_b.append(words[4].flatten(2, 3))
    return torch.stack(planes_a), torch.stack(planes_b)


def mma_scales(scales: torch.Tensor, scale_kind: str, gate_up: bool) -> torch.Tensor:
    """Block scales uint8 [E, N, K/B] → uint8 [E, N/16, K/128, 32, bytes] in lane order.

    mx32: 2 bytes (row g, row g+8) of the lane's block; nv16: 4 bytes (row g: blocks 2t, 2t+1; row g+8: same).
    """
    per_lane = 1 if scale_kind == "mx32" else 2
    x = torch.stack([_mma_blocks(s, gate_up) for s in scales])  # [E, NB, r, g, K/B]
    x = x.unflatten(-1, (-1, 4, per_lane))  # (chunk, t, block of the lane)
    x = x.permute(0, 1, 4, 3, 5, 2, 6).flatten(-2)  # [E, NB, KC, g, t, (r, block)]
    return x.flatten(3, 4).contiguous()


@dataclass
class StackedWeights:
    """One stacked projection (w13 or w2) of E experts in the kernels' layout.

    `words` int32 [E, N, K/16] (relaid 2-bit base), `scales` uint8 [E, N, K/B], `row_scale` f32 [E, N];
    optional FP4 tier: `fp4` int64 [E, N, K/16] (the source nibbles viewed as words) or
    `refine_lo` int32 [E, N, K/16] + `refine_hi` uint8 [E, N, K/16]. With `mma=True` also the decode
    kernels' layout: `mma_words`, `mma_fp4` (if planes), `mma_refine` (if refinement) and `mma_scales`
    (module docstring).
    """

    words: torch.Tensor
    scales: torch.Tensor
    scale_kind: str
    row_scale: torch.Tensor
    fp4: torch.Tensor | None = None
    refine_lo: torch.Tensor | None = None
    refine_hi: torch.Tensor | None = None
    mma_words: torch.Tensor | None = None
    mma_fp4: torch.Tensor | None = None
    mma_refine: tuple[torch.Tensor, torch.Tensor] | None = None
    mma_scales: torch.Tensor | None = None

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
        mma: bool = False,
        gate_up: bool = False,
    ) -> "StackedWeights":
        """Re-lay stored stacked tensors (docs/FORMAT.md) into the kernels' layout, on their device.

        `mma`: also build the decode kernels' layout (`gate_up`: these are w13's gate and up rows).
        """
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
            mma_words=mma_base_words(codes, gate_up) if mma else None,
            mma_fp4=mma_fp4_words(fp4, gate_up) if mma and fp4 is not None else None,
            mma_refine=mma_refine_planes(refine, gate_up) if mma and refine is not None else None,
            mma_scales=mma_scales(scales, scale_kind, gate_up) if mma else None,
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
