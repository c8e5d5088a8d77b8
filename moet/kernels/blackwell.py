"""The MoE expert GEMMs on Blackwell's block-scaled tensor cores (sm_120a): `tl.dot_scaled`, e4m3 × e4m3, UE8M0/32.

Built ahead of time and its SASS checked (`QMMA.SF.16832.F32.E4M3.E4M3.E8`, moet/kernels/MANIFEST), tested
under Triton's interpreter against a float64 emulation; **never run on a GPU: this project has no sm_120
device.** It reads the one GPU layout (moet.kernels.layout) that the other kernels read, with no second
copy: the layout decodes lane by lane into natural k order, and its UE8M0 scale bytes per lane are one
per row and 32 k, which is the block-scaled MMA's scale operand as stored, applied by the hardware.

Before each projection a small kernel quantizes the activations to e4m3 with a UE8M0 scale per 32 k, in
one or two terms (the second quantizes the residual of the first). Per 128-k chunk a GEMM program expands
its 2-bit words (or an expert's FP4 slot words) to e4m3 bytes in registers with a few bit operations
(moet.kernels.mx documents the operand and emulates it bit for bit) and issues two `dot_scaled`s (the
block's rows g and g+8; swap-AB: weight rows on M, the pairs' activation terms on N, the terms added in the
epilogue). Why e4m3 weights, not e2m1: Triton 3.9 lowers the mixed e4m3 × e2m1 (and bf16 × e2m1)
`dot_scaled` to bf16 HMMA on sm_120a; only equal formats reach QMMA/OMMA, and e2m1 activations would cost
far more accuracy than e4m3 ones.

Only UE8M0/32 scales ("mx32"): e4m3/16 (NVFP4) scales exist only for kind::mxf4nvf4, whose operands
are both e2m1. Quantized activations give this path its own accuracy: one e4m3 term is ~5% off float64 per
MoE layer, two terms ~1.5e-3 (the bf16 path's band) for twice the MMAs (docs/KERNELS.md). It is not the
default anywhere. Both routes use the aligned pair blocks of moet.kernels.glue.align (from
moet.kernels.moe.sorted_pairs; no K split); the slot table mixes tiers per expert as in moet.kernels.gemm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moet.kernels.gemm import BASE_WORDS, FP4_WORDS, to_e4m3
from moet.kernels.glue import combine
from moet.kernels.layout import Fp4Slots, StackedWeights
from moet.kernels.moe import DECODE_MAX_TOKENS, GemmConfig, sorted_pairs
from moet.kernels.mx import E2M1_SHIFT

POST = tl.constexpr(2.0**E2M1_SHIFT)  # the weight bytes are value × 2^-6 (moet.kernels.mx)
PREFILL_CONFIG = GemmConfig(blocks=2, bm=32, num_warps=4, num_stages=2)  # 16-row dots × 32 pairs (no spills on sm_120a)
DECODE_CONFIG = GemmConfig(blocks=2, bm=16, num_warps=4, num_stages=2)  # 16-row dots × 16 pairs


@triton.jit
def _quantize_e4m3(xf):
    """f32 activations [BM, 4, 32] → (e4m3 [BM, 4, 32], UE8M0 bytes [BM, 4], residual f32 [BM, 4, 32]): per 32 k
    the smallest 2^e with amax / 2^e ≤ 448 (448 = 1.75 · 2^8, read off amax's exponent and mantissa bits),
    x / 2^e to nearest e4m3; the residual x − q · 2^e is exact (0 where e = 0: amax below 2^-118)."""
    bits = tl.max(tl.abs(xf), axis=2).to(tl.int32, bitcast=True)
    e = (bits >> 23) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    e = tl.maximum(e, 0)
    scaled = xf * ((254 - e) << 23).to(tl.float32, bitcast=True)[:, :, None]
    q = to_e4m3(scaled)
    residual = (scaled - q.to(tl.float32)) * (e << 23).to(tl.float32, bitcast=True)[:, :, None]
    return q, e.to(tl.uint8), residual


@triton.jit
def quantize_kernel(x_ptr, q_ptr, s_ptr, rows, K, BM: tl.constexpr, TERMS: tl.constexpr):
    """Program (m, c): rows m·BM.. of bf16 x [rows, K], 128-k chunk c → TERMS e4m3 terms [TERMS, rows, K] and
    their UE8M0 bytes [TERMS, rows, K/32]; term t + 1 quantizes what terms 0..t left (x ≈ Σ_t q_t · 2^e_t)."""
    r = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    k = tl.program_id(1) * 128 + tl.arange(0, 128)
    blocks = tl.program_id(1) * 4 + tl.arange(0, 4)
    ok = (r < rows)[:, None]
    x = tl.load(x_ptr + r[:, None] * K + k[None, :], mask=ok, other=0.0)
    x = tl.reshape(x.to(tl.float32), [BM, 4, 32])
    for t in tl.static_range(TERMS):
        q, e, x = _quantize_e4m3(x)
        q = tl.reshape(q, [BM, 128]).to(tl.uint8, bitcast=True)
        tl.store(q_ptr + (t * rows + r[:, None]) * K + k[None, :], q, mask=ok)
        tl.store(s_ptr + (t * rows + r[:, None]) * (K // 32) + blocks[None, :], e, mask=ok)


@triton.jit
def _bytes(v0, v1, R: tl.constexpr):
    """Two tensors [R, ...] of words whose 16-bit halves each hold an e4m3 byte in their low 8 bits → e4m3
    [R, 128], k in the order (word position, v0 / v1, half)."""
    v = tl.join(v0, v1)
    lo = (v & 0xFF).to(tl.uint8)
    hi = ((v >> 16) & 0xFF).to(tl.uint8)
    return tl.reshape(tl.join(lo, hi), [R, 128]).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _base_pairs(w, p: tl.constexpr):
    """Pair p of 2-bit words (moet.kernels.layout: big bits at p + 1, signs at p + 8, pair 7 at 0 and 15; +16 for
    the high half): sign → bit 7, "big" → bit 4, constant 0x08 per half: e4m3 ±1, ±4 × 2^-6."""
    if p < 7:
        sign = (w >> (p + 1)) & 0x00800080
        if p >= 3:
            big = (w >> (p - 3)) & 0x00100010
        else:
            big = (w << (3 - p)) & 0x00100010
    else:
        sign = (w >> 8) & 0x00800080
        big = (w << 4) & 0x00100010
    return sign | big | 0x00080008


@triton.jit
def _base_half(w, r: tl.constexpr, R: tl.constexpr):
    """Row half r of a chunk's 2-bit words w [R, 4 t, 4 words] → e4m3 [R, 128]; pair p = 4s + 2b + r of a
    word is k = 32t + 8·word + 4s + 2b + h."""
    b0 = tl.join(tl.reshape(_base_pairs(w, r), [R, 16]), tl.reshape(_base_pairs(w, 4 + r), [R, 16]))
    b1 = tl.join(tl.reshape(_base_pairs(w, 2 + r), [R, 16]), tl.reshape(_base_pairs(w, 6 + r), [R, 16]))
    return _bytes(b0, b1, R)


@triton.jit
def _fp4_pairs(q, rho: tl.constexpr):
    """Operand register ρ of FP4 words: e2m1 fields (bits 3ρ, +16) → bits 2..4, signs (12 + ρ) → bit 7."""
    if rho == 0:
        field = q << 2
    else:
        field = q >> (3 * rho - 2)
    return (field & 0x001C001C) | ((q >> (5 + rho)) & 0x00800080)


@triton.jit
def _weights(w_ptr, w_chunk, g, FP4: tl.constexpr, R: tl.constexpr):
    """One chunk of R row pairs (rows g, g+8 of their blocks; `w_chunk` int64 [R] each pair's (expert or
    slot, block, chunk)) → two e4m3 [R, 128] operands in natural k order."""
    if FP4:  # word = k16 step s of lane t; register 2b + r; k = 32t + 4s + 2b + h
        q = tl.load(w_ptr + w_chunk[:, None] * FP4_WORDS + g[:, None] * 32 + tl.arange(0, 32)[None, :])
        q = q.to(tl.uint32, bitcast=True)
        w0 = _bytes(_fp4_pairs(q, 0), _fp4_pairs(q, 2), R)
        w1 = _bytes(_fp4_pairs(q, 1), _fp4_pairs(q, 3), R)
    else:
        w = tl.load(w_ptr + w_chunk[:, None] * BASE_WORDS + g[:, None] * 16 + tl.arange(0, 16)[None, :])
        w = tl.reshape(w.to(tl.uint32, bitcast=True), [R, 4, 4])
        w0 = _base_half(w, 0, R)
        w1 = _base_half(w, 1, R)
    return w0, w1


@triton.jit
def _mx_chunks(
    xq_ptr, xs_ptr, x_term_row, x_valid, w_ptr, scales_ptr, blk, w_blk, g, KC, K,
    FP4: tl.constexpr, R: tl.constexpr, N: tl.constexpr,
):
    """Σ over all chunks of (rows g, rows g+8) · Xq[columns]ᵀ on the block-scaled MMA → two f32 [R, N].

    A column is one activation term of one pair (`x_term_row` int64 [N]: its row in the [terms · rows, K]
    activations), so every weight operand is decoded once and feeds one dot per row half.
    """
    acc0 = tl.zeros([R, N], dtype=tl.float32)
    acc1 = tl.zeros([R, N], dtype=tl.float32)
    kk = tl.arange(0, 128)
    lane = g[:, None] * 4 + tl.arange(0, 4)[None, :]
    for kc in range(0, KC):
        xt = tl.load(xq_ptr + x_term_row[None, :] * K + (kc * 128 + kk)[:, None], mask=x_valid[None, :], other=0)
        xt = xt.to(tl.float8e4nv, bitcast=True)
        xs = tl.load(xs_ptr + x_term_row[:, None] * (K // 32) + kc * 4 + tl.arange(0, 4)[None, :],
                     mask=x_valid[:, None], other=127)
        chunk = blk * KC + kc
        w0, w1 = _weights(w_ptr, w_blk * KC + kc, g, FP4, R)
        s0 = tl.load(scales_ptr + chunk[:, None] * 64 + lane * 2)  # UE8M0 of rows g: one byte per lane (32 k)
        s1 = tl.load(scales_ptr + chunk[:, None] * 64 + lane * 2 + 1)  # rows g + 8
        acc0 = tl.dot_scaled(w0, s0, "e4m3", xt, xs, "e4m3", acc0)
        acc1 = tl.dot_scaled(w1, s1, "e4m3", xt, xs, "e4m3", acc1)
    return acc0, acc1


@triton.jit
def _sum_terms(acc, R: tl.constexpr, BM: tl.constexpr, TERMS: tl.constexpr):
    """[R, BM · TERMS] (pair-major columns) → [R, BM]: each pair's terms added."""
    return tl.sum(tl.reshape(acc, [R, BM, TERMS]), axis=2)


@triton.jit
def mx_gemm_kernel(
    xq_ptr, xs_ptr, out_ptr,
    words_ptr, scales_ptr, row_scale_ptr, slots_ptr, fp4_ptr,
    topk_w_ptr, sorted_ptr, block_expert_ptr, n_padded_ptr,
    T, N_OUT, K, TOPK,
    STAGE: tl.constexpr, HAS_SLOTS: tl.constexpr, TERMS: tl.constexpr, BLOCKS: tl.constexpr, BM: tl.constexpr,
):
    """Program (m, n): aligned pair block m (one expert, BM pairs) × BLOCKS 16-row blocks n, all of K; the MMA's
    N side holds the BM pairs' TERMS activation terms (column TERMS · pair + term).

    STAGE 13 writes SiLU(gate)·up as bf16 rows per pair (gate rows g, up rows g+8 of each block); STAGE 2
    writes f32 rows per pair × the routing weight (the combine sums them in a fixed order).
    """
    R: tl.constexpr = 8 * BLOCKS
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    M = T * TOPK
    expert = tl.load(block_expert_ptr + pid_m)
    pair = tl.load(sorted_ptr + pid_m * BM + tl.arange(0, BM))
    valid = pair < M
    pair = tl.where(valid, pair, 0)
    if pid_m * BM < tl.load(n_padded_ptr):
        column = tl.arange(0, BM * TERMS)
        x_pair = tl.load(sorted_ptr + pid_m * BM + column // TERMS)
        x_valid = x_pair < M
        if STAGE == 13:
            x_term_row = (column % TERMS) * T + tl.where(x_valid, x_pair, 0) // TOPK
            n_w = 2 * N_OUT
        else:
            x_term_row = (column % TERMS) * M + tl.where(x_valid, x_pair, 0)
            n_w = N_OUT
        x_term_row = x_term_row.to(tl.int64)
        NB = n_w // 16
        KC = K // 128
        i = tl.arange(0, R)
        g = i % 8
        blk = expert.to(tl.int64) * NB + pid_n * BLOCKS + i // 8  # [R] (expert, block)
        if HAS_SLOTS:
            tier = tl.load(slots_ptr + expert)
            if tier >= 0:
                fp4_blk = tier.to(tl.int64) * NB + pid_n * BLOCKS + i // 8
                acc0, acc1 = _mx_chunks(xq_ptr, xs_ptr, x_term_row, x_valid, fp4_ptr, scales_ptr, blk, fp4_blk, g,
                                        KC, K, True, R, BM * TERMS)
            else:
                acc0, acc1 = _mx_chunks(xq_ptr, xs_ptr, x_term_row, x_valid, words_ptr, scales_ptr, blk, blk, g,
                                        KC, K, False, R, BM * TERMS)
        else:
            acc0, acc1 = _mx_chunks(xq_ptr, xs_ptr, x_term_row, x_valid, words_ptr, scales_ptr, blk, blk, g,
                                    KC, K, False, R, BM * TERMS)
        acc0 = _sum_terms(acc0, R, BM, TERMS)
        acc1 = _sum_terms(acc1, R, BM, TERMS)
        pair64 = pair[None, :].to(tl.int64)
        rs = row_scale_ptr + expert.to(tl.int64) * n_w
        if STAGE == 13:
            col = pid_n * R + i  # gate row; the up row is N_OUT + col
            gate = acc0 * (tl.load(rs + col) * POST)[:, None]
            up = acc1 * (tl.load(rs + N_OUT + col) * POST)[:, None]
            h = gate / (1.0 + tl.exp(-gate)) * up
            tl.store(out_ptr + pair64 * N_OUT + col[:, None], h.to(tl.bfloat16), mask=valid[None, :])
        else:
            row = (pid_n * BLOCKS + i // 8) * 16 + g  # rows g; rows g + 8 come from acc1
            route_w = tl.load(topk_w_ptr + pair, mask=valid, other=0.0)[None, :]
            lo = acc0 * (tl.load(rs + row) * POST)[:, None] * route_w
            hi = acc1 * (tl.load(rs + row + 8) * POST)[:, None] * route_w
            tl.store(out_ptr + pair64 * N_OUT + row[:, None], lo, mask=valid[None, :])
            tl.store(out_ptr + pair64 * N_OUT + row[:, None] + 8, hi, mask=valid[None, :])


@dataclass
class MxWorkspace:
    """Uninitialised buffers of one forward: the e4m3 activation terms with their UE8M0 bytes for both
    projections, the bf16 SiLU·up rows per (token, slot) pair and the f32 w2 rows per pair."""

    x_q: torch.Tensor  # uint8 [terms, T, H]
    x_s: torch.Tensor  # uint8 [terms, T, H/32]
    act: torch.Tensor  # bf16 [T·k, I]
    act_q: torch.Tensor  # uint8 [terms, T·k, I]
    act_s: torch.Tensor  # uint8 [terms, T·k, I/32]
    pair_out: torch.Tensor  # f32 [1, T·k, H] (moet.kernels.glue.combine's K-slice axis)


def new_mx_workspace(tokens: int, pairs: int, inter: int, hidden: int, terms: int, device: torch.device) -> MxWorkspace:
    def u8(*shape: int) -> torch.Tensor:
        return torch.empty(terms, *shape, dtype=torch.uint8, device=device)

    return MxWorkspace(
        x_q=u8(tokens, hidden), x_s=u8(tokens, hidden // 32),
        act=torch.empty(pairs, inter, dtype=torch.bfloat16, device=device),
        act_q=u8(pairs, inter), act_s=u8(pairs, inter // 32),
        pair_out=torch.empty(1, pairs, hidden, dtype=torch.float32, device=device),
    )


def quantize(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, rows_per_program: int = 16) -> None:
    """bf16 x [rows, K] (K a multiple of 128) → e4m3 terms q [terms, rows, K] and their UE8M0 bytes s
    (moet.kernels.mx.quantize_activations)."""
    rows, k = x.shape
    grid = (triton.cdiv(rows, rows_per_program), k // 128)
    quantize_kernel[grid](x, q, s, rows, k, BM=rows_per_program, TERMS=q.shape[0])


def mx_gemm(
    stage: int,
    x_q: torch.Tensor,
    x_s: torch.Tensor,
    out: torch.Tensor,
    w: StackedWeights,
    slots: Fp4Slots | None,
    topk_weights: torch.Tensor,
    aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    config: GemmConfig,
) -> None:
    """Launch one projection (stage 13 or 2) over aligned pair blocks, writing `out` rows per pair."""
    tokens, top_k = topk_weights.shape
    _, n_w, k = w.shape
    if w.scale_kind != "mx32":
        raise ValueError(f"the block-scaled path takes UE8M0/32 scales (mx32), not {w.scale_kind!r}")
    if n_w % config.rows or config.split != 1:
        raise ValueError(f"tile {config} does not fit N={n_w} (and this kernel has no K split)")
    fp4 = None if slots is None else (slots.w13 if stage == 13 else slots.w2)
    sorted_ids, block_expert, n_padded = aligned
    mx_gemm_kernel[(block_expert.numel(), n_w // config.rows)](
        x_q, x_s, out, w.words, w.scales, w.row_scale,
        w.words if slots is None else slots.table, w.words if fp4 is None else fp4,
        topk_weights, sorted_ids, block_expert, n_padded,
        tokens, n_w // 2 if stage == 13 else n_w, k, top_k,
        STAGE=stage, HAS_SLOTS=slots is not None, TERMS=x_q.shape[0], BLOCKS=config.blocks, BM=config.bm,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


def fused_moe_mx(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: StackedWeights,
    w2: StackedWeights,
    slots: Fp4Slots | None = None,
    terms: int = 2,
    config: GemmConfig | None = None,
    workspace: MxWorkspace | None = None,
) -> torch.Tensor:
    """MoE layer output [T, H] (x's dtype) on the block-scaled MMA, as moet.kernels.moe.fused_moe_2bit (SiLU).

    Activations are quantized before each projection to `terms` e4m3 terms per 32 k (1: plain FP8, ~5% off
    float64 per layer; 2: the residual too, twice the MMAs; moet.kernels.mx.mx_moe_reference is what this
    computes). `config`: DECODE_CONFIG up to DECODE_MAX_TOKENS tokens, else PREFILL_CONFIG.
    sm_120a only; never run on a GPU here.
    """
    tokens, hidden = x.shape
    config = config or (DECODE_CONFIG if tokens <= DECODE_MAX_TOKENS else PREFILL_CONFIG)
    top_k = topk_ids.shape[1]
    inter = w13.shape[1] // 2
    x = x.to(torch.bfloat16).contiguous()
    topk_weights = topk_weights.to(torch.float32).contiguous()
    aligned = sorted_pairs(topk_ids.to(torch.int32).contiguous(), w13.shape[0], config.bm)
    ws = workspace or new_mx_workspace(tokens, tokens * top_k, inter, hidden, terms, x.device)
    quantize(x, ws.x_q, ws.x_s)
    mx_gemm(13, ws.x_q, ws.x_s, ws.act, w13, slots, topk_weights, aligned, config)
    quantize(ws.act, ws.act_q, ws.act_s)
    mx_gemm(2, ws.act_q, ws.act_s, ws.pair_out, w2, slots, topk_weights, aligned, config)
    return combine(ws.pair_out, tokens, top_k, x.dtype)
