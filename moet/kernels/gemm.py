"""Triton MoE expert GEMMs over the kernels' one weight layout (moet.kernels.layout), mixed tiers per expert.

One kernel source serves both projections and both routings:

* STAGE 13: the fused gate/up projection; each program computes R gate rows and the matching R up
  rows (the two row halves of the layout's 16-row blocks), applies SiLU(gate)·up and writes bf16
  activations, one row per (token, slot) pair.
* STAGE 2: the down projection; each program multiplies by the routing weight and writes f32 rows
  per pair, so that the combine is a fixed-order sum (deterministic, no atomics).
* ROUTE 0 (decode, few tokens): program (p, n) serves the expert of pair p for *all* tokens routed
  to it (BM ≥ T) and does nothing when an earlier pair already named that expert; no alignment pass.
* ROUTE 1 (prefill): vLLM-style blocks of BM pairs sorted by expert (moet.kernels.glue.align). With
  ROWS_FIRST the grid runs a block's row blocks next to each other (axis 0), so that its activations are
  read from HBM about once (moet.kernels.moe chooses it for the wide tile).

Tiers: with a slot table (HAS_SLOTS), an expert whose entry is a slot ≥ 0 reads its FP4 copy from
that slot of the pool, the others read the 2-bit base: one launch, a branch per program (TIERS 2), or,
for prefill, a launch per tier (TIERS 0: base experts only, 1: FP4 experts only), so that neither body
carries the other's registers.

Weights are decoded in registers to bf16 pairs with the block scale applied and fed as the *left*
operand of tl.dot (swap-AB: weight rows are the MMA's M, tokens its N). A chunk of the layout is 128 k
of 8 row pairs (rows g, g+8 of a block); unpacked lane by lane its k come out in natural order, so the
activations are read as plain rows.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from moet.kernels import layout

# Decoded base weights are 2× the base value (±2, ±8); FP4 weights are e2m1·2^-126 (their exponent
# field is e2m1's, so subnormal 0.5 needs no special case) and carry 2^63 in their bf16 scale, so every
# product is a normal number; the epilogue multiplies by the matching POST factor.
POST_BASE = tl.constexpr(0.5)
BASE_PAIR_ONE = tl.constexpr(layout.BASE_PAIR_ONE)
SCALE_FP4 = tl.constexpr(2.0**63)
CHUNK = tl.constexpr(128)  # k per chunk of the layout
BASE_WORDS = tl.constexpr(128)  # int32 words of one 16-row block × chunk: 32 lanes × 4
FP4_WORDS = tl.constexpr(256)  # 32 lanes × 8
# The decoders' PTX (moet.kernels.hopper's Gluon kernel uses the same): pair bits of a 2-bit word moved onto bits 8
# and 15 of each half by a mask and a multiply-add whose addend is an exponent field pair ($5), plus the bits already
# in place ($3: pair 7's signs), written as one PTX mad so that ptxas keeps it an IMAD, on the FMA pipe (see
# base_pair); packed bf16 pairs × packed scale pairs (fma with −0, exact, keeps the product's sign of zero;
# mul.bf16x2 needs sm_90); a uint32 read as its two bf16 halves.
BASE_PAIR_PTX = tl.constexpr("{ .reg .b32 t, u; and.b32 t, $1, $2; lop3.b32 u, $1, $3, $5, 0xEA; mad.lo.u32 $0, t, $4, u; }")
MUL_BF16X2_PTX = tl.constexpr("{ .reg .b32 nz; mov.b32 nz, 0x80008000; fma.rn.bf16x2 $0, $1, $2, nz; }")
BF16_PAIRS_PTX = tl.constexpr("mov.b32 $0, $1;")


if os.environ.get("TRITON_INTERPRET") == "1":

    @triton.jit
    def _mul_bf16x2(v, s):
        """The interpreter's stand-in for the fma.rn.bf16x2 below (no inline PTX on the CPU): each half's
        exact float32 product rounded to bf16, the same bits for the normal products the kernels form."""
        lo = ((v << 16).to(tl.float32, bitcast=True) * (s << 16).to(tl.float32, bitcast=True)).to(tl.bfloat16)
        hi = ((v & 0xFFFF0000).to(tl.float32, bitcast=True) * (s & 0xFFFF0000).to(tl.float32, bitcast=True)).to(tl.bfloat16)
        return lo.to(tl.uint16, bitcast=True).to(tl.uint32) | (hi.to(tl.uint16, bitcast=True).to(tl.uint32) << 16)

    @triton.jit
    def _dot(a, b, acc):
        """tl.dot of bf16 tiles; the interpreter multiplies its bf16 storage as integers, so go through f32."""
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)

    @triton.jit
    def _pair_bits(w, moved, kept, mul, e):
        """BASE_PAIR_PTX in plain arithmetic: (w & moved)·mul + ((w & kept) | e), modulo 2^32."""
        return (w & moved) * mul + ((w & kept) | e)

    @triton.jit
    def _bf16_pairs(v):
        """uint32 bf16 pairs [...] → bf16 [..., 2] (low half first)."""
        lo = (v & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        hi = (v >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.join(lo, hi)

else:

    @triton.jit
    def _dot(a, b, acc):
        return tl.dot(a, b, acc)

    @triton.jit
    def _pair_bits(w, moved, kept, mul, e):
        """(w & moved)·mul + ((w & kept) | e) as one LOP3 and one IMAD (two LOP3 where `kept` is not 0): Triton's
        and/shift/add would turn the multiply by a power of two into a shift, on the ALU pipe the decode fills."""
        return tl.inline_asm_elementwise(BASE_PAIR_PTX, "=r,r,r,r,r,r", [w, moved, kept, mul, e], dtype=tl.uint32,
                                         is_pure=True, pack=1)

    @triton.jit
    def _bf16_pairs(v):
        """uint32 bf16 pairs [...] → bf16 [..., 2] (low half first) in the same registers: an inline move
        that Triton packs two bf16 per register for, where masks, shifts and a repack (PRMT) would be spent."""
        return tl.inline_asm_elementwise(BF16_PAIRS_PTX, "=r,r,r", [tl.join(v, v)], dtype=tl.bfloat16, is_pure=True, pack=2)

    @triton.jit
    def _mul_bf16x2(v, s):
        """Packed bf16 pairs × packed bf16 pairs, one instruction per pair (Triton would unpack and repack).

        fma with −0 (exact, keeps the product's sign of zero) rather than mul.bf16x2, which needs sm_90.
        """
        return tl.inline_asm_elementwise(
            MUL_BF16X2_PTX,
            "=r,r,r",
            [v, s],
            dtype=tl.uint32,
            is_pure=True,
            pack=1,
        )


@triton.jit
def base_pair(w, p, e):
    """Pair p (a uint32 tensor, 0..7) of 2-bit words w as bf16 bits, plus the exponent field pair e: ±2^(E−127) or,
    big, ±2^(E−125). Pair p < 7 keeps its big bits at p + 1 and its signs at p + 8 (+16), moved by 2^(7 − p); pair 7
    keeps them at 0 and 15 (+16), the signs in place (moet.kernels.layout; moet.kernels.hopper's Gluon kernel calls
    it too). With a constant p the compiler folds the fields into the instructions' immediates."""
    low = p < 7
    moved = tl.where(low, 0x01020102 << p, 0x00010001)
    kept = tl.where(low, 0, 0x80008000)
    mul = tl.where(low, 128 >> p, 256)
    return _pair_bits(w, moved.to(tl.uint32), kept.to(tl.uint32), mul.to(tl.uint32), e)


@triton.jit
def exponent_pairs(s):
    """UE8M0 block scale bytes b → (b + 1)·0x00800080: each half the bf16 exponent field of 2·2^(b − 127), which
    base_pair adds (a UE8M0 byte is already bf16's exponent field, both biased by 127)."""
    return (s.to(tl.uint32) + 1) * 0x00800080


@triton.jit
def scale_pairs(s, SCALE_B: tl.constexpr, PRE: tl.constexpr):
    """Block scale bytes (uint8) × PRE → the bf16 pair (f, f) as uint32 (moet.kernels.hopper's decoders call it too)."""
    if SCALE_B == 16:
        f = s.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        f = (s.to(tl.uint32) << 23).to(tl.float32, bitcast=True)
    b = (f * PRE).to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.uint32)
    return b | (b << 16)


@triton.jit
def _dense(v00, v10, v01, v11, R: tl.constexpr):
    """Pairs v_sb [R, 32 lanes-words] of the (s, b) k16 positions → bf16 [R, 128] in natural k order.

    k = 4·(word position) + 2b + h for FP4 words, 8w + 4s + 2b + h inside a lane's run for base
    words: both are the row-major flattening of [R, words, s, b, h].
    """
    return tl.reshape(_bf16_pairs(tl.join(tl.join(v00, v10), tl.join(v01, v11))), [R, 128])


@triton.jit
def _lane_scales(scales_ptr, chunk, g, r: tl.constexpr, SCALE_B: tl.constexpr, R: tl.constexpr):
    """uint8 scale bytes of row half r for lanes (g, t): [R, 4] (UE8M0/32) or [R, 4, 2] (e4m3/16: blocks 2t, 2t+1)."""
    lane = g[:, None] * 4 + tl.arange(0, 4)[None, :]
    if SCALE_B == 32:
        offs = chunk[:, None] * 64 + lane * 2 + r
    else:
        offs = chunk[:, None, None] * 128 + lane[:, :, None] * 4 + 2 * r + tl.arange(0, 2)[None, None, :]
    return tl.load(scales_ptr + offs)


@triton.jit
def _base_scaled(w, p: tl.constexpr, e, s, SCALE_B: tl.constexpr):
    """Pair p of words w with the exponent field pair e added, then, for e4m3 scales, times the scale pair s."""
    v = base_pair(w, tl.full(w.shape, p, tl.uint32), e)
    if SCALE_B != 32:
        v = _mul_bf16x2(v, s)
    return v


@triton.jit
def _base_half(w, scales_ptr, chunk, g, r: tl.constexpr, SCALE_B: tl.constexpr, R: tl.constexpr):
    """Row half r of a chunk of 2-bit words w [R, 4 t, 4 words] → bf16 [R, 128], block scale applied: UE8M0 as the
    exponent field base_pair adds, e4m3 as a bf16 multiply of pairs decoded at ±2/±8.

    Pair p = 4s + 2b + r of a word is k16 step s, operand half b.
    """
    sc = _lane_scales(scales_ptr, chunk, g, r, SCALE_B, R)
    if SCALE_B == 32:
        e = exponent_pairs(sc)[:, :, None]  # one block per lane: [R, 4, 1]
        s = e
    else:
        s = scale_pairs(tl.reshape(tl.join(sc, sc), [R, 4, 4]), SCALE_B, 1.0)  # words 0-1 block 2t, 2-3 block 2t+1
        e = tl.full(w.shape, BASE_PAIR_ONE, tl.uint32)
    v00 = _base_scaled(w, r, e, s, SCALE_B)
    v01 = _base_scaled(w, 2 + r, e, s, SCALE_B)
    v10 = _base_scaled(w, 4 + r, e, s, SCALE_B)
    v11 = _base_scaled(w, 6 + r, e, s, SCALE_B)
    return _dense(tl.reshape(v00, [R, 16]), tl.reshape(v10, [R, 16]), tl.reshape(v01, [R, 16]), tl.reshape(v11, [R, 16]), R)


@triton.jit
def _base_chunk(words_ptr, scales_ptr, chunk, g, SCALE_B: tl.constexpr, R: tl.constexpr):
    """One chunk of R row pairs from the 2-bit base → (rows g, rows g+8) bf16 [R, 128] each.

    `chunk`: int64 [R] index of each pair's (expert, block, chunk); `g`: its row inside the block half.
    """
    w = tl.load(words_ptr + chunk[:, None] * BASE_WORDS + g[:, None] * 16 + tl.arange(0, 16)[None, :])
    w = tl.reshape(w.to(tl.uint32, bitcast=True), [R, 4, 4])  # (t, word)
    return _base_half(w, scales_ptr, chunk, g, 0, SCALE_B, R), _base_half(w, scales_ptr, chunk, g, 1, SCALE_B, R)


@triton.jit
def fp4_register(q, rho: tl.constexpr):
    """Operand register ρ of FP4 words q as bf16 pairs e2m1·2^-126: its e2m1 fields (bits 3ρ, +16) moved to bits
    6..8 and its signs (12 + ρ, +16) to bit 15 (decode_fp4 in moet/kernels/src/moe_decode.cu; moet.kernels.hopper's
    Gluon kernel calls it too)."""
    if rho == 3:
        field = q >> 3
    else:
        field = q << (6 - 3 * rho)
    return (field & 0x01C001C0) | ((q << (3 - rho)) & 0x80008000)


@triton.jit
def _fp4_half(q, scales_ptr, chunk, g, r: tl.constexpr, SCALE_B: tl.constexpr, R: tl.constexpr):
    """Row half r of a chunk of FP4 words q [R, 32 (t, s)] → bf16 [R, 128] (e2m1·2^-126 × scale·2^63).

    A word is k16 step s of a lane; operand register ρ = 2b + r holds its e2m1 fields at bits 3ρ
    (+16) and its signs at 12 + ρ (+16) (decode_fp4 in moet/kernels/src/moe_decode.cu).
    """
    sc = _lane_scales(scales_ptr, chunk, g, r, SCALE_B, R)
    if SCALE_B == 32:
        s = tl.reshape(tl.broadcast_to(scale_pairs(sc, SCALE_B, SCALE_FP4)[:, :, None], [R, 4, 8]), [R, 32])
    else:  # steps 0-3 block 2t, 4-7 block 2t+1
        s = tl.reshape(tl.broadcast_to(scale_pairs(sc, SCALE_B, SCALE_FP4)[:, :, :, None], [R, 4, 2, 4]), [R, 32])
    b0, b1 = fp4_register(q, r), fp4_register(q, 2 + r)
    return tl.reshape(_bf16_pairs(tl.join(_mul_bf16x2(b0, s), _mul_bf16x2(b1, s))), [R, 128])  # [R, 32, b, h]


@triton.jit
def _fp4_chunk(fp4_ptr, scales_ptr, fp4_chunk, chunk, g, SCALE_B: tl.constexpr, R: tl.constexpr):
    """One chunk of R row pairs from FP4 copies (`fp4_chunk`: their (slot, block, chunk)) → (rows g, rows g+8)."""
    q = tl.load(fp4_ptr + fp4_chunk[:, None] * FP4_WORDS + g[:, None] * 32 + tl.arange(0, 32)[None, :])
    q = q.to(tl.uint32, bitcast=True)
    return _fp4_half(q, scales_ptr, chunk, g, 0, SCALE_B, R), _fp4_half(q, scales_ptr, chunk, g, 1, SCALE_B, R)


@triton.jit
def _gemm_chunks(
    x_ptr, x_row, valid, words_ptr, fp4_ptr, scales_ptr, blk, fp4_blk, g, kc_begin, kc_end, KC, K,
    FP4: tl.constexpr, SCALE_B: tl.constexpr, R: tl.constexpr, BM: tl.constexpr,
):
    """Σ over chunks [kc_begin, kc_end) of (rows g, rows g+8) · X[tokens]ᵀ → two f32 [R, BM] accumulators."""
    acc0 = tl.zeros([R, BM], dtype=tl.float32)
    acc1 = tl.zeros([R, BM], dtype=tl.float32)
    kk = tl.arange(0, 128)
    for kc in range(kc_begin, kc_end):
        x = tl.load(x_ptr + x_row[:, None].to(tl.int64) * K + (kc * 128 + kk)[None, :], mask=valid[:, None], other=0.0)
        xt = tl.trans(x)  # loaded token-major so that each row's k run is one vector load
        chunk = blk * KC + kc
        if FP4:
            w0, w1 = _fp4_chunk(fp4_ptr, scales_ptr, fp4_blk * KC + kc, chunk, g, SCALE_B, R)
        else:
            w0, w1 = _base_chunk(words_ptr, scales_ptr, chunk, g, SCALE_B, R)
        acc0 = _dot(w0, xt, acc0)
        acc1 = _dot(w1, xt, acc1)
    return acc0, acc1


@triton.jit
def moe_gemm_kernel(
    x_ptr, out_ptr,
    words_ptr, scales_ptr, row_scale_ptr, slots_ptr, fp4_ptr,
    topk_ids_ptr, topk_w_ptr,
    sorted_ptr, block_expert_ptr, n_padded_ptr,
    T, N_OUT, K, TOPK,
    STAGE: tl.constexpr, ROUTE: tl.constexpr, SCALE_B: tl.constexpr, HAS_SLOTS: tl.constexpr, TIERS: tl.constexpr,
    BLOCKS: tl.constexpr, BM: tl.constexpr, TOPK_P2: tl.constexpr, P_P2: tl.constexpr, SPLIT: tl.constexpr,
    ROWS_FIRST: tl.constexpr,
):
    """acc[rows, BM tokens] = W_e[rows, K slice] · X[tokens, K slice]ᵀ over BLOCKS 16-row blocks, then the epilogue.

    With SPLIT > 1 (grid axis 2 = K slice) the partial sums go to f32 [SPLIT, T·k, N] planes
    (gate and up side by side for STAGE 13) and silu_mul_kernel / the combine add them in order.
    """
    R: tl.constexpr = 8 * BLOCKS
    if ROWS_FIRST:  # grid (row blocks, pair blocks): programs that run together share their pairs' activations in L2
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
    else:
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    M = T * TOPK
    if ROUTE == 0:
        expert = tl.load(topk_ids_ptr + pid_m)
        prev = tl.arange(0, P_P2)
        earlier = tl.load(topk_ids_ptr + prev, mask=prev < pid_m, other=-1)
        active = tl.sum((earlier == expert).to(tl.int32), axis=0) == 0
        tok = tl.arange(0, BM)
        slot = tl.arange(0, TOPK_P2)
        ids = tl.load(
            topk_ids_ptr + tok[:, None] * TOPK + slot[None, :],
            mask=(tok < T)[:, None] & (slot < TOPK)[None, :],
            other=-1,
        )
        match = ids == expert
        valid = tl.sum(match.to(tl.int32), axis=1) > 0
        pair = tok * TOPK + tl.sum(tl.where(match, slot[None, :], 0), axis=1)
    else:
        active = pid_m * BM < tl.load(n_padded_ptr)
        expert = tl.load(block_expert_ptr + pid_m)
        pair = tl.load(sorted_ptr + pid_m * BM + tl.arange(0, BM))
        valid = pair < M
        pair = tl.where(valid, pair, 0)
        tok = pair // TOPK
    if HAS_SLOTS and TIERS == 0:  # this launch serves the base experts only
        active = active & (tl.load(slots_ptr + expert) < 0)
    if HAS_SLOTS and TIERS == 1:  # this launch serves the FP4 experts only
        active = active & (tl.load(slots_ptr + expert) >= 0)
    if active:
        if STAGE == 13:
            x_row = tok
            n_w = 2 * N_OUT
        else:
            x_row = pair
            n_w = N_OUT
        NB = n_w // 16
        KC = K // 128
        i = tl.arange(0, R)
        g = i % 8
        blk = expert.to(tl.int64) * NB + pid_n * BLOCKS + i // 8  # [R] (expert, block)
        kc_len = KC // SPLIT
        kc_begin = pid_k * kc_len
        post = POST_BASE
        if HAS_SLOTS and TIERS == 2:
            tier = tl.load(slots_ptr + expert)
            post = tl.where(tier >= 0, SCALE_FP4, POST_BASE)
            if tier >= 0:
                fp4_blk = tier.to(tl.int64) * NB + pid_n * BLOCKS + i // 8
                acc0, acc1 = _gemm_chunks(x_ptr, x_row, valid, words_ptr, fp4_ptr, scales_ptr, blk, fp4_blk, g,
                                          kc_begin, kc_begin + kc_len, KC, K, True, SCALE_B, R, BM)
            else:
                acc0, acc1 = _gemm_chunks(x_ptr, x_row, valid, words_ptr, fp4_ptr, scales_ptr, blk, blk, g,
                                          kc_begin, kc_begin + kc_len, KC, K, False, SCALE_B, R, BM)
        elif HAS_SLOTS and TIERS == 1:
            post = SCALE_FP4
            fp4_blk = tl.load(slots_ptr + expert).to(tl.int64) * NB + pid_n * BLOCKS + i // 8
            acc0, acc1 = _gemm_chunks(x_ptr, x_row, valid, words_ptr, fp4_ptr, scales_ptr, blk, fp4_blk, g,
                                      kc_begin, kc_begin + kc_len, KC, K, True, SCALE_B, R, BM)
        else:
            acc0, acc1 = _gemm_chunks(x_ptr, x_row, valid, words_ptr, fp4_ptr, scales_ptr, blk, blk, g,
                                      kc_begin, kc_begin + kc_len, KC, K, False, SCALE_B, R, BM)
        pair64 = pair[None, :].to(tl.int64)
        rs = row_scale_ptr + expert.to(tl.int64) * n_w
        if STAGE == 13:
            col = pid_n * R + i  # gate row (rows g of the blocks); the up row is N_OUT + col
            gate = acc0 * (tl.load(rs + col) * post)[:, None]
            up = acc1 * (tl.load(rs + N_OUT + col) * post)[:, None]
            if SPLIT == 1:
                h = gate / (1.0 + tl.exp(-gate)) * up
                tl.store(out_ptr + pair64 * N_OUT + col[:, None], h.to(tl.bfloat16), mask=valid[None, :])
            else:
                offs = (pid_k * M + pair64) * (2 * N_OUT) + col[:, None]
                tl.store(out_ptr + offs, gate, mask=valid[None, :])
                tl.store(out_ptr + offs + N_OUT, up, mask=valid[None, :])
        else:
            row = (pid_n * BLOCKS + i // 8) * 16 + g  # rows g; rows g + 8 come from acc1
            route_w = tl.load(topk_w_ptr + pair, mask=valid, other=0.0)
            offs = (pid_k * M + pair64) * N_OUT + row[:, None]
            lo = acc0 * (tl.load(rs + row) * post)[:, None]
            hi = acc1 * (tl.load(rs + row + 8) * post)[:, None]
            tl.store(out_ptr + offs, lo * route_w[None, :], mask=valid[None, :])
            tl.store(out_ptr + offs + 8, hi * route_w[None, :], mask=valid[None, :])


@triton.jit
def silu_mul_kernel(part_ptr, act_ptr, M, N_OUT, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """act[m, n] = SiLU(Σ_s gate[s, m, n]) · Σ_s up[s, m, n], slices added in order (deterministic)."""
    m = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    gate = tl.zeros([BLOCK], dtype=tl.float32)
    up = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        row = part_ptr + (s * M + m) * (2 * N_OUT)
        gate += tl.load(row + n)
        up += tl.load(row + N_OUT + n)
    tl.store(act_ptr + m * N_OUT + n, (gate / (1.0 + tl.exp(-gate)) * up).to(tl.bfloat16))


@triton.jit
def read_kernel(src_ptr, out_ptr, n_words, BLOCK: tl.constexpr):
    """A plain streaming read of int32 words (grid-stride), the yardstick for 'same bytes' timings."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(pid * BLOCK, n_words, step):
        offs = start + tl.arange(0, BLOCK)
        acc ^= tl.load(src_ptr + offs, mask=offs < n_words, other=0)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


if os.environ.get("TRITON_INTERPRET") == "1":

    @triton.jit
    def to_e4m3(v):
        """The interpreter's stand-in for the cvt.rn.satfinite f32 → e4m3 the GPU build emits: Triton 3.9's
        interpreter drops the carry when rounding up crosses a power of two (125 → 64, not 128), so round to
        nearest even with integer operations here (|v| ≤ 448; below 2^-6 the step is 2^-9)."""
        bits = v.to(tl.uint32, bitcast=True)
        magnitude = bits & 0x7FFFFFFF
        rounded = magnitude + 0x7FFFF + ((magnitude >> 20) & 1)  # to 3 mantissa bits, ties to even
        normal = (((rounded >> 23) - 120) << 3) | ((rounded >> 20) & 7)  # exponent bias 127 → 7
        subnormal = (tl.abs(v) * 512.0 + 12582912.0 - 12582912.0).to(tl.uint32)  # 1.5 · 2^23: rint
        byte = tl.where(magnitude < 0x3C800000, subnormal, normal) | ((bits >> 24) & 0x80)
        return byte.to(tl.uint8).to(tl.float8e4nv, bitcast=True)

else:

    @triton.jit
    def to_e4m3(v):
        return v.to(tl.float8e4nv)


@triton.jit
def e4m3_rows_kernel(x_ptr, q_ptr, scale_ptr, K, BLOCK: tl.constexpr, FP8_ORDER: tl.constexpr):
    """q[m] = x[m] / s[m] in e4m3 (nearest even), s[m] = max |x[m]| / 448 (1 for an all-zero row), as
    moet.eval.variants.fp8_rows; FP8_ORDER: each 128-k chunk's columns in the FP8 wgmma's k order
    (moet.kernels.layout.mma_k_order(…, fp8=True): k 32t + 8w + 4s' + 2b + h at 32w + 16s' + 4t + 2h + b)."""
    m = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + m * K + k, mask=k < K, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    s = tl.where(amax > 0, amax / 448.0, 1.0)
    if FP8_ORDER:
        p = k % 128
        pos = k - p + ((p // 8) % 4) * 32 + ((p // 4) % 2) * 16 + (p // 32) * 4 + (p % 2) * 2 + (p // 2) % 2
    else:
        pos = k
    tl.store(q_ptr + m * K + pos, to_e4m3(x / s), mask=k < K)
    tl.store(scale_ptr + m, s)


@triton.jit
def e4m3_power(top, SCALE_B: tl.constexpr):
    """The power of two P that the FP8 prefill (moet.kernels.hopper) takes a row's weights in one 128-k chunk over, from
    `top` (int32: the largest scale byte of the row's blocks in the chunk; UE8M0 and e4m3 bytes of positive values
    order as their values do): the smallest P with 4 · scale / P ≤ 448, so every ±1, ±4 × scale / P of the chunk is
    an e4m3 value while its scale is within 2^15 (UE8M0) or about 2^12 (e4m3) of the largest; 1 for a zero scale.
    From the scale's f32 bits: 448 / 4 = 1.75 · 2^6, so P is 2^(exponent − 6), doubled where the mantissa passes 1.75
    (exact, no division). UE8M0 bytes below 7 count as 7, so that P and 1 / P stay normal floats (the weights of such
    rows stay within e4m3 all the same)."""
    if SCALE_B == 32:  # 2^(top − 127): no mantissa
        p = (tl.maximum(top, 7) - 6) << 23
    else:
        v = top.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32).to(tl.int32, bitcast=True)
        p = tl.where(v > 0, ((v + 0x1FFFFF) & 0x7F800000) - 0x03000000, 0x3F800000)
    return p.to(tl.float32, bitcast=True)
