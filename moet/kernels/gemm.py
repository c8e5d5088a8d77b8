"""Triton MoE expert GEMMs over the 2-bit base, the FP4 planes and the base-5 refinement.

One kernel source serves both projections and both routings:

* STAGE 13: the fused gate/up projection; each program computes BN gate rows and the matching BN up
  rows, applies SiLU(gate)·up and writes bf16 activations, one row per (token, slot) pair.
* STAGE 2: the down projection; each program multiplies by the routing weight and writes f32 rows
  per pair, so that the combine is a fixed-order sum (deterministic, no atomics).
* ROUTE 0 (decode, few tokens): program (p, n) serves the expert of pair p for *all* tokens routed
  to it (BM ≥ T) and does nothing when an earlier pair already named that expert; no alignment pass.
* ROUTE 1 (prefill): vLLM-style blocks of BM pairs sorted by expert (moet.kernels.glue.align).

Weights are decoded in registers to bf16 pairs (see moet.kernels.layout for the bit tricks) with the
block scale applied, and fed as the *left* operand of tl.dot (swap-AB: weight rows are the MMA's M,
tokens its N), so decode with one token still uses the tensor cores and f32 accumulation.
"""

from __future__ import annotations

import triton
import triton.language as tl

FORMATS = {"base": 0, "fp4": 1, "refine": 2}  # the FMT constexpr of moe_gemm_kernel

# Decoded base weights are 2× the base value (±2, ±8); FP4 weights are e2m1·2^-126 (their exponent
# field is e2m1's, so subnormal 0.5 needs no special case) and carry 2^63 in their bf16 scale, so every
# product is a normal number; the epilogue multiplies by POST_*.
POST_BASE = tl.constexpr(0.5)
SCALE_FP4 = tl.constexpr(2.0**63)


@triton.jit
def _scale_tile(scales_ptr, row_off, g0, K, SCALE_B: tl.constexpr, G: tl.constexpr, PRE: tl.constexpr):
    """Block scales of the 16-weight groups g0..g0+G of rows row_off (times PRE) → bf16 pairs, uint32 [BN, G]."""
    NS: tl.constexpr = G * 16 // SCALE_B
    s = tl.load(scales_ptr + row_off[:, None] * (K // SCALE_B) + (g0 * 16 // SCALE_B + tl.arange(0, NS))[None, :])
    if SCALE_B == 16:
        f = s.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:  # one UE8M0 scale per two groups: load each once, duplicate in registers
        f = (s.to(tl.uint32) << 23).to(tl.float32, bitcast=True)
        f = tl.reshape(tl.join(f, f), [f.shape[0], G])
    b = (f * PRE).to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.uint32)
    return b | (b << 16)


@triton.jit
def _mul_bf16x2(v, s):
    """Packed bf16 pairs × packed bf16 pairs, one instruction per pair (Triton would unpack and repack).

    fma with −0 (exact, keeps the product's sign of zero) rather than mul.bf16x2, which needs sm_90.
    """
    return tl.inline_asm_elementwise(
        "{ .reg .b32 nz; mov.b32 nz, 0x80008000; fma.rn.bf16x2 $0, $1, $2, nz; }",
        "=r,r,r",
        [v, s],
        dtype=tl.uint32,
        is_pure=True,
        pack=1,
    )


@triton.jit
def _rotate_mask(w, r: tl.constexpr):
    """Rotate right by a constant (one funnel shift) and keep the sign/class bits of a bf16 pair."""
    return ((w >> r) | (w << (32 - r))) & 0x81008100


@triton.jit
def _join8(v0, v1, v2, v3, v4, v5, v6, v7):
    """Eight [BN, G] tensors → [BN, G, 2, 2, 2] whose row-major flattening is v0..v7 (all in-thread)."""
    return tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7)))


@triton.jit
def _base_pairs(words_ptr, row_off, g0, K, G: tl.constexpr):
    """Relaid 2-bit words → uint32 [BN, G, 2, 2, 2] of (sign, big) bits at bf16 positions 15/8 and 31/24."""
    w = tl.load(words_ptr + row_off[:, None] * (K // 16) + (g0 + tl.arange(0, G))[None, :])
    w = w.to(tl.uint32, bitcast=True)
    return _join8(
        _rotate_mask(w, 2), _rotate_mask(w, 4), _rotate_mask(w, 6), _rotate_mask(w, 8),
        _rotate_mask(w, 10), _rotate_mask(w, 12), _rotate_mask(w, 14), _rotate_mask(w, 16),
    )


@triton.jit
def _e2m1_pair(w, j: tl.constexpr):
    """Byte j of a word of FP4 nibbles → bf16 bits e2m1·2^-126 (sign 15, exponent+mantissa 6..8), twice."""
    b = w >> (8 * j)
    magnitudes = ((b & 0x77) * 0x40040) & 0x01C001C0  # one multiply moves both 3-bit fields
    signs = ((b & 0x88) * 0x1001000) & 0x80008000
    return magnitudes | signs


@triton.jit
def _fp4_pairs(fp4_ptr, row_off, g0, K, G: tl.constexpr):
    """FP4 nibbles, 16 per int64 word → uint32 [BN, G, 2, 2, 2] bf16-bit pairs."""
    f = tl.load(fp4_ptr + row_off[:, None] * (K // 16) + (g0 + tl.arange(0, G))[None, :]).to(tl.uint64, bitcast=True)
    lo = (f & 0xFFFFFFFF).to(tl.uint32)
    hi = (f >> 32).to(tl.uint32)
    return _join8(
        _e2m1_pair(lo, 0), _e2m1_pair(lo, 1), _e2m1_pair(lo, 2), _e2m1_pair(lo, 3),
        _e2m1_pair(hi, 0), _e2m1_pair(hi, 1), _e2m1_pair(hi, 2), _e2m1_pair(hi, 3),
    )


@triton.jit
def _digit_pairs(g):
    """10-bit base-5 groups g = d0 + 5·d1 + 25·d2 + 125·d3 → (d0 | d1 << 16, d2 | d3 << 16).

    Multiply-shift division, exact for g < 625: g // 25 = (41·g) >> 10 and x // 5 = (13·x) >> 6 for
    x < 25; then x + (x // 5)·(2^16 − 5) puts x mod 5 and x // 5 in the two halves.
    """
    hi = (g * 41) >> 10
    lo = g - 25 * hi
    return lo + ((lo * 13) >> 6) * 65531, hi + ((hi * 13) >> 6) * 65531


@triton.jit
def _refine_pairs(words_ptr, lo_ptr, hi_ptr, row_off, g0, K, G: tl.constexpr):
    """Base (sign, class) + base-5 digits → the exact FP4 weights as uint32 [BN, G, 2, 2, 2] bf16-bit pairs."""
    base = _base_pairs(words_ptr, row_off, g0, K, G)
    offs = row_off[:, None] * (K // 16) + (g0 + tl.arange(0, G))[None, :]
    lo = tl.load(lo_ptr + offs).to(tl.uint32, bitcast=True)
    hi = tl.load(hi_ptr + offs).to(tl.uint32)
    p0, p1 = _digit_pairs(lo & 0x3FF)
    p2, p3 = _digit_pairs((lo >> 10) & 0x3FF)
    p4, p5 = _digit_pairs((lo >> 20) & 0x3FF)
    p6, p7 = _digit_pairs((lo >> 30) | (hi << 2))
    digits = _join8(p0, p1, p2, p3, p4, p5, p6, p7)
    magnitude = digits + 5 * ((base >> 8) & 0x00010001)
    return (base & 0x80008000) | (magnitude << 6)


@triton.jit
def _weight_tile(
    words_ptr, tier_ptr, tier_hi_ptr, scales_ptr, row_off, k0,
    K, FMT: tl.constexpr, SCALE_B: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    """One [BN, BK] bf16 weight tile (block scale applied; see POST_* for the constant factor)."""
    G: tl.constexpr = BK // 16
    g0 = k0 // 16
    if FMT == 0:
        v = _base_pairs(words_ptr, row_off, g0, K, G) | 0x40004000
        s = _scale_tile(scales_ptr, row_off, g0, K, SCALE_B, G, 1.0)
    elif FMT == 1:
        v = _fp4_pairs(tier_ptr, row_off, g0, K, G)
        s = _scale_tile(scales_ptr, row_off, g0, K, SCALE_B, G, SCALE_FP4)
    else:
        v = _refine_pairs(words_ptr, tier_ptr, tier_hi_ptr, row_off, g0, K, G)
        s = _scale_tile(scales_ptr, row_off, g0, K, SCALE_B, G, SCALE_FP4)
    v = _mul_bf16x2(v, s[:, :, None, None, None])
    lo = (v & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    hi = (v >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return tl.reshape(tl.join(lo, hi), [BN, BK])


@triton.jit
def moe_gemm_kernel(
    x_ptr, out_ptr,
    words_ptr, tier_ptr, tier_hi_ptr, scales_ptr, row_scale_ptr,
    topk_ids_ptr, topk_w_ptr,
    sorted_ptr, block_expert_ptr, n_padded_ptr,
    T, N_OUT, K, TOPK,
    FMT: tl.constexpr, STAGE: tl.constexpr, ROUTE: tl.constexpr, SCALE_B: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr, TOPK_P2: tl.constexpr, P_P2: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """acc[BN rows, BM tokens] = W_e[rows, K slice] · X[tokens, K slice]ᵀ, then the stage's epilogue.

    With SPLIT > 1 (grid axis 2 = K slice) the partial sums go to f32 [SPLIT, T·k, N] planes
    (gate and up side by side for STAGE 13) and silu_mul_kernel / the combine add them in order.
    """
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
    if active:
        if STAGE == 13:
            x_row = tok
            n_w = 2 * N_OUT
        else:
            x_row = pair
            n_w = N_OUT
        rows = pid_n * BN + tl.arange(0, BN)
        row_off = expert.to(tl.int64) * n_w + rows
        acc = tl.zeros([BN, BM], dtype=tl.float32)
        acc_up = tl.zeros([BN, BM], dtype=tl.float32)
        kk = tl.arange(0, BK)
        k_len = K // SPLIT
        for k0 in range(pid_k * k_len, (pid_k + 1) * k_len, BK):
            x = tl.load(x_ptr + x_row[:, None].to(tl.int64) * K + (k0 + kk)[None, :], mask=valid[:, None], other=0.0)
            xt = tl.trans(x)  # loaded token-major so that each row's k run is one vector load
            w = _weight_tile(words_ptr, tier_ptr, tier_hi_ptr, scales_ptr, row_off, k0, K, FMT, SCALE_B, BN, BK)
            acc = tl.dot(w, xt, acc)
            if STAGE == 13:
                wu = _weight_tile(
                    words_ptr, tier_ptr, tier_hi_ptr, scales_ptr, row_off + N_OUT, k0, K, FMT, SCALE_B, BN, BK
                )
                acc_up = tl.dot(wu, xt, acc_up)
        if FMT == 0:
            post = POST_BASE
        else:
            post = SCALE_FP4
        acc = acc * (tl.load(row_scale_ptr + row_off) * post)[:, None]
        pair64 = pair[None, :].to(tl.int64)
        if STAGE == 13:
            up = acc_up * (tl.load(row_scale_ptr + row_off + N_OUT) * post)[:, None]
            if SPLIT == 1:
                h = acc / (1.0 + tl.exp(-acc)) * up
                tl.store(out_ptr + pair64 * N_OUT + rows[:, None], h.to(tl.bfloat16), mask=valid[None, :])
            else:
                offs = (pid_k * M + pair64) * (2 * N_OUT) + rows[:, None]
                tl.store(out_ptr + offs, acc, mask=valid[None, :])
                tl.store(out_ptr + offs + N_OUT, up, mask=valid[None, :])
        else:
            route_w = tl.load(topk_w_ptr + pair, mask=valid, other=0.0)
            offs = (pid_k * M + pair64) * N_OUT + rows[:, None]
            tl.store(out_ptr + offs, acc * route_w[None, :], mask=valid[None, :])


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
