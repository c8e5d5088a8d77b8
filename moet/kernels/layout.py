"""Stacked expert weights as the GPU kernels read them: one layout, built once at load.

Every GPU kernel (the CUDA decode kernels and the Triton prefill kernels) reads the same tensors,
so each expert's bytes are on the GPU once: the 2-bit base at 2 bits/weight plus its block scales
(2.25 bits/weight with UE8M0/32, 2.5 with e4m3/16) and an f32 row scale per row. The FP4 tier is
not part of a layer: FP4 copies live in the slots of the FP4 pool (moet.tier.slots), in the FP4
form of the same layout, and a per-expert slot table decides, inside one launch, which experts
read their FP4 copy.

The layout, per expert, is 16-row blocks × 128-k chunks, each chunk the 32 lanes' operands of
mma.sync m16n8k16 in lane order. Lane (g, t) holds rows g and g+8 of the block for the 32
consecutive k 32t..32t+31 of the chunk, whose positions in the MMA are permuted (k16 step s, operand
half b, element h ↔ k offset 4s + 2b + h), so that the lane's activations are one contiguous run
and its block scales one per row. For w13 a block is 8 gate rows (g) and the matching 8 up rows
(g+8). 2-bit words: each 16-bit half of a word keeps a weight's sign and "big" bit (|value| = 4)
where one mask and one multiply-add (the block scale's exponent field as the addend) turn them into a
bf16 pair (±2 or ±8 times the block scale, twice the base value: the kernels halve the result). See
docs/KERNELS.md and docs/FORMAT.md "Decode layout".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moet.quant.codebook import unpack_nibbles
from moet.quant.scales import SCALE_BLOCK, ScaleKind
from moet.quant.stacked import StackedWeight

BASE_PAIR_ONE = 0x40004000  # bf16 2.0 in both halves: the exponent field added where the scale is not a power of two


def _base_bit_positions() -> tuple[list[int], list[int]]:
    """Bit positions (sign, big) of the 16 weights of a 2-bit word: weight 2p + h (pair p, half h) keeps its big bit
    at p + 1 and its sign at p + 8 for p < 7, and at 0 and 15 for p = 7 (+16 for h = 1). A mask and a multiply by
    2^(7 − p) (for pair 7: by 2^8, the sign already in place) put them at bits 8 and 15 of the half, where adding an
    exponent field makes the pair bf16 (decode_base in moet/kernels/src/moe_decode.cu): no rotation, so the decode
    runs one ALU and one FMA-pipe instruction a pair instead of two ALU ones (docs/KERNELS.md)."""
    sign, big = [], []
    for k in range(16):
        p, h = divmod(k, 2)
        sign.append((p + 8 if p < 7 else 15) + 16 * h)
        big.append((p + 1 if p < 7 else 0) + 16 * h)
    return sign, big


SIGN_BITS, BIG_BITS = _base_bit_positions()


def _as_int32(word: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^32) → the int32 with the same bits."""
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


MMA_CHUNK = 128  # k per chunk of the mma layout
CONVERT_WEIGHTS = 1 << 26  # weights re-laid at once: the table lookup's temporaries take ~4 bytes a weight


def mma_k_order(x: torch.Tensor, fp8: bool = False) -> torch.Tensor:
    """Activations [..., K] with each 128-k chunk in the MMA's k order: the lane offset 4s + 2b + h of lane t
    (k 32t + 4s + 2b + h) at position 16s + 8b + 2t + h, the order of a wgmma whose A operand is the decoded
    weights in registers (moet.kernels.hopper) and whose B operand is these columns in shared memory. `fp8`: the
    order of the FP8 wgmma (k32 steps, four bytes of a lane per register): lane offset 8w + 4s' + 2b + h at position
    32w + 16s' + 4t + 2h + b (moet.kernels.hopper._decode_fp8 fills a register's bytes 0 and 2 from one pair)."""
    if fp8:
        return x.unflatten(-1, (-1, 4, 8, 2, 2)).movedim(-4, -3).transpose(-2, -1).flatten(-5)
    return x.unflatten(-1, (-1, 4, 8, 2, 2)).movedim(-4, -2).flatten(-5)


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


def _base_word_table() -> torch.Tensor:
    """int32 [4 (row half r, byte s), 256]: the bits one stored code byte sets in its mma word.

    A word of a lane covers 8 consecutive k of rows g and g+8: stored bytes s = 0, 1 (k offsets 4s..4s+3)
    of each row. Weight q of a byte (bits 2q, 2q+1; q = 2b + h) is word weight 2p + h with p = 4s + 2b + r,
    whose sign and "big" bit sit at SIGN_BITS / BIG_BITS (codes 0..3 = −4, −1, +1, +4)."""
    byte = torch.arange(256, dtype=torch.int64)
    table = torch.zeros(2, 2, 256, dtype=torch.int64)
    for r in range(2):
        for s in range(2):
            for q in range(4):
                code = (byte >> (2 * q)) & 3
                i = 2 * (4 * s + 2 * (q // 2) + r) + q % 2
                negative, big = (code <= 1).to(torch.int64), ((code == 0) | (code == 3)).to(torch.int64)
                table[r, s] |= (negative << SIGN_BITS[i]) | (big << BIG_BITS[i])
    return _as_int32(table.view(4, 256))


BASE_WORD_TABLE = _base_word_table()


def mma_base_words(codes: torch.Tensor, gate_up: bool) -> torch.Tensor:
    """Stored 2-bit codes uint8 [E, N, K/4] → int32 [E, N/16, K/128, 32, 4] (4 words per lane and chunk).

    Word w of a lane covers k offsets 8w..8w+7 of its run; its weight 2p + h (p = 4·s + 2·b + r: step s,
    operand half b, row half r) keeps sign and "big" bits at SIGN_BITS / BIG_BITS. Built from the stored
    bytes by table lookups (BASE_WORD_TABLE), as many experts at once as CONVERT_WEIGHTS allows (a Kimi-K2
    w13 of 384 experts at once took 22 GiB of temporaries): on a GPU it runs as the device cache's misses
    arrive, and at load."""
    e, n, kq = codes.shape
    at_once = max(1, CONVERT_WEIGHTS // (n * 4 * kq))
    if e > at_once:
        return torch.cat([mma_base_words(part, gate_up) for part in codes.split(at_once)])
    _mma_check_k(4 * kq)
    blocks = _mma_blocks(codes.transpose(0, 1), gate_up).movedim(3, 0)  # [E, NB, r, g, K/4]
    nb = blocks.shape[1]
    x = blocks.unflatten(-1, (-1, 4, 4, 2))  # K/4 → (chunk, t, w, byte s)
    x = x.permute(0, 1, 4, 3, 5, 6, 2, 7)  # [E, NB, KC, g, t, w, r, s]
    index = x.to(torch.int32) + 256 * torch.arange(4, dtype=torch.int32, device=codes.device).view(2, 2)
    parts = BASE_WORD_TABLE.to(codes.device).view(-1)[index.long()]  # [..., r, s]: disjoint bits
    words = parts[..., 0, 0] | parts[..., 0, 1] | parts[..., 1, 0] | parts[..., 1, 1]
    return words.reshape(e, nb, -1, 32, 4)


FP4_FIELD_SHIFTS = (0, 3, 6, 9)  # e2m1 exponent+mantissa of operand register r at bit 3r (+16 for h = 1)
FP4_SIGN_SHIFTS = (12, 13, 14, 15)  # its sign at bit 12 + r (+16)


def mma_fp4_words(fp4: torch.Tensor, gate_up: bool) -> torch.Tensor:
    """FP4 planes uint8 [E, N, K/2] → int32 [E, N/16, K/128, 32, 8]: word s of a lane is k16 step s.

    Operand register r = 2·b + (row half) of the step; see decode_fp4 in moet/kernels/src/moe_decode.cu.
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


def mma_scales(scales: torch.Tensor, scale_kind: ScaleKind, gate_up: bool) -> torch.Tensor:
    """Block scales uint8 [E, N, K/B] → uint8 [E, N/16, K/128, 32, bytes] in lane order (lane = 4g + t).

    mx32: 2 bytes (row g, row g+8) of the lane's block; nv16: 4 bytes (row g: blocks 2t, 2t+1; row g+8: same).
    """
    per_lane = 1 if scale_kind == ScaleKind.MX32 else 2
    x = torch.stack([_mma_blocks(s, gate_up) for s in scales])  # [E, NB, r, g, K/B]
    x = x.unflatten(-1, (-1, 4, per_lane))  # (chunk, t, block of the lane)
    x = x.permute(0, 1, 4, 3, 5, 2, 6).flatten(-2)  # [E, NB, KC, g, t, (r, block)]
    return x.flatten(3, 4).contiguous()


@dataclass
class StackedWeights:
    """One stacked projection (w13 or w2) of E experts in the kernels' layout (module docstring), built
    from its stored stack by `from_stacked`.

    `words` int32 [E, N/16, K/128, 32, 4] (the 2-bit base), `scales` uint8 [E, N/16, K/128, 32, bytes]
    (2 bytes per lane with UE8M0/32, 4 with e4m3/16), `row_scale` f32 [E, N] in checkpoint row order.
    E may also count the slots of the device expert cache. The layout permutes the stored base's bytes,
    so `base_nbytes` is the stored stack's (byte counts: moet.quant.codebook.QuantizedWeight); it holds
    no FP4 tier: FP4 copies live in the pool's slots, `fp4_nbytes` each.
    """

    words: torch.Tensor
    scales: torch.Tensor
    scale_kind: ScaleKind
    row_scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int]:
        """(E, N, K)."""
        e, nb, kc = self.words.shape[:3]
        return e, nb * 16, kc * MMA_CHUNK

    @property
    def block(self) -> int:
        return SCALE_BLOCK[self.scale_kind]

    @classmethod
    def from_stacked(cls, stack: StackedWeight, device: torch.device, gate_up: bool) -> "StackedWeights":
        """A stored stack's 2-bit base (docs/FORMAT.md) re-laid on `device`, converted there; `gate_up`: the
        stack is w13 (gate rows then up rows). Its FP4 tier, if any, stays behind (fp4_host_words)."""
        return cls(
            words=mma_base_words(stack.codes.to(device), gate_up),
            scales=mma_scales(stack.scales.to(device), stack.scale_kind, gate_up),
            scale_kind=ScaleKind(stack.scale_kind),
            row_scale=stack.row_scale.to(device, torch.float32).contiguous(),
        )

    def base_nbytes(self, experts: int | None = None) -> int:
        """Bytes of the 2-bit base of all experts (or of `experts` of them): what the GPU holds, and what a
        decode step reads."""
        total = sum(t.numel() * t.element_size() for t in (self.words, self.scales, self.row_scale))
        return total if experts is None else total * experts // self.words.shape[0]

    def fp4_nbytes(self, experts: int = 1) -> int:
        """Bytes `experts` FP4 copies of this projection take in the pool's slots: their tier_nbytes as whole
        planes (4 bits/weight; the copies read the base's scales)."""
        e, n, k = self.shape
        return experts * n * k // 2


def gpu_layer(
    w13: StackedWeight, w2: StackedWeight, device: torch.device, fp4: bool
) -> tuple[StackedWeights, StackedWeights, list[torch.Tensor]]:
    """One MoE layer's stacked experts (on the host) → the kernels' layout on `device`, plus, with `fp4`,
    pinned host copies of the FP4 tier in the slots' layout (int32 [E, ...] per projection), which the
    pool copies into VRAM slots on promotion. Converted on the device, one projection at a time."""
    w13_laid, w2_laid = (StackedWeights.from_stacked(stack, device, gate_up) for stack, gate_up in ((w13, True), (w2, False)))
    return w13_laid, w2_laid, fp4_host_words(w13, w2, device) if fp4 else []


def fp4_host_words(w13: StackedWeight, w2: StackedWeight, device: torch.device) -> list[torch.Tensor]:
    """One layer's FP4 tier (host stacks) as the pool's slots hold it: int32 [E, ...] per projection in the
    kernels' layout, pinned on the host; converted on `device`."""
    host = []
    for stack, gate_up in ((w13, True), (w2, False)):
        words = mma_fp4_words(stack.fp4_planes().to(device), gate_up).cpu()
        host.append(words.pin_memory() if torch.cuda.is_available() else words)
    return host


@dataclass(frozen=True)
class Fp4Slots:
    """FP4 copies an MoE forward may read instead of the base: the pool's planes and one layer's slot table.

    `table` int32 [E]: the slot holding expert e's FP4 copy, −1 for the 2-bit base (a device tensor,
    rewritten in place between steps, so captured graphs read the current one); `w13`, `w2` int32
    [S, N/16, K/128, 32, 8]: the slots' FP4 words in the kernels' layout (mma_fp4_words).
    """

    table: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor

    @classmethod
    def every_expert(cls, w13: torch.Tensor, w2: torch.Tensor) -> "Fp4Slots":
        """Every expert at FP4 from its own planes (slot e = expert e): the FP4 forward of a layer."""
        table = torch.arange(w13.shape[0], dtype=torch.int32, device=w13.device)
        return cls(table, w13, w2)
