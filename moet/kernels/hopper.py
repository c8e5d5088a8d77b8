"""The sm_90a prefill kernel in Gluon: 2-bit base or FP4 experts decoded into the wgmma's register operand.

Triton's moe_gemm_kernel cannot keep decoded weights in registers for wgmma: it round-trips them through
shared memory and waits for every wgmma (docs/KERNELS.md, "Prefill"). Gluon (triton.experimental.gluon,
Triton ≥ 3.6) states the kernel. One CTA of WARPS warps computes 16·WARPS weight rows (WARPS of the layout's
16-row blocks, one per warp) × BM pairs (moet.kernels.glue.align: one block of one expert's pairs). Per 128-k chunk

* the activation rows of its pairs arrive in shared-memory tiles (cp.async), already in the MMA's k order
  (moet.kernels.layout.mma_k_order: stage 13's input is permuted on the host, stage 2's is written that way by
  stage 13's epilogue): STAGES tiles in two allocations, chunk c in allocation c % 2, an odd number of chunks
  ahead, so that a chunk's wgmmas and the refill never touch the same allocation and the compiler's shared-memory
  hazard analysis adds no barrier of its own (one barrier a chunk, not two; Nsight had put 8% of the stall
  samples after that second one, H100 2026-12-06, docs/KERNELS.md);
* each warp decodes its block's words (2-bit: one LOP3, one IMAD and one HMUL2 per bf16 pair; FP4: two shifts,
  the masks and one HMUL2, as moet.kernels.gemm) straight into the A operand of wgmma: lane (g, t) holds rows g and
  g + 8 for the k that its words hold, so no decoded weight touches shared memory and the layout
  change moves no data;
* the chunk's wgmmas (A: the decoded weights in registers, B: the activations) run asynchronously while the
  warps decode the next chunk; only the previous chunk's wgmmas are waited for.

A weight tile is decoded once per BM pairs (up to 256, wgmma's widest N); the default tile
(moet.kernels.moe.GLUON_TILE) is 64 pairs, because wider ones pad an expert's pairs more and ran slower.
With a slot table a launch serves one tier (TIER 0: the experts at the 2-bit base, 1: those with an FP4 copy in
the pool; moet.kernels.moe launches both). Both scale kinds (UE8M0/32, e4m3/16).

FP8 (GemmConfig.fp8, VLLM_MOE_W2_PREFILL_FP8; TIER 0): the activations arrive as e4m3 with one f32 scale per row
(moet.kernels.moe.e4m3_rows); each 2-bit weight times its block scale over a power of two P per row and 128-k chunk
(moet.kernels.gemm.e4m3_power, from the chunk's scale bytes of the row) is an e4m3 value, written straight into the A
operand of an FP8 wgmma (k32 steps) as its byte: each block's two magnitudes are converted once
(cvt.rn.satfinite.e4m3x2.f32), and each register of four weights takes two shifts, a byte permute, three logic ops and
an IMAD (E4M3_REGISTER_PTX). Each chunk's wgmmas sum into a fresh partial that is added in f32 times the chunk's P,
because the FP8 wgmma's own accumulation over a whole K was 1.5% off. Row scale and activation scale multiply the sums.
Never interpreted: the CPU tests run the Triton kernels; this one runs on the H200 (tests/test_kernels.py).
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from moet.kernels.gemm import (
    BASE_PAIR_ONE, BASE_WORDS, BF16_PAIRS_PTX, FP4_WORDS, MUL_BF16X2_PTX, POST_BASE, SCALE_FP4, base_pair,
    e4m3_power, fp4_register, scale_pairs,
)

# Gluon is experimental and its API moves (3.7+ renamed async_copy_global_to_shared and thread_barrier): the
# kernel is built for the Triton it was measured with; elsewhere the oracle keeps the Triton kernels.
GLUON_TRITON = "3.6."


@functools.cache
def available(index: int) -> bool:
    """True on an sm_90 device (the wgmma and the inline PTX are sm_90a's) under Triton 3.6."""
    return triton.__version__.startswith(GLUON_TRITON) and torch.cuda.get_device_capability(index) == (9, 0)


@gluon.jit
def _mul_bf16x2(v, s):
    return gl.inline_asm_elementwise(MUL_BF16X2_PTX, "=r,r,r", [v, s], dtype=gl.uint32, is_pure=True, pack=1)


@gluon.jit
def _bf16_pairs(v):
    """uint32 bf16 pairs [...] → bf16 [..., 2] in the same registers."""
    return gl.inline_asm_elementwise(BF16_PAIRS_PTX, "=r,r,r", [gl.join(v, v)], dtype=gl.bfloat16, is_pure=True, pack=2)


# Two bf16 pairs → four e4m3 bytes in one register, element order kept: each bf16 widened to f32 (a shift or a
# mask), then cvt.rn.satfinite.e4m3x2.f32 (its first source to the high byte).
E4M3_QUAD_PTX = gl.constexpr(
    "{ .reg .b32 a, b, c, d; .reg .b16 lo, hi; shl.b32 a, $1, 16; and.b32 b, $1, 0xFFFF0000; "
    "cvt.rn.satfinite.e4m3x2.f32 lo, b, a; shl.b32 c, $2, 16; and.b32 d, $2, 0xFFFF0000; "
    "cvt.rn.satfinite.e4m3x2.f32 hi, d, c; mov.b32 $0, {lo, hi}; }"
)


@gluon.jit
def _e4m3_quads(v0, v1):
    """Two uint32 bf16 pairs → uint32: their four values as e4m3 bytes (exact where they are e4m3 values; rounded to
    nearest even below its smallest subnormal)."""
    return gl.inline_asm_elementwise(E4M3_QUAD_PTX, "=r,r,r", [v0, v1], dtype=gl.uint32, is_pure=True, pack=1)


# One register of the FP8 A operand (four e4m3 bytes) from a 2-bit word, ~6 instructions where a bf16 decode and a
# conversion took ~12. Each byte is sign·128 + S + big·D: S and S + D, the e4m3 bytes of the block's small and big
# magnitudes (_decode_fp8), carry no bit 7, so the sum is the byte. Two shifts put a pair's big bits at bit 0 and
# its signs at bit 7 of its bytes (moet.kernels.layout keeps them 7 bits apart), a byte permute takes bytes 0 and 2
# from one pair and 1 and 3 from the other, and one IMAD adds big·D. $1 the word, $2 S in every byte, $3 D, $4 and
# $5 the two pairs' shifts (right, left), $6 and $7 the sign bits taken from the permuted word and from the word
# itself (pair 7 keeps its signs in place and its big bits at 0 and 16, so its shift moves only those).
E4M3_REGISTER_PTX = gl.constexpr(
    "{ .reg .b32 x, y, c, s; shr.b32 x, $1, $4; shl.b32 y, $1, $5; prmt.b32 c, x, y, 0x7250; and.b32 s, c, $6; "
    "and.b32 x, $1, $7; or.b32 s, s, x; or.b32 s, s, $2; and.b32 c, c, 0x01010101; mad.lo.u32 $0, c, $3, s; }"
)
E4M3_SMALL_BIG = gl.constexpr(0x41004000)  # bf16 (8, 2): the base's magnitudes at exponent field BASE_PAIR_ONE


@gluon.jit
def _u32_bytes(q):
    """uint32 [...] → e4m3 [..., 2, 2], byte 2i + j at [..., i, j]: shifts and truncations that LLVM folds away, so
    that a wgmma reads q's own registers (an opaque move gave it copies, which its wait could not keep live)."""
    b0 = (q & 0xFF).to(gl.uint8)
    b1 = ((q >> 8) & 0xFF).to(gl.uint8)
    b2 = ((q >> 16) & 0xFF).to(gl.uint8)
    b3 = (q >> 24).to(gl.uint8)
    return gl.join(gl.join(b0, b2), gl.join(b1, b3)).to(gl.float8e4nv, bitcast=True)


@gluon.jit
def _lane_scales(scales_ptr, chunk, lane, SCALE_B: gl.constexpr):
    """A lane's scale bytes of a chunk as one word: UE8M0/32 16 bits (row halves r = 0, 1), e4m3/16 32 bits (byte
    2r + wb: block 2t + wb of row half r). Kept packed across the loop and unpacked where they are used (_scale_byte):
    loaded as bytes, they were unpacked right after the load, at the end of the iteration that issued it, which then
    waited the whole memory latency (the bf16 prefill's largest stall, H100 2026-12-06, docs/KERNELS.md). The FP8
    decode keeps its byte loads (_load_base_fp8): packed, it measured 0-5% slower."""
    if SCALE_B == 32:
        ptr = scales_ptr.to(gl.pointer_type(gl.uint16), bitcast=True)
    else:
        ptr = scales_ptr.to(gl.pointer_type(gl.uint32), bitcast=True)
    return gl.load(ptr + chunk * 32 + lane).to(gl.uint32)


@gluon.jit
def _scale_byte(packed, r, wb, SCALE_B: gl.constexpr):
    """Row half r's scale byte (e4m3/16: of block 2t + wb) from _lane_scales' word."""
    if SCALE_B == 32:
        shift = 8 * r
    else:
        shift = 8 * (2 * r + wb)
    return ((packed >> shift.to(gl.uint32)) & 0xFF).to(gl.uint8)


@gluon.jit
def _load_base(words_ptr, scales_ptr, blk, kc, KC, SCALE_B: gl.constexpr, SCALES: gl.constexpr, U: gl.constexpr):
    """Words [U u, 16 c] and their lane's scale word (_lane_scales) of chunk kc, both in SCALES sliced at r, U = 8 ·
    the CTA's blocks: u = 8·block + g, c = 4t + w (lane g·4 + t, its word w: k 32t + 8w ... + 7 of rows g and g + 8
    of the block)."""
    WORDS: gl.constexpr = gl.SliceLayout(2, SCALES)
    u = gl.arange(0, U, layout=gl.SliceLayout(1, WORDS))
    c = gl.arange(0, 16, layout=gl.SliceLayout(0, WORDS))
    chunk = (blk + u // 8) * KC + kc
    w = gl.load(words_ptr + chunk[:, None] * BASE_WORDS + ((u % 8)[:, None] * 4 + c[None, :] // 4) * 4 + c[None, :] % 4)
    return w, _lane_scales(scales_ptr, chunk[:, None], (u % 8)[:, None] * 4 + c[None, :] // 4, SCALE_B)


@gluon.jit
def _load_base_fp8(words_ptr, scales_ptr, blk, kc, KC, SCALE_B: gl.constexpr, P6: gl.constexpr):
    """_load_base for _decode_fp8: words [U u, 4 t, 2 wb, 2 wl] (word 2wb + wl of lane g·4 + t) and each distinct
    scale byte once: [U u, 4 t, 2 r] (UE8M0/32) or [U u, 4 t, 2 wb, 2 r] (e4m3/16: words 2wb, 2wb + 1 share block
    2t + wb). U = 8 · the CTA's blocks, u = 8·block + g."""
    U: gl.constexpr = 8 * P6.warps_per_cta[0]
    WORDS: gl.constexpr = gl.SliceLayout(4, gl.SliceLayout(4, P6))
    u = gl.arange(0, U, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, WORDS))))[:, None, None, None]
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, WORDS))))[None, :, None, None]
    wb = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, WORDS))))[None, None, :, None]
    wl = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, WORDS))))[None, None, None, :]
    lane = (u % 8) * 4 + t
    w = gl.load(words_ptr + ((blk + u // 8) * KC + kc) * BASE_WORDS + lane * 4 + 2 * wb + wl)
    if SCALE_B == 32:  # a byte per lane and row half
        SC: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, P6)))  # [u, t, r]
        us = gl.arange(0, U, layout=gl.SliceLayout(1, gl.SliceLayout(2, SC)))[:, None, None]
        ts = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, SC)))[None, :, None]
        rs = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, SC)))[None, None, :]
        offs = ((blk + us // 8) * KC + kc) * 64 + ((us % 8) * 4 + ts) * 2 + rs
    else:  # four a lane: byte 2r + wb, block 2t + wb of row half r
        SC: gl.constexpr = gl.SliceLayout(3, gl.SliceLayout(4, P6))  # [u, t, wb, r]
        us = gl.arange(0, U, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, SC))))[:, None, None, None]
        ts = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, SC))))[None, :, None, None]
        bs = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, SC))))[None, None, :, None]
        rs = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, SC))))[None, None, None, :]
        offs = ((blk + us // 8) * KC + kc) * 128 + ((us % 8) * 4 + ts) * 4 + 2 * rs + bs
    return w, gl.load(scales_ptr + offs)


@gluon.jit
def _load_fp4(fp4_ptr, scales_ptr, blk, fblk, kc, KC, SCALE_B: gl.constexpr, Q5: gl.constexpr):
    """FP4 words [U u, 4 t, 2 f, 4 s] of chunk kc of the copy's blocks fblk (lane g·4 + t, its k16 step 4f + s:
    k 32t + 16f + 4s ... + 3 of rows g and g + 8) and the scale bytes of the base's blocks blk for rows g and g + 8,
    each [U u, 4 t, 2 f, 1] (UE8M0/32: one per lane; e4m3/16: f selects block 2t + f)."""
    WORDS: gl.constexpr = gl.SliceLayout(4, Q5)
    U: gl.constexpr = 8 * Q5.warps_per_cta[0]
    u = gl.arange(0, U, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, WORDS))))[:, None, None, None]
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, WORDS))))[None, :, None, None]
    f = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, WORDS))))[None, None, :, None]
    s = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, WORDS))))[None, None, None, :]
    q = gl.load(fp4_ptr + ((fblk + u // 8) * KC + kc) * FP4_WORDS + (u % 8) * 32 + t * 8 + f * 4 + s)
    SCALES: gl.constexpr = gl.SliceLayout(3, WORDS)
    us = gl.arange(0, U, layout=gl.SliceLayout(1, gl.SliceLayout(2, SCALES)))[:, None, None]
    ts = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, SCALES)))[None, :, None]
    fs = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, SCALES)))[None, None, :]
    chunk = (blk + us // 8) * KC + kc
    lane = (us % 8) * 4 + ts
    if SCALE_B == 32:
        offs = chunk * 64 + lane * 2 + fs * 0
        r = 1
    else:
        offs = chunk * 128 + lane * 4 + fs
        r = 2
    return q, gl.expand_dims(gl.load(scales_ptr + offs), 3), gl.expand_dims(gl.load(scales_ptr + offs + r), 3)


@gluon.jit
def _decode(w, sc, SCALE_B: gl.constexpr, P4: gl.constexpr, A: gl.constexpr):
    """The wgmma A operand bf16 [16·blocks rows, 128 k] in registers, k in the MMA's order (moet.kernels.layout:
    step s, half b, element h at position 16s + 8b + 2t + h ↔ the lane's offset 4s + 2b + h): lane (g, t) of warp
    `block` holds rows g and g + 8 of its block, as its words do, so the layout change moves no data."""
    r = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, P4))))
    j = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, P4))))
    # pair j = 2s + b of row half r is pair p = 2j + r of its word (a constant per register: folded into the decode)
    p = (gl.expand_dims(gl.expand_dims(gl.expand_dims(r, 0), 1), 3)
         + gl.expand_dims(gl.expand_dims(gl.expand_dims(j, 0), 1), 2) * 2).to(gl.uint32)
    ww = gl.expand_dims(gl.expand_dims(w.to(gl.uint32, bitcast=True), 2), 3)
    ww, p = gl.broadcast(ww, p)
    # Both scale kinds multiply (HMUL2): UE8M0 as the exponent addend, as the decode kernels take it, made ptxas spend
    # ~90 byte permutes (PRMT) per chunk here and ran no faster (H100, 2026-12-05 18:26, docs/KERNELS.md).
    SCALES: gl.constexpr = gl.SliceLayout(3, P4)  # [u, c, r]
    rs = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, SCALES)))[None, None, :]
    cs = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, SCALES)))[None, :, None]
    sc = _scale_byte(gl.expand_dims(sc, 2), rs, (cs % 4) // 2, SCALE_B)  # words 2wb, 2wb + 1: block 2t + wb (e4m3/16)
    s = gl.broadcast(gl.expand_dims(scale_pairs(sc, SCALE_B, 1.0), 3), ww)[0]
    v = _mul_bf16x2(base_pair(ww, p, gl.full_like(ww, BASE_PAIR_ONE)), s)
    pairs = _bf16_pairs(v)  # [U u, 16 c, 2 r, 4 j, 2 h]
    BLOCKS: gl.constexpr = P4.warps_per_cta[0]
    # u = (block, g), c = (t, w), j = (s', b): row = 16·block + 8r + g, k = 16(2w + s') + 8b + 2t + h
    x = gl.reshape(pairs, [BLOCKS, 8, 4, 4, 2, 2, 2, 2])  # block, g, t, w, r, s', b, h
    x = gl.permute(x, (0, 4, 1, 3, 5, 6, 2, 7))  # block, r, g, w, s', b, t, h
    return gl.convert_layout(gl.reshape(x, [16 * BLOCKS, 128]), A, assert_trivial=True)


@gluon.jit
def _decode_fp8(w, sc, SCALE_B: gl.constexpr, P6: gl.constexpr):
    """_decode for an FP8 wgmma: (uint32 [U u, 4 t, 2 wb, 2 wl, 2 s', 2 r], each the four e4m3 bytes of one A register
    (_fp8_operand) of word w = 2wb + wl: pairs q = 4s' + r (bytes 0 and 2, halves h = 0 and 1) and q + 2 (bytes 1
    and 3), byte 2h + b; f32 [U u, 2 r]: the powers of two P of rows g and g + 8 in this chunk). Per block the bytes
    S, B of its magnitudes ±1, ±4 × scale / P come from the bf16 decode's own arithmetic and conversion (so every byte
    is what converting the decoded weight gives), each register from E4M3_REGISTER_PTX. w, sc: _load_base_fp8."""
    if SCALE_B == 32:  # the largest scale byte of each row over the lanes t (and the blocks wb)
        p = e4m3_power(gl.max(sc.to(gl.int32), axis=1), SCALE_B)  # [u, r]
    else:
        p = e4m3_power(gl.max(gl.max(sc.to(gl.int32), axis=2), axis=1), SCALE_B)
    b = ((0x7E800000 - p.to(gl.int32, bitcast=True)) >> 16).to(gl.uint32)  # 0.5 / P as bf16: the base's 1/2, 1 / P
    pre = b | (b << 16)
    if SCALE_B == 32:
        pre_b = gl.expand_dims(pre, 1)  # [u, 1, r]
    else:
        pre_b = gl.expand_dims(gl.expand_dims(pre, 1), 2)  # [u, 1, 1, r]
    sp = _mul_bf16x2(scale_pairs(sc, SCALE_B, 1.0), gl.broadcast(pre_b, sc)[0])
    v = _mul_bf16x2(gl.full_like(sp, E4M3_SMALL_BIG), sp)
    sb = _e4m3_quads(v, v)  # bytes S, B, S, B
    small = sb & 0xFF
    s4 = small * 0x01010101
    d = ((sb >> 8) & 0xFF) - small
    if SCALE_B == 32:  # [u, t, r] → [u, t, 1, 1, 1, r]
        s4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(s4, 2), 3), 4)
        d = gl.expand_dims(gl.expand_dims(gl.expand_dims(d, 2), 3), 4)
    else:  # [u, t, wb, r] → [u, t, wb, 1, 1, r]
        s4 = gl.expand_dims(gl.expand_dims(s4, 3), 4)
        d = gl.expand_dims(gl.expand_dims(d, 3), 4)
    R1: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, P6)))))
    S1: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(5, P6)))))
    r = gl.arange(0, 2, layout=R1)[None, None, None, None, None, :]
    q = gl.arange(0, 2, layout=S1)[None, None, None, None, :, None] * 4 + r  # the register's first pair (s' = q // 4)
    seven = q == 5  # its second pair is pair 7
    right = (q + 1).to(gl.uint32)
    left = gl.where(seven, 8, 5 - q).to(gl.uint32)
    from_c = gl.where(seven, 0x00800080, 0x80808080).to(gl.uint32)
    from_w = gl.where(seven, 0x80008000, 0).to(gl.uint32)
    ww = gl.expand_dims(gl.expand_dims(w.to(gl.uint32, bitcast=True), 4), 4)  # [u, t, wb, wl, 1, 1]
    regs = gl.inline_asm_elementwise(E4M3_REGISTER_PTX, "=r,r,r,r,r,r,r,r", [ww, s4, d, right, left, from_c, from_w],
                                     dtype=gl.uint32, is_pure=True, pack=1)  # arguments broadcast
    return regs, p


@gluon.jit
def _fp8_operand(q, A: gl.constexpr):
    """_decode_fp8's registers → the A operand e4m3 [16·blocks rows, 128 k]: k32 step w, half s', byte 2h + b of lane
    t at k 32w + 16s' + 4t + 2h + b (moet.kernels.layout.mma_k_order(…, fp8=True)); the registers are in the
    operand's order (row half r, then s'), so no byte moves."""
    BLOCKS: gl.constexpr = q.shape[0] // 8
    x = gl.reshape(_u32_bytes(q), [BLOCKS, 8, 4, 4, 2, 2, 2, 2])  # block, g, t, w, s', r, h, b
    x = gl.permute(x, (0, 5, 1, 3, 4, 2, 6, 7))  # block, r, g, w, s', t, h, b
    return gl.convert_layout(gl.reshape(x, [16 * BLOCKS, 128]), A, assert_trivial=True)


@gluon.jit
def _decode_fp4(q, sc_lo, sc_hi, SCALE_B: gl.constexpr, BLOCKS: gl.constexpr, A: gl.constexpr):
    """_decode for FP4 words: operand register ρ = 2b + r of a word keeps its e2m1 fields at bits 3ρ (+16) and its
    signs at 12 + ρ (+16) (decode_fp4 in moet/kernels/src/moe_decode.cu); the pair is e2m1·2^-126 × scale·2^63."""
    q = q.to(gl.uint32, bitcast=True)
    v00 = fp4_register(q, 0)  # rows g, k 2t + h
    v10 = fp4_register(q, 1)  # rows g + 8
    v01 = fp4_register(q, 2)  # rows g, k 2t + 8 + h
    v11 = fp4_register(q, 3)
    s_lo = gl.broadcast(scale_pairs(sc_lo, SCALE_B, SCALE_FP4), q)[0]
    s_hi = gl.broadcast(scale_pairs(sc_hi, SCALE_B, SCALE_FP4), q)[0]
    s = gl.join(s_lo, s_hi)
    pairs = _bf16_pairs(_mul_bf16x2(gl.join(gl.join(v00, v10), gl.join(v01, v11)), gl.join(s, s)))  # [U, t, f, s, r, b, h]
    # u = (block, g), step 4f + s: row = 16·block + 8r + g, k = 16(4f + s) + 8b + 2t + h
    x = gl.reshape(pairs, [BLOCKS, 8, 4, 8, 2, 2, 2])  # block, g, t, step, r, b, h
    x = gl.permute(x, (0, 4, 1, 3, 5, 2, 6))  # block, r, g, step, b, t, h
    return gl.convert_layout(gl.reshape(x, [16 * BLOCKS, 128]), A, assert_trivial=True)


@gluon.jit
def _partial_rows(p, ACC: gl.constexpr):
    """A chunk's powers of two [U u, 2 r] (_decode_fp8) as the rows of its partial (u = 8·block + g: row 16·block +
    8r + g), in the accumulator's row layout: lane (g, t) of warp `block` holds rows g and g + 8 in both."""
    BLOCKS: gl.constexpr = p.shape[0] // 8
    rows = gl.reshape(gl.permute(gl.reshape(p, [BLOCKS, 8, 2]), (0, 2, 1)), [16 * BLOCKS])
    return gl.convert_layout(rows, gl.SliceLayout(1, ACC), assert_trivial=True)


@gluon.jit
def _load(words_ptr, fp4_ptr, scales_ptr, blk, fblk, kc, KC, TIER: gl.constexpr, SCALE_B: gl.constexpr,
          SCALES: gl.constexpr, Q5: gl.constexpr, U: gl.constexpr, FP8: gl.constexpr, DEC: gl.constexpr):
    """A chunk's words and scale bytes: (words, scales, scales) — FP4: the scales of rows g and of rows g + 8."""
    if TIER == 1:
        w, sc, sc_hi = _load_fp4(fp4_ptr, scales_ptr, blk, fblk, kc, KC, SCALE_B, Q5)
    elif FP8:
        w, sc = _load_base_fp8(words_ptr, scales_ptr, blk, kc, KC, SCALE_B, DEC)
        sc_hi = sc
    else:
        w, sc = _load_base(words_ptr, scales_ptr, blk, kc, KC, SCALE_B, SCALES, U)
        sc_hi = sc
    return w, sc, sc_hi


@gluon.jit
def _decode_tier(w, sc, sc_hi, TIER: gl.constexpr, SCALE_B: gl.constexpr, DEC: gl.constexpr, A: gl.constexpr,
                 FP8: gl.constexpr):
    """A chunk's A operand, and (FP8) the powers of two of its rows (0 otherwise)."""
    p = 0
    if TIER == 1:
        a = _decode_fp4(w, sc, sc_hi, SCALE_B, DEC.warps_per_cta[0], A)
    elif FP8:
        a, p = _decode_fp8(w, sc, SCALE_B, DEC)
    else:
        a = _decode(w, sc, SCALE_B, DEC, A)
    return a, p


@gluon.jit
def _chunk(kc, xs_now, xs_refill, state, src, TIER: gl.constexpr, SCALE_B: gl.constexpr, SCALES: gl.constexpr,
           Q5: gl.constexpr, U: gl.constexpr, FP8: gl.constexpr, DEC: gl.constexpr, A: gl.constexpr, ACC: gl.constexpr,
           AHEAD: gl.constexpr):
    """One 128-k chunk: its wgmmas over the activations in xs_now (its ring), the refill of chunk kc + AHEAD into
    xs_refill (the other ring), the decode of chunk kc + 1 and the load of chunk kc + 2. state: the loop's (acc, part,
    a, a_prev, p, w, sc, sc_hi), returned updated; src: its inputs (x_rows, valid, KC, words_ptr, fp4_ptr, scales_ptr,
    blk, fblk)."""
    acc, part, a, a_prev, p, w, sc, sc_hi = state
    x_rows, valid, KC, words_ptr, fp4_ptr, scales_ptr, blk, fblk = src
    slot = (kc // 2) % xs_now.shape[0]
    async_copy.wait_group(AHEAD - 1)  # this thread's copies of chunk kc have landed
    gl.thread_barrier()  # everyone's; and every warpgroup has retired chunk kc - 2's wgmmas
    fence_async_shared()
    if FP8:  # each chunk into a fresh partial, added in f32 below: the FP8 wgmma's own accumulation is less
        # precise than f32 (over a whole K of 4,096-7,168 it was 1.5% off, H100 2026-12-06, docs/KERNELS.md)
        part = warpgroup_mma(_fp8_operand(a, A), xs_now.index(slot).permute((1, 0)), part, use_acc=False, is_async=True)
    else:
        acc = warpgroup_mma(a, xs_now.index(slot).permute((1, 0)), acc, is_async=True)
        acc, a_prev = warpgroup_mma_wait(1, deps=[acc, a_prev])  # chunk kc - 1's wgmmas (they read a_prev)
    ahead = kc + AHEAD
    async_copy.async_copy_global_to_shared(xs_refill.index((ahead // 2) % xs_refill.shape[0]), x_rows + ahead * 128,
                                           mask=valid[:, None] & (ahead < KC))
    async_copy.commit_group()
    a_prev = a
    if FP8:  # before the next decode: ptxas serializes the wgmmas (C7513) when it is overlapped with them
        part, a_prev = warpgroup_mma_wait(0, deps=[part, a_prev])
        acc = acc + part * _partial_rows(p, ACC)[:, None]
    a, p = _decode_tier(w, sc, sc_hi, TIER, SCALE_B, DEC, A, FP8)  # chunk kc + 1 (the last chunk decodes one it does not use)
    w, sc, sc_hi = _load(words_ptr, fp4_ptr, scales_ptr, blk, fblk, gl.minimum(kc + 2, KC - 1), KC, TIER, SCALE_B, SCALES,
                         Q5, U, FP8, DEC)
    return acc, part, a, a_prev, p, w, sc, sc_hi


@gluon.jit
def moe_prefill_sm90_kernel(
    x_ptr, out_ptr, words_ptr, scales_ptr, row_scale_ptr, slots_ptr, fp4_ptr, topk_w_ptr,
    sorted_ptr, block_expert_ptr, n_padded_ptr, x_scale_ptr,
    T, N_OUT, K, TOPK,
    STAGE: gl.constexpr, SCALE_B: gl.constexpr, HAS_SLOTS: gl.constexpr, TIER: gl.constexpr, BM: gl.constexpr,
    STAGES: gl.constexpr, WARPS: gl.constexpr, FP8: gl.constexpr,
):
    """STAGE 13: SiLU(gate)·up as bf16 rows per pair, its columns in the MMA's k order (the input stage 2 reads);
    STAGE 2: f32 rows per pair × the routing weight. x's columns are in the MMA's k order (mma_k_order).
    TIER 0: the experts at the 2-bit base (all of them without a slot table); 1: those with an FP4 slot (fp4_ptr).
    FP8 (TIER 0 only): x is e4m3 in the FP8 MMA's k order (mma_k_order(…, fp8=True)) with one f32 scale per row
    (x_scale_ptr), the weights enter an FP8 wgmma as e4m3 over a power of two per row and chunk (e4m3_power), and
    stage 13 writes its rows in that k order."""
    P4: gl.constexpr = gl.BlockedLayout([1, 4, 2, 4], [8, 4, 1, 1], [WARPS, 1, 1, 1], [3, 2, 1, 0])
    # FP4 words [u, t, f, s] (a lane's 8 per chunk), the last axis for the two row halves' scales
    Q5: gl.constexpr = gl.BlockedLayout([1, 1, 2, 4, 2], [8, 4, 1, 1, 1], [WARPS, 1, 1, 1, 1], [4, 3, 2, 1, 0])
    # FP8: the decode's registers [u, t, wb, wl, s', r] (_decode_fp8)
    P6: gl.constexpr = gl.BlockedLayout([1, 1, 2, 2, 2, 2], [8, 4, 1, 1, 1, 1], [WARPS, 1, 1, 1, 1, 1],
                                        [5, 4, 3, 2, 1, 0])
    DEC: gl.constexpr = P6 if FP8 else P4
    SCALES: gl.constexpr = gl.SliceLayout(3, P4)  # [u, c, r]
    X_LOAD: gl.constexpr = gl.BlockedLayout([1, 16 if FP8 else 8], [8, 4], [WARPS, 1], [1, 0])  # 16-byte copies
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                  instr_shape=[16, BM, 32 if FP8 else 16])
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=4 if FP8 else 2)
    OUT: gl.constexpr = gl.BlockedLayout([2, 1], [4 * WARPS, 32 // (4 * WARPS)], [1, WARPS], [0, 1])  # WARPS 4 or 8
    SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8 if FP8 else 16, rank=2)
    ROWS: gl.constexpr = 16 * WARPS
    U: gl.constexpr = 8 * WARPS  # (block, g): a lane's rows g and g + 8, one 16-row block per warp
    # Chunks in flight: odd (the refill's ring is not the one read) and at most STAGES - 2 (a slot is refilled only after
    # every warpgroup retired the chunk it held: the chunk STAGES before, in a ring of STAGES / 2 slots).
    gl.static_assert(STAGES % 2 == 0 and STAGES >= 4, "two rings of at least two slots each")
    AHEAD: gl.constexpr = STAGES // 2 if (STAGES // 2) % 2 == 1 else STAGES // 2 - 1
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    expert = gl.load(block_expert_ptr + pid_m)
    active = pid_m * BM < gl.load(n_padded_ptr)
    if HAS_SLOTS:
        slot = gl.load(slots_ptr + expert)
        if TIER == 1:
            active = active & (slot >= 0)
        else:
            active = active & (slot < 0)
    if active:
        M = T * TOPK
        if STAGE == 13:
            n_w = 2 * N_OUT
        else:
            n_w = N_OUT
        KC = K // 128
        blk = expert.to(gl.int64) * (n_w // 16) + pid_n * WARPS  # the base's blocks (and the scales of both tiers)
        if TIER == 1:
            fblk = slot.to(gl.int64) * (n_w // 16) + pid_n * WARPS
            post = SCALE_FP4
        else:
            fblk = blk
            post = POST_BASE
        if FP8:  # the base's 1/2 is in each chunk's 1 / P (_decode_fp8)
            post = 1.0
        pair = gl.load(sorted_ptr + pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, X_LOAD)))
        valid = pair < M
        pair = gl.where(valid, pair, 0)
        if STAGE == 13:
            x_row = pair // TOPK
        else:
            x_row = pair
        x_rows = x_ptr + x_row.to(gl.int64)[:, None] * K + gl.arange(0, 128, layout=gl.SliceLayout(0, X_LOAD))[None, :]
        # chunk c in ring c % 2, slot (c // 2) % (STAGES // 2) (the module docstring says why two)
        xs_even = gl.allocate_shared_memory(gl.float8e4nv if FP8 else gl.bfloat16, [STAGES // 2, BM, 128], SMEM)
        xs_odd = gl.allocate_shared_memory(gl.float8e4nv if FP8 else gl.bfloat16, [STAGES // 2, BM, 128], SMEM)
        for i in gl.static_range(AHEAD):
            ring = xs_even if i % 2 == 0 else xs_odd
            async_copy.async_copy_global_to_shared(ring.index(i // 2), x_rows + i * 128, mask=valid[:, None] & (i < KC))
            async_copy.commit_group()
        w, sc, sc_hi = _load(words_ptr, fp4_ptr, scales_ptr, blk, fblk, 0, KC, TIER, SCALE_B, SCALES, Q5, U, FP8, DEC)
        a, p = _decode_tier(w, sc, sc_hi, TIER, SCALE_B, DEC, A, FP8)
        w, sc, sc_hi = _load(words_ptr, fp4_ptr, scales_ptr, blk, fblk, gl.minimum(1, KC - 1), KC, TIER, SCALE_B, SCALES,
                             Q5, U, FP8, DEC)
        a_prev = a
        acc = gl.zeros([ROWS, BM], gl.float32, layout=ACC)
        part = acc  # FP8: a chunk's sum (its registers passed on to the next chunk's wgmmas, which overwrite them)
        state = (acc, part, a, a_prev, p, w, sc, sc_hi)
        src = (x_rows, valid, KC, words_ptr, fp4_ptr, scales_ptr, blk, fblk)
        for kc2 in range(0, KC - 1, 2):  # chunks in pairs: even from xs_even, odd from xs_odd
            state = _chunk(kc2, xs_even, xs_odd, state, src, TIER, SCALE_B, SCALES, Q5, U, FP8, DEC, A, ACC, AHEAD)
            state = _chunk(kc2 + 1, xs_odd, xs_even, state, src, TIER, SCALE_B, SCALES, Q5, U, FP8, DEC, A, ACC, AHEAD)
        if KC % 2 == 1:
            state = _chunk(KC - 1, xs_even, xs_odd, state, src, TIER, SCALE_B, SCALES, Q5, U, FP8, DEC, A, ACC, AHEAD)
        acc, part, a, a_prev, p, w, sc, sc_hi = state
        acc, a_prev = warpgroup_mma_wait(0, deps=[acc, a_prev])
        async_copy.wait_group(0)
        # acc rows: 16·block + 8r + g; r = 0: gate rows / rows g, r = 1: up rows / rows g + 8
        lo, hi = gl.split(gl.permute(gl.reshape(acc, [WARPS, 2, 8, BM]), (0, 2, 3, 1)))
        lo = gl.convert_layout(gl.reshape(lo, [ROWS // 2, BM]), OUT)
        hi = gl.convert_layout(gl.reshape(hi, [ROWS // 2, BM]), OUT)
        i = gl.arange(0, ROWS // 2, layout=gl.SliceLayout(1, OUT))
        pair_o = gl.load(sorted_ptr + pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(0, OUT)))
        valid_o = (pair_o < M)[None, :]
        pair64 = gl.where(pair_o < M, pair_o, 0).to(gl.int64)[None, :]
        rs = row_scale_ptr + expert.to(gl.int64) * n_w
        if STAGE == 13:
            col = pid_n * (ROWS // 2) + i  # gate row; the up row is N_OUT + col
            rs_gate = gl.load(rs + col) * post
            rs_up = gl.load(rs + N_OUT + col) * post
            if FP8:
                x_scale = gl.load(x_scale_ptr + pair64 // TOPK, mask=valid_o, other=0.0)
                lo = lo * x_scale
                hi = hi * x_scale
            gate = lo * rs_gate[:, None]
            up = hi * rs_up[:, None]
            h = gate / (1.0 + gl.exp(-gate)) * up
            c = col % 128  # stage 2's k: column c = 32t + 8w + 4s' + 2b + h of its chunk
            if FP8:  # at 32w + 16s' + 4t + 2h + b
                pos = col - c + ((c // 8) % 4) * 32 + ((c // 4) % 2) * 16 + (c // 32) * 4 + (c % 2) * 2 + (c // 2) % 2
            else:  # at 16(2w + s') + 8b + 2t + h
                pos = col - c + ((c // 4) % 8) * 16 + ((c // 2) % 2) * 8 + (c // 32) * 2 + c % 2
            gl.store(out_ptr + pair64 * N_OUT + pos[:, None], h.to(gl.bfloat16), mask=valid_o)
        else:
            row = (pid_n * WARPS + i // 8) * 16 + i % 8  # rows g; rows g + 8 come from hi
            route_w = gl.load(topk_w_ptr + gl.where(pair_o < M, pair_o, 0), mask=pair_o < M, other=0.0)[None, :]
            rs_lo = gl.load(rs + row) * post
            rs_hi = gl.load(rs + row + 8) * post
            if FP8:
                route_w = route_w * gl.load(x_scale_ptr + pair64, mask=valid_o, other=0.0)
            offs = pair64 * N_OUT + row[:, None]
            gl.store(out_ptr + offs, lo * rs_lo[:, None] * route_w, mask=valid_o)
            gl.store(out_ptr + offs + 8, hi * rs_hi[:, None] * route_w, mask=valid_o)
