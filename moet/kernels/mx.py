"""Operands of the block-scaled (MX) tensor-core path, built and multiplied on the host in plain torch.

The 2-bit base values ±1, ±4 are e2m1 values, so a base block with its UE8M0/32 scale is an MXFP4
block (and with e4m3/16 scales an NVFP4 block); the FP4 tier's nibbles are e2m1 already. The sm_120a
kernel (moet.kernels.blackwell) multiplies on `QMMA.SF` e4m3 × e4m3 with UE8M0/32 scales: Triton 3.9
lowers a mixed e4m3 × e2m1 `tl.dot_scaled` to bf16 HMMA there, so the weights are widened once more,
e2m1 nibble → e4m3 byte, which is exact (every e2m1 value × 2^-6 is an e4m3 number; the kernels
multiply by 2^6 in their f32 epilogue). Activations are quantized to e4m3 with a UE8M0 scale per 32 k, in
one term or two (the second the residual of the first).

Everything here is the definition the kernel is tested against: the weight operand from stored codes
or FP4 planes, the same operand recomputed with the kernel's bit operations on the GPU layout, the
activation quantization, and a float64 emulation of the block-scaled product and of the MoE over it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moet.kernels.layout import BIG_BITS, FP4_FIELD_SHIFTS, FP4_SIGN_SHIFTS, SIGN_BITS
from moet.quant.codebook import Tier, pack_nibbles, unpack_codes, unpack_nibbles
from moet.quant.scales import E4M3_VALUES, UE8M0_VALUES
from moet.quant.stacked import StackedWeight

MX_BLOCK = 32  # k per UE8M0 scale of kind::mxf8f6f4
E2M1_SHIFT = 6  # an e2m1 nibble placed in an e4m3 byte's low bits is its value × 2^-6
E4M3_MAX = 448.0
E2M1_OF_CODE = (0xE, 0xA, 0x2, 0x6)  # codes 0..3 = −4, −1, +1, +4: sign at bit 3, magnitude 1 → 0b010, 4 → 0b110


def e2m1_from_codes(codes: torch.Tensor) -> torch.Tensor:
    """Packed 2-bit codes uint8 [..., K/4] → packed e2m1 nibbles uint8 [..., K/2] (the MXFP4/NVFP4 form).

    Bit operations, not a table: sign = ¬(c >> 1), big = ¬(c ⊕ (c >> 1)) & 1, nibble = sign·8 + big·4 + 2.
    """
    c = unpack_codes(codes)
    sign = 1 - (c >> 1)
    big = 1 - ((c ^ (c >> 1)) & 1)
    return pack_nibbles((sign << 3) | (big << 2) | 2)


def e4m3_from_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 nibbles uint8 [..., K/2] → e4m3 bytes uint8 [..., K] worth value × 2^-6, exactly:
    the nibble's exponent and mantissa at bits 2..4, its sign at bit 7."""
    n = unpack_nibbles(packed)
    return ((n & 0x7) << 2) | ((n & 0x8) << 4)


def weight_operand(w: StackedWeight, tier: Tier) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 bytes uint8 [E, N, K], UE8M0 scale bytes uint8 [E, N, K/32]) of the kernel's weight operand.

    `tier` Tier.NONE (the base's codes) or Tier.PLANES (the FP4 planes); the weights they represent are value × 2^-6 ×
    scale × row scale (the row scale and 2^6 are the kernel's epilogue). UE8M0/32 scales only.
    """
    if w.scale_kind != "mx32":
        raise ValueError(f"the block-scaled e4m3 path takes UE8M0/32 scales (mx32), not {w.scale_kind!r}")
    nibbles = e2m1_from_codes(w.codes) if tier == Tier.NONE else w.fp4
    if nibbles is None:
        raise ValueError("this weight holds no FP4 planes")
    return e4m3_from_e2m1(nibbles), w.scales


def _rows_from_blocks(x: torch.Tensor, gate_up: bool) -> torch.Tensor:
    """[NB, r, g, K] in the layout's row-block order → [N, K] in stored row order (inverse of _mma_blocks)."""
    nb, _, _, k = x.shape
    if gate_up:
        return x.transpose(0, 1).reshape(nb * 16, k)
    return x.reshape(nb * 16, k)


def _halves_to_bytes(pairs: torch.Tensor) -> torch.Tensor:
    """Words holding an e4m3 byte in the low 8 bits of each 16-bit half → the two bytes (low half first)."""
    return torch.stack([pairs & 0xFF, (pairs >> 16) & 0xFF], dim=-1)


def _shift_right(w: torch.Tensor, n: int) -> torch.Tensor:
    """w >> n, or w << −n for n < 0, kept to 32 bits."""
    return w >> n if n >= 0 else (w << -n) & 0xFFFFFFFF


def base_pairs(w: torch.Tensor, pair: int) -> torch.Tensor:
    """The kernel's 2-bit decode of pair `pair` (int64 holding uint32 words): its signs (SIGN_BITS) → bit 7, its
    "big" bits (BIG_BITS) → bit 4 and the constant 0x08 of each half: two e4m3 bytes ±2^-6 / ±2^-4 (= ±1, ±4 × 2^-6)."""
    sign, big = SIGN_BITS[2 * pair], BIG_BITS[2 * pair]
    return (_shift_right(w, sign - 7) & 0x00800080) | (_shift_right(w, big - 4) & 0x00100010) | 0x00080008


def fp4_pairs(q: torch.Tensor, register: int) -> torch.Tensor:
    """The kernel's FP4 decode of operand register ρ: its e2m1 fields (bits 3ρ, +16) → bits 2..4, its
    signs (bits 12 + ρ, +16) → bit 7 of each half: two e4m3 bytes e2m1 × 2^-6."""
    shift = FP4_FIELD_SHIFTS[register] - 2
    field = (q << 2) & 0xFFFFFFFF if shift < 0 else q >> shift
    return (field & 0x001C001C) | ((q >> (FP4_SIGN_SHIFTS[register] - 7)) & 0x00800080)


def layout_operand(words: torch.Tensor, gate_up: bool) -> torch.Tensor:
    """The e4m3 weight bytes the kernel forms in registers from the GPU layout, back in stored order.

    `words`: StackedWeights.words int32 [E, N/16, K/128, 32, 4] (2-bit base) or FP4 slot words
    [E, N/16, K/128, 32, 8]; returns uint8 [E, N, K]. Same bit operations as moet.kernels.blackwell.
    """
    w = words.to(torch.int64) & 0xFFFFFFFF
    e, nb, kc = w.shape[:3]
    lanes = w.view(e, nb, kc, 8, 4, -1)  # [E, NB, KC, g, t, word]
    halves = []
    for r in range(2):
        if w.shape[-1] == 4:  # pair p = 4s + 2b + r of the word; k = 32t + 8·word + 4s + 2b + h
            pairs = torch.stack([base_pairs(lanes, 4 * s + 2 * b + r) for s in range(2) for b in range(2)], -1)
        else:  # word = k16 step s; register 2b + r; k = 32t + 4s + 2b + h
            pairs = torch.stack([fp4_pairs(lanes, 2 * b + r) for b in range(2)], -1)
        halves.append(_halves_to_bytes(pairs).reshape(e, nb, kc, 8, 128))
    x = torch.stack(halves, dim=2)  # [E, NB, r, KC, g, 128]
    x = x.transpose(3, 4).reshape(e, nb, 2, 8, kc * 128)
    return torch.stack([_rows_from_blocks(xe, gate_up) for xe in x]).to(torch.uint8)


def layout_scales(lane_scales: torch.Tensor, gate_up: bool) -> torch.Tensor:
    """The UE8M0 scale operand the kernel loads from StackedWeights.scales (uint8 [E, N/16, K/128, 32, 2]:
    byte r of lane 4g + t is rows g + 8r, k block t of the chunk), back in stored order [E, N, K/32]."""
    e, nb, kc = lane_scales.shape[:3]
    x = lane_scales.view(e, nb, kc, 8, 4, 2).permute(0, 1, 5, 3, 2, 4).reshape(e, nb, 2, 8, kc * 4)
    return torch.stack([_rows_from_blocks(xe, gate_up) for xe in x])


def quantize_activations(x: torch.Tensor, terms: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] → (e4m3 bytes uint8 [terms, T, K], UE8M0 bytes uint8 [terms, T, K/32]), the kernel's rule in
    float32: per 32 k the smallest power of two 2^e with amax / 2^e ≤ 448, then x / 2^e rounded to nearest
    even e4m3; each further term quantizes the exact residual the earlier ones left (0 where e = 0)."""
    blocks = x.to(torch.float32).unflatten(-1, (-1, MX_BLOCK))
    data, scales = [], []
    for _ in range(terms):
        bits = blocks.abs().amax(-1).view(torch.int32)
        exponent, mantissa = bits >> 23, bits & 0x7FFFFF
        scale = (exponent - 8 + (mantissa > 0x600000).to(torch.int32)).clamp(min=0)  # 448 = 1.75 · 2^8
        scaled = blocks * ((254 - scale) << 23).view(torch.float32).unsqueeze(-1)
        q = scaled.to(torch.float8_e4m3fn)
        blocks = (scaled - q.to(torch.float32)) * (scale << 23).view(torch.float32).unsqueeze(-1)
        data.append(q.view(torch.uint8).flatten(-2))
        scales.append(scale.to(torch.uint8))
    return torch.stack(data), torch.stack(scales)


def mx_values(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes uint8 [..., K] × UE8M0 bytes uint8 [..., K/32] → float64 [..., K] (what the MMA reads)."""
    values = E4M3_VALUES.to(data.device)[data.long()]
    return values * UE8M0_VALUES.to(data.device)[scales.long()].repeat_interleave(MX_BLOCK, dim=-1)


def block_scaled_matmul(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor) -> torch.Tensor:
    """float64 [M, N] = A · Bᵀ of two MX operands (A [M, K], B [N, K], both K-major, as the MMA takes them)."""
    return mx_values(a, a_scales) @ mx_values(b, b_scales).T


def mx_linear(
    x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, row_scale: torch.Tensor, terms: int
) -> torch.Tensor:
    """float64 [P, N]: activations x [P, K] quantized as the kernel does (`terms` e4m3 terms), times one
    expert's weight operand (e4m3 bytes [N, K], UE8M0 [N, K/32]), then its row scale and 2^6."""
    xq, xs = quantize_activations(x, terms)
    product = sum(block_scaled_matmul(q, s, data, scales) for q, s in zip(xq, xs))
    return product * (row_scale.double() * 2.0**E2M1_SHIFT)


def mx_moe_reference(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: StackedWeight,
    w2: StackedWeight,
    terms: int,
    fp4_experts: torch.Tensor | None = None,
) -> torch.Tensor:
    """float64 MoE [T, H] as the block-scaled kernel computes it (mx_linear per projection; the SiLU·up
    activations rounded to bf16 in between, as the kernel stores them). `fp4_experts` (bool [E]) marks
    experts computing in the FP4 tier."""
    ids = topk_ids.long()
    out = torch.zeros(x.shape[0], w2.shape[0], dtype=torch.float64)
    tiers = (Tier.NONE, Tier.PLANES) if fp4_experts is not None and bool(fp4_experts.any()) else (Tier.NONE,)
    operands = {tier: (weight_operand(w13, tier), weight_operand(w2, tier)) for tier in tiers}
    for e in torch.unique(ids).tolist():
        t, j = torch.nonzero(ids == e, as_tuple=True)
        tier = Tier.PLANES if fp4_experts is not None and bool(fp4_experts[e]) else Tier.NONE
        (a13, s13), (a2, s2) = operands[tier]
        gate, up = mx_linear(x[t], a13[e], s13[e], w13.row_scale[e], terms).chunk(2, dim=-1)
        y = mx_linear((F.silu(gate) * up).to(torch.bfloat16), a2[e], s2[e], w2.row_scale[e], terms)
        out.index_add_(0, t, y * topk_weights[t, j].double().unsqueeze(-1))
    return out
