"""FP4 nibbles → sign-symmetric 2-bit base {−4,−1,+1,+4} and the FP4 tier (planes, base-5 refinement).

Layouts are those of docs/FORMAT.md. Everything here is integer work on nibbles: FP4 sources keep
their own block scales, so the FP4 tier reproduces the source bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

import torch

from moet.quant.scales import SCALE_BLOCK, ScaleKind, apply_scales

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
BASE_VALUES = (-4.0, -1.0, 1.0, 4.0)
# Policy threshold: when this share of a tensor's zero nibbles has one sign, zeros alternate by k parity.
ZERO_SIGN_SHARE = 0.95
REFINE_GROUP = 16  # weights per 5-byte refinement group
REFINE_BYTES = 5


class Tier(StrEnum):
    """How an expert's FP4 tier is stored (docs/FORMAT.md): not at all, as whole planes (4 bits/weight),
    or as the base-5 refinement of the base (2.5 bits/weight). The one vocabulary of knobs, packs, layers
    and the compute side, where it names the weights an expert is read as: NONE the 2-bit base, PLANES
    and REFINE the FP4 tier rebuilt from that form. User-facing strings parse into it at the boundary."""

    NONE = "none"
    PLANES = "planes"
    REFINE = "refine"


# Bumped whenever the bytes this module produces for the same source change (pack files key on it).
QUANT_ABI = "moet-quant/1 base=sym(-4,-1,1,4) zeros=sign|parity@0.95 refine=b5x4/40bit"


def _fp4_table() -> torch.Tensor:
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)
    return torch.cat([mags, -mags])


FP4_VALUES = _fp4_table()  # index = nibble (bit 3 = sign)
BASE_VALUE_TABLE = torch.tensor(BASE_VALUES, dtype=torch.float64)


@dataclass
class QuantizedWeight:
    """One routed-expert matrix [N, K]: the 2-bit base and, optionally, its FP4 tier.

    Byte counts, the same on every type that has them (this, moet.quant.stacked.StackedWeight and the
    kernels' layout moet.kernels.layout.StackedWeights): `base_nbytes` is the 2-bit base (codes + block
    scales + f32 row scales), `tier_nbytes` the FP4 tier in the form the type holds it (whole planes, or
    the refinement with the zero-sign exceptions it keeps).
    """

    codes: torch.Tensor  # uint8 [N, K/4]
    scales: torch.Tensor  # uint8 [N, K/B]
    scale_kind: ScaleKind
    row_scale: torch.Tensor  # float32 [N]
    zero_policy: str  # "sign" | "parity"
    fp4: torch.Tensor | None = None  # uint8 [N, K/2] whole planes
    refine: torch.Tensor | None = None  # uint8 [N, K/16*5]
    zero_sign: int = 0
    zero_flips: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1] * 4

    def base_nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() + 4 * self.row_scale.numel()

    def tier_nbytes(self) -> int:
        planes = self.fp4.numel() if self.fp4 is not None else 0
        refine = self.refine.numel() + 8 * self.zero_flips.numel() if self.refine is not None else 0
        return planes + refine


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] → uint8 [..., K]; the low nibble holds the even k."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def pack_nibbles(nibbles: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K] → uint8 [..., K/2], inverse of unpack_nibbles."""
    pairs = nibbles.unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """2-bit codes uint8 [..., K] → uint8 [..., K/4], code of k at bits 2·(k mod 4)."""
    quads = codes.unflatten(-1, (-1, 4))
    return quads[..., 0] | (quads[..., 1] << 2) | (quads[..., 2] << 4) | (quads[..., 3] << 6)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/4] → 2-bit codes uint8 [..., K]."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 0x3).flatten(-2)


def zero_sign_stats(nibbles: torch.Tensor) -> tuple[str, int]:
    """The zero policy of one source tensor and its dominant zero sign bit (0 = +0, 1 = −0)."""
    return zero_policy_from_counts(*zero_counts(nibbles))


def zero_counts(nibbles: torch.Tensor) -> tuple[int, int]:
    """(zero nibbles, of which −0) in a tensor or one chunk of it."""
    histogram = torch.bincount(nibbles.flatten(), minlength=16)
    return int(histogram[0] + histogram[8]), int(histogram[8])


def zero_policy_from_counts(n_zero: int, n_negative: int) -> tuple[str, int]:
    """The zero policy from a tensor's zero-nibble count and how many of them are −0 (for chunked counting)."""
    if n_zero == 0:
        return "sign", 0
    dominant = 1 if n_negative * 2 > n_zero else 0
    share = max(n_negative, n_zero - n_negative) / n_zero
    return ("parity" if share >= ZERO_SIGN_SHARE else "sign"), dominant


def base_codes(nibbles: torch.Tensor, zero_policy: str) -> torch.Tensor:
    """FP4 nibbles uint8 [..., K] → 2-bit codes 0..3 (−4, −1, +1, +4)."""
    magnitude = nibbles & 0x7
    negative = nibbles >= 8
    if zero_policy == "parity":
        k = torch.arange(nibbles.shape[-1], device=nibbles.device)
        odd = (k % 2 == 1).expand_as(nibbles)
        negative = torch.where(magnitude == 0, odd, negative)
    elif zero_policy != "sign":
        raise ValueError(f"unknown zero policy {zero_policy!r}")
    big = (magnitude >= 5).to(torch.uint8)
    return torch.where(negative, 1 - big, 2 + big).to(torch.uint8)


def _refine_digits(nibbles: torch.Tensor) -> torch.Tensor:
    magnitude = (nibbles & 0x7).to(torch.int64)
    return torch.where(magnitude >= 5, magnitude - 5, magnitude)


def pack_refinement(digits: torch.Tensor) -> torch.Tensor:
    """Base-5 digits int64 [N, K] → uint8 [N, K/16·5] (four digits per 10 bits, 40 bits per 5 bytes)."""
    n = digits.shape[0]
    quads = digits.reshape(n, -1, 4)
    return _pack_tens(quads[..., 0] + 5 * quads[..., 1] + 25 * quads[..., 2] + 125 * quads[..., 3])


def _pack_tens(tens: torch.Tensor) -> torch.Tensor:
    """10-bit base-5 groups int64 [N, K/4] → uint8 [N, K/16·5], four groups per little-endian 40-bit word."""
    n = tens.shape[0]
    groups = tens.reshape(n, -1, 4)
    word = groups[..., 0] | (groups[..., 1] << 10) | (groups[..., 2] << 20) | (groups[..., 3] << 30)
    shifts = torch.arange(0, 40, 8, dtype=torch.int64, device=tens.device)
    return ((word.unsqueeze(-1) >> shifts) & 0xFF).to(torch.uint8).reshape(n, -1)


def unpack_refinement(refine: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/16·5] → base-5 digits int64 [N, K]."""
    n = refine.shape[0]
    raw = refine.reshape(n, -1, REFINE_BYTES).to(torch.int64)
    shifts = torch.arange(0, 40, 8, dtype=torch.int64, device=refine.device)
    word = (raw << shifts).sum(-1)
    tens = torch.stack([(word >> (10 * j)) & 0x3FF for j in range(4)], dim=-1)
    powers = torch.tensor([1, 5, 25, 125], dtype=torch.int64, device=refine.device)
    return ((tens.unsqueeze(-1) // powers) % 5).reshape(n, -1)


def refinement_from_fp4(nibbles: torch.Tensor, zero_policy: str, zero_sign: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Refinement bytes and the zero-sign exceptions (flat indices) of nibbles uint8 [N, K]."""
    if nibbles.shape[-1] % REFINE_GROUP:
        raise ValueError(f"refinement needs K % {REFINE_GROUP} == 0, got K={nibbles.shape[-1]}")
    return pack_refinement(_refine_digits(nibbles)), _zero_flips(nibbles, zero_policy, zero_sign)


def _zero_flips(nibbles: torch.Tensor, zero_policy: str, zero_sign: int) -> torch.Tensor:
    """Flat indices of the zeros whose sign bit differs from `zero_sign` (parity policy only)."""
    if zero_policy != "parity":
        return torch.zeros(0, dtype=torch.int64)
    zero = (nibbles & 0x7) == 0
    sign_bit = (nibbles >> 3).to(torch.int64)
    return torch.nonzero((zero & (sign_bit != zero_sign)).flatten()).flatten().cpu()


def _pair_nibbles() -> torch.Tensor:
    """The four nibbles (in k order) of every two-byte value 0..65535 read little-endian, uint8 [65536, 4]."""
    v = torch.arange(1 << 16, dtype=torch.int64)
    return torch.stack([v & 0xF, (v >> 4) & 0xF, (v >> 8) & 0xF, v >> 12], dim=-1).to(torch.uint8)


# Lookup tables over two packed FP4 bytes (four k, starting at an even k), built from the nibble-level
# definitions above so the fast path cannot drift from them: one gather per four weights instead of
# a dozen elementwise passes, about 10x faster on CPU.
_PAIRS = _pair_nibbles()
_CODE_LUT = {policy: pack_codes(base_codes(_PAIRS, policy)).flatten() for policy in ("sign", "parity")}
_TENS_LUT = (_refine_digits(_PAIRS) * torch.tensor([1, 5, 25, 125])).sum(-1)


_BYTE_ZEROS = torch.tensor([zero_counts(torch.tensor([b & 0xF, b >> 4], dtype=torch.uint8)) for b in range(256)], dtype=torch.int64)


def _pair_index(packed_fp4: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] → int64 [N, K/4]: each two consecutive bytes as byte0 | byte1 << 8 (little-endian hosts)."""
    return packed_fp4.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF


def _packed_zero_policy(packed_fp4: torch.Tensor) -> tuple[str, int]:
    """zero_sign_stats of packed bytes, from a 256-bin byte histogram."""
    histogram = torch.bincount(packed_fp4.flatten(), minlength=256).to(torch.int64)
    n_zero, n_negative = (histogram @ _BYTE_ZEROS.to(histogram.device)).tolist()
    return zero_policy_from_counts(n_zero, n_negative)


def nibbles_from_refinement(qw: QuantizedWeight) -> torch.Tensor:
    """Rebuild the exact FP4 nibbles uint8 [N, K] from the base codes and the refinement."""
    if qw.refine is None:
        raise ValueError("this weight has no refinement")
    codes = unpack_codes(qw.codes)
    digits = unpack_refinement(qw.refine)
    big = (codes == 0) | (codes == 3)
    magnitude = torch.where(big, digits + 5, digits)
    negative = codes <= 1
    if qw.zero_policy == "parity":
        zero_negative = torch.full_like(negative, bool(qw.zero_sign))
        if qw.zero_flips.numel():
            flat = zero_negative.flatten()
            flat[qw.zero_flips.to(flat.device)] ^= True
            zero_negative = flat.view_as(negative)
        negative = torch.where(magnitude == 0, zero_negative, negative)
    return (magnitude | (negative.to(torch.int64) << 3)).to(torch.uint8)


def base_from_fp4(
    packed_fp4: torch.Tensor,
    scales: torch.Tensor,
    scale_kind: ScaleKind,
    row_scale: torch.Tensor,
    tier: Tier = Tier.NONE,
    zero_policy: tuple[str, int] | None = None,
) -> QuantizedWeight:
    """Map FP4 packed nibbles uint8 [N, K/2] nibble by nibble to the 2-bit base, keeping the scales.

    `tier`: the FP4 tier kept beside the base (PLANES: the nibbles; REFINE: the base-5 refinement).
    `zero_policy` overrides the per-tensor policy (slices of a fused tensor share the whole tensor's).
    """
    if scale_kind not in SCALE_BLOCK:
        raise ValueError(f"unknown scale kind {scale_kind!r}")
    policy, dominant = zero_policy if zero_policy is not None else _packed_zero_policy(packed_fp4)
    if policy not in _CODE_LUT:
        raise ValueError(f"unknown zero policy {policy!r}")
    pair = _pair_index(packed_fp4)
    qw = QuantizedWeight(
        codes=_CODE_LUT[policy].to(pair.device)[pair],
        scales=scales.contiguous(),
        scale_kind=scale_kind,
        row_scale=row_scale.to(torch.float32).contiguous(),
        zero_policy=policy,
        zero_sign=dominant,
    )
    if tier == Tier.PLANES:
        qw.fp4 = packed_fp4.contiguous()
    elif tier == Tier.REFINE:
        if 2 * packed_fp4.shape[-1] % REFINE_GROUP:
            raise ValueError(f"refinement needs K % {REFINE_GROUP} == 0, got K={2 * packed_fp4.shape[-1]}")
        qw.refine = _pack_tens(_TENS_LUT.to(pair.device)[pair])
        if policy == "parity":
            qw.zero_flips = _zero_flips(unpack_nibbles(packed_fp4), policy, dominant)
    elif tier != Tier.NONE:
        raise ValueError(f"unknown FP4 tier {tier!r}")
    return qw


def decode_base(codes: torch.Tensor) -> torch.Tensor:
    """Packed 2-bit codes uint8 [N, K/4] → float64 values ±1/±4 [N, K]."""
    return BASE_VALUE_TABLE.to(codes.device)[unpack_codes(codes).long()]


def decode_fp4(packed_fp4: torch.Tensor) -> torch.Tensor:
    """Packed FP4 uint8 [N, K/2] → float64 e2m1 values [N, K]."""
    return FP4_VALUES.to(packed_fp4.device)[unpack_nibbles(packed_fp4).long()]


def dequantize_base(qw: QuantizedWeight) -> torch.Tensor:
    """What the 2-bit base represents, float64 [N, K]."""
    return apply_scales(decode_base(qw.codes), qw.scales, qw.scale_kind, qw.row_scale, inplace=True)


def fp4_nibbles(qw: QuantizedWeight) -> torch.Tensor:
    """The FP4 tier's packed nibbles uint8 [N, K/2], from whole planes or from the refinement."""
    if qw.fp4 is not None:
        return qw.fp4
    return pack_nibbles(nibbles_from_refinement(qw))


def dequantize_fp4(qw: QuantizedWeight) -> torch.Tensor:
    """What the FP4 tier represents, float64 [N, K]."""
    return apply_scales(decode_fp4(fp4_nibbles(qw)), qw.scales, qw.scale_kind, qw.row_scale, inplace=True)
