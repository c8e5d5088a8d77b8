"""Kernel layout, glue and references on CPU; the Triton decoders under TRITON_INTERPRET; the fused MoE on GPU."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from moet.kernels.glue import PAD, align, combine, max_blocks, select_experts
from moet.kernels.layout import (
    BASE_PAIR_MASK,
    BASE_PAIR_ONE,
    StackedWeights,
    mma_base_words,
    mma_fp4_words,
    mma_refine_planes,
    mma_scales,
    relayout_codes,
    restore_codes,
    split_refinement,
)
from moet.kernels.reference import bf16_moe_grouped, bf16_moe_loop, host_routes, moe_reference
from moet.kernels.synthetic import random_stored
from moet.quant.codebook import decode_base

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton GPU kernels need a CUDA device (CI has none)")


def _rotr(w: torch.Tensor, r: int) -> torch.Tensor:
    return ((w >> r) | (w << (32 - r))) & 0xFFFFFFFF


def test_relayout_roundtrip_and_pair_decode():
    """Rotate + mask of each relaid word gives bf16 pairs equal to 2× the stored base values."""
    stored = random_stored(2, 8, 64, "mx32", seed=3)
    words = relayout_codes(stored.codes)
    assert words.shape == (2, 8, 4) and words.dtype == torch.int32
    assert torch.equal(restore_codes(words), stored.codes)
    w = words.to(torch.int64) & 0xFFFFFFFF
    pairs = torch.stack([(_rotr(w, 2 * j + 2) & BASE_PAIR_MASK) | BASE_PAIR_ONE for j in range(8)], dim=-1)
    halves = torch.stack([pairs & 0xFFFF, pairs >> 16], dim=-1).flatten(-3)  # [2, 8, 64] bf16 bit patterns
    values = (halves.to(torch.int32) << 16).view(torch.float32).double()
    assert torch.equal(values, 2 * decode_base(stored.codes))


def _bf16_bits_to_float(bits: torch.Tensor) -> torch.Tensor:
    return (bits.to(torch.int32) << 16).view(torch.float32).double()


def _mma_dense(pairs: torch.Tensor, gate_up: bool) -> torch.Tensor:
    """Decoded lane values [E, NB, KC, g, t, q, s, b, r, h] (the kernel's operand order) → dense [E, N, K].

    The MMA's view: row = block row g + 8·r (for w13: gate row 8·block + g, up row I + 8·block + g),
    k = 128·chunk + 32·t + 8·q + 4·s + 2·b + h.
    """
    e, nb, kc = pairs.shape[:3]
    x = pairs.permute(0, 1, 8, 3, 2, 4, 5, 6, 7, 9)  # [E, NB, r, g, KC, t, q, s, b, h]
    x = x.reshape(e, nb, 2, 8, kc * 128)
    if gate_up:
        return x.transpose(1, 2).reshape(e, nb * 16, kc * 128)
    return x.reshape(e, nb * 16, kc * 128)


def _lane_scales(stored, gate_up: bool) -> torch.Tensor:
    """Block scale of each lane value [E, NB, KC, g, t, q, 1, 1, r, 1], read from mma_scales as the kernel does:
    mx32 byte r (row g / g+8); nv16 byte 2r + q//2 (words q < 2 use block 2t, q ≥ 2 block 2t+1)."""
    from moet.quant.scales import E4M3_VALUES, UE8M0_VALUES

    table = E4M3_VALUES if stored.scale_kind == "nv16" else UE8M0_VALUES
    sc = table[mma_scales(stored.scales, stored.scale_kind, gate_up).long()]  # [E, NB, KC, 32, bytes]
    e, nb, kc = sc.shape[:3]
    q, r = torch.arange(4).view(4, 1), torch.arange(2).view(1, 2)
    index = r.expand(4, 2) if stored.scale_kind == "mx32" else 2 * r + q // 2
    per = sc.view(e, nb, kc, 8, 4, -1)[..., index]  # [E, NB, KC, g, t, q, r]
    return per.view(e, nb, kc, 8, 4, 4, 1, 1, 2, 1)


def _expected(stored, tier: str) -> torch.Tensor:
    """float64 [E, N, K] weights without the row scale (the kernels apply it in the epilogue)."""
    experts = stored.codes.shape[0]
    return torch.stack([stored.dequantize(e, tier) / stored.row_scale[e].double().unsqueeze(-1) for e in range(experts)])


@pytest.mark.parametrize("scale_kind", ["mx32", "nv16"])
@pytest.mark.parametrize("gate_up", [False, True])
def test_mma_base_layout_decodes_like_the_kernel(scale_kind, gate_up):
    """decode_base of kernels/moe_decode.cu (rotate by 2p+2, mask, bf16 scale) on the mma layout gives 2× the base."""
    stored = random_stored(2, 64, 256, scale_kind, seed=7)
    words = mma_base_words(stored.codes, gate_up).to(torch.int64) & 0xFFFFFFFF  # [E, NB, KC, 32, q]
    assert words.shape == (2, 4, 2, 32, 4)
    pairs = torch.stack([(_rotr(words, 2 * p + 2) & BASE_PAIR_MASK) | BASE_PAIR_ONE for p in range(8)], dim=-1)
    halves = torch.stack([pairs & 0xFFFF, pairs >> 16], dim=-1)  # [E, NB, KC, 32, q, p, h]
    values = _bf16_bits_to_float(halves).view(2, 4, 2, 8, 4, 4, 2, 2, 2, 2) * _lane_scales(stored, gate_up)
    assert torch.equal(_mma_dense(values, gate_up), 2 * _expected(stored, "base"))


@pytest.mark.parametrize("scale_kind", ["mx32", "nv16"])
@pytest.mark.parametrize("gate_up", [False, True])
def test_mma_fp4_layout_decodes_like_the_kernel(scale_kind, gate_up):
    """decode_fp4 of kernels/moe_decode.cu (shifts and masks to e2m1·2^-126 bf16 bits) gives the FP4 planes exactly."""
    stored = random_stored(2, 64, 256, scale_kind, seed=8)
    words = mma_fp4_words(stored.fp4, gate_up).to(torch.int64) & 0xFFFFFFFF  # [E, NB, KC, 32, step]
    assert words.shape == (2, 4, 2, 32, 8)
    field, sign = 0x01C001C0, 0x80008000
    q3 = (words << 3) & 0xFFFFFFFF
    regs = torch.stack(
        [
            ((words << 6) & field) | (q3 & sign),
            (q3 & field) | ((words << 2) & sign),
            (words & field) | ((words << 1) & sign),
            ((words >> 3) & field) | (words & sign),
        ],
        dim=-1,
    )  # [E, NB, KC, 32, step, r4]
    halves = torch.stack([regs & 0xFFFF, regs >> 16], dim=-1)
    values = _bf16_bits_to_float(halves) * 2.0**126  # the kernel's 2^63 in the scale and 2^63 in the epilogue
    values = values.view(2, 4, 2, 8, 4, 4, 2, 2, 2, 2) * _lane_scales(stored, gate_up)  # step → (q, s); r4 → (b, r)
    assert torch.equal(_mma_dense(values, gate_up), _expected(stored, "fp4"))


@pytest.mark.parametrize("scale_kind", ["mx32", "nv16"])
@pytest.mark.parametrize("gate_up", [False, True])
def test_mma_refine_layout_decodes_like_the_kernel(scale_kind, gate_up):
    """decode_refine of kernels/moe_decode.cu (10-bit groups, multiply-shift digits, magnitude = digit + 5·big,
    sign from the base) on the mma layout gives the FP4 weights exactly."""
    stored = random_stored(2, 64, 256, scale_kind, seed=9)
    words = mma_base_words(stored.codes, gate_up).to(torch.int64) & 0xFFFFFFFF  # [E, NB, KC, 32, q]
    plane_a, plane_b = mma_refine_planes(stored.refine, gate_up)
    assert plane_a.shape == (2, 4, 2, 32, 4) and plane_b.shape == (2, 4, 2, 32)
    rw = torch.cat([plane_a, plane_b.unsqueeze(-1)], dim=-1).to(torch.int64) & 0xFFFFFFFF  # 160 bits per lane
    groups = []
    for j in range(16):
        start = 10 * j
        wi, off = divmod(start, 32)
        if off <= 22:
            g = (rw[..., wi] >> off) & 0x3FF
        else:  # funnel shift right of (hi:lo)
            g = ((rw[..., wi] >> off) | (rw[..., wi + 1] << (32 - off))) & 0x3FF
        groups.append(g)
    pairs = []
    for q in range(4):
        digits = []
        for pp in range(4):
            g = groups[4 * q + pp]
            hi = (g * 41) >> 10
            lo = g - 25 * hi
            digits += [lo + ((lo * 13) >> 6) * 65531, hi + ((hi * 13) >> 6) * 65531]
        for p in range(8):
            r = _rotr(words[..., q], 2 * p + 2) & BASE_PAIR_MASK
            magnitude = digits[p] + 5 * ((r >> 8) & 0x00010001)
            pairs.append((r & 0x80008000) | (magnitude << 6))
    pairs = torch.stack(pairs, dim=-1)  # [E, NB, KC, 32, (q, p)]
    halves = torch.stack([pairs & 0xFFFF, pairs >> 16], dim=-1)
    values = _bf16_bits_to_float(halves) * 2.0**126
    values = values.view(2, 4, 2, 8, 4, 4, 2, 2, 2, 2) * _lane_scales(stored, gate_up)
    assert torch.equal(_mma_dense(values, gate_up), _expected(stored, "refine"))


def test_split_refinement_keeps_bytes():
    stored = random_stored(1, 4, 32, "nv16", seed=4)
    lo, hi = split_refinement(stored.refine)
    groups = stored.refine.view(1, 4, 2, 5)
    assert torch.equal(lo.view(torch.uint8).view(1, 4, 2, 4), groups[..., :4])
    assert torch.equal(hi, groups[..., 4])


def test_stacked_weights_bytes():
    stored = random_stored(4, 32, 64, "mx32", seed=5)
    w = StackedWeights.from_stored(stored.codes, stored.scales, "mx32", stored.row_scale, stored.fp4, stored.refine)
    assert w.shape == (4, 32, 64)
    assert w.base_nbytes() == 32 * 64 // 4 + 32 * 2 + 32 * 4
    assert w.tier_nbytes("fp4") == 32 * 32 + 32 * 2 + 32 * 4
    assert w.tier_nbytes("refine") == 32 * 16 + 32 * 20 + 32 * 2 + 32 * 4


def test_select_experts_renormalises():
    logits = torch.randn(5, 16)
    weights, ids = select_experts(logits, 4)
    assert ids.dtype == torch.int32
    assert torch.equal(ids.long(), logits.topk(4).indices)
    torch.testing.assert_close(weights.sum(-1), torch.ones(5))
    sig_w, sig_ids = select_experts(logits, 4, scoring="sigmoid", renormalize=False, correction_bias=torch.randn(16))
    torch.testing.assert_close(sig_w, logits.sigmoid().gather(-1, sig_ids.long()))


@pytest.mark.parametrize("tokens,experts,top_k,block", [(1, 8, 2, 16), (37, 8, 3, 4), (200, 64, 6, 16)])
def test_align_sorts_every_pair_once(tokens, experts, top_k, block):
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]).to(torch.int32)
    sorted_ids, block_expert, n_padded = align(ids, experts, block)
    pairs = tokens * top_k
    assert sorted_ids.numel() == max_blocks(pairs, experts, block) * block
    real = sorted_ids[sorted_ids != PAD].long()
    assert torch.equal(real.sort().values, torch.arange(pairs))
    assert int(n_padded) % block == 0 and (sorted_ids[int(n_padded) :] == PAD).all()
    flat = ids.flatten().long()
    for b in range(int(n_padded) // block):
        chunk = sorted_ids[b * block : (b + 1) * block]
        chunk = chunk[chunk != PAD].long()
        assert (flat[chunk] == int(block_expert[b])).all()


def test_combine_sums_slices_and_slots():
    pair = torch.randn(2, 6, 5)
    torch.testing.assert_close(combine(pair, 3, 2, torch.float32), pair.view(2, 3, 2, 5).sum((0, 2)))


@pytest.mark.parametrize("tier", ["base", "fp4", "refine"])
def test_bf16_references_agree_with_float64(tier):
    """Both bf16 PyTorch MoEs (grouped and per-expert loop) match the float64 reference within the bf16 band."""
    s13 = random_stored(6, 2 * 32, 64, "nv16", seed=6)
    s2 = random_stored(6, 64, 32, "nv16", seed=7)
    x = torch.randn(9, 64).to(torch.bfloat16)
    weights, ids = select_experts(torch.randn(9, 6), 2)
    ref = moe_reference(x, weights, ids, s13, s2, tier)
    b13 = torch.stack([s13.dequantize(e, tier) for e in range(6)]).to(torch.bfloat16)
    b2 = torch.stack([s2.dequantize(e, tier) for e in range(6)]).to(torch.bfloat16)
    for out in (bf16_moe_grouped(x, weights, ids, b13, b2), bf16_moe_loop(x, host_routes(weights, ids), b13, b2)):
        assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2


def test_refinement_and_planes_are_the_same_weights():
    stored = random_stored(2, 16, 32, "mx32", seed=8)
    for e in range(2):
        assert torch.equal(stored.dequantize(e, "fp4"), stored.dequantize(e, "refine"))


_INTERPRETED_DECODE = textwrap.dedent(
    """
    import torch, triton, triton.language as tl
    from moet.kernels.gemm import _base_pairs, _fp4_pairs, _refine_pairs
    from moet.kernels.layout import StackedWeights
    from moet.kernels.synthetic import random_stored
    from moet.quant.codebook import decode_base, decode_fp4, nibbles_from_refinement

    @triton.jit
    def pairs_kernel(words, tier, tier_hi, out, K, FMT: tl.constexpr, BN: tl.constexpr, G: tl.constexpr):
        rows = tl.arange(0, BN).to(tl.int64)
        if FMT == 0:
            v = _base_pairs(words, rows, 0, K, G) | 0x40004000
        elif FMT == 1:
            v = _fp4_pairs(tier, rows, 0, K, G)
        else:
            v = _refine_pairs(words, tier, tier_hi, rows, 0, K, G)
        v = tl.reshape(v, [BN, G * 8])
        tl.store(out + rows[:, None] * (G * 8) + tl.arange(0, G * 8)[None, :], v.to(tl.int64))

    def bf16_values(pairs):
        halves = torch.stack([pairs & 0xFFFF, pairs >> 16], dim=-1).flatten(-2)
        return (halves.to(torch.int32) << 16).view(torch.float32).double()

    s = random_stored(1, 4, 32, "mx32", seed=9)
    w = StackedWeights.from_stored(s.codes, s.scales, "mx32", s.row_scale, s.fp4, s.refine)
    expected = {0: 2 * decode_base(s.codes[0]), 1: decode_fp4(s.fp4[0]) * 2.0**-126, 2: decode_fp4(s.fp4[0]) * 2.0**-126}
    for fmt in (0, 1, 2):
        out = torch.empty(4, 16, dtype=torch.int64)
        tier = w.fp4 if fmt == 1 else w.refine_lo
        pairs_kernel[(1,)](w.words, tier, w.refine_hi, out, 32, FMT=fmt, BN=4, G=2)
        got = bf16_values(out & 0xFFFFFFFF)
        assert torch.equal(got, expected[fmt]), (fmt, got, expected[fmt])
    print("decoders ok")
    """
)


def test_triton_decoders_interpreted():
    """The in-register decoders of all three formats, run by Triton's CPU interpreter (bit-exact)."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", _INTERPRETED_DECODE], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "decoders ok" in proc.stdout, proc.stdout + proc.stderr


@needs_gpu
@pytest.mark.parametrize("scale_kind", ["nv16", "mx32"])
@pytest.mark.parametrize("tier", ["base", "fp4", "refine"])
@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_fused_moe_matches_float64(scale_kind, tier, tokens):
    from moet.kernels.moe import default_configs, fused_moe_w2, new_workspace

    hidden, inter, experts, top_k = 512, 1024, 16, 4
    s13 = random_stored(experts, 2 * inter, hidden, scale_kind, "cuda", seed=tokens)
    s2 = random_stored(experts, hidden, inter, scale_kind, "cuda", seed=tokens + 1)
    w13 = StackedWeights.from_stored(s13.codes, s13.scales, scale_kind, s13.row_scale, s13.fp4, s13.refine)
    w2 = StackedWeights.from_stored(s2.codes, s2.scales, scale_kind, s2.row_scale, s2.fp4, s2.refine)
    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    weights, ids = select_experts(torch.randn(tokens, experts, device="cuda"), top_k)
    configs = default_configs(tokens, hidden, inter)
    ws = new_workspace(tokens * top_k, inter, hidden, x.device, configs)
    for buf in (ws.act, ws.pair_out, ws.gate_up):
        if buf is not None:
            buf.fill_(float("nan"))
    out = fused_moe_w2(x, weights, ids, w13, w2, tier=tier, configs=configs, workspace=ws)
    assert not ws.pair_out.isnan().any() and not ws.act.isnan().any()
    ref = moe_reference(x, weights, ids, s13, s2, tier)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2



needs_cubin = pytest.mark.skipif(
    not torch.cuda.is_available() or not __import__("moet.kernels.cuda", fromlist=["available"]).available(),
    reason="the CUDA decode kernels need a CUDA device and their cubin (python kernels/build.py)",
)


@needs_cubin
@pytest.mark.parametrize("scale_kind", ["nv16", "mx32"])
@pytest.mark.parametrize("tier", ["base", "fp4", "refine"])
@pytest.mark.parametrize("tokens", [1, 5, 13, 64])
def test_cuda_decode_matches_float64(scale_kind, tier, tokens):
    """kernels/moe_decode.cu against the float64 MoE; K = 640 is 5 chunks (not a multiple of the ring),
    64 tokens over 8 experts put up to 64 tokens on one expert (all n-tiles); NaN-poisoned buffers."""
    from moet.kernels.moe import default_configs, fused_moe_w2, new_workspace

    hidden, inter, experts, top_k = 640, 384, 8, 3
    s13 = random_stored(experts, 2 * inter, hidden, scale_kind, "cuda", seed=tokens)
    s2 = random_stored(experts, hidden, inter, scale_kind, "cuda", seed=tokens + 1)
    w13 = StackedWeights.from_stored(
        s13.codes, s13.scales, scale_kind, s13.row_scale, s13.fp4, s13.refine, mma=True, gate_up=True
    )
    w2 = StackedWeights.from_stored(s2.codes, s2.scales, scale_kind, s2.row_scale, s2.fp4, s2.refine, mma=True)
    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    weights, ids = select_experts(torch.randn(tokens, experts, device="cuda"), top_k)
    configs = default_configs(tokens, hidden, inter, "cuda", tier)
    assert configs[0].backend == "cuda"
    ws = new_workspace(tokens * top_k, inter, hidden, x.device, configs)
    ws.act.fill_(float("nan"))
    ws.pair_out.fill_(float("nan"))
    out = fused_moe_w2(x, weights, ids, w13, w2, tier=tier, configs=configs, workspace=ws)
    assert not ws.pair_out.isnan().any() and not ws.act.isnan().any()
    ref = moe_reference(x, weights, ids, s13, s2, tier)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
    triton = fused_moe_w2(x, weights, ids, w13, w2, tier=tier, configs=default_configs(tokens, hidden, inter))
    assert ((out.double() - triton.double()).norm() / ref.norm()).item() < 1e-2


@needs_gpu
@pytest.mark.parametrize("decode_layout", [False, True])
def test_fused_moe_graph_capturable_and_deterministic(decode_layout):
    """Triton (row layout only) and CUDA decode kernels (decode layout): graph replay == eager == a rerun."""
    from moet.kernels import cuda
    from moet.kernels.moe import cuda_decode_applies, fused_moe_w2

    if decode_layout and not cuda.available():
        pytest.skip("the CUDA decode kernels need their cubin (python kernels/build.py)")
    hidden, inter, experts, top_k = 512, 1024, 8, 2
    s13 = random_stored(experts, 2 * inter, hidden, "mx32", "cuda", seed=1)
    s2 = random_stored(experts, hidden, inter, "mx32", "cuda", seed=2)
    w13 = StackedWeights.from_stored(s13.codes, s13.scales, "mx32", s13.row_scale, mma=decode_layout, gate_up=True)
    w2 = StackedWeights.from_stored(s2.codes, s2.scales, "mx32", s2.row_scale, mma=decode_layout)
    assert cuda_decode_applies(3, w13, "base") == decode_layout
    x = torch.randn(3, hidden, device="cuda").to(torch.bfloat16)
    weights, ids = select_experts(torch.randn(3, experts, device="cuda"), top_k)
    eager = fused_moe_w2(x, weights, ids, w13, w2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused_moe_w2(x, weights, ids, w13, w2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(eager, captured)
    assert torch.equal(eager, fused_moe_w2(x, weights, ids, w13, w2))


@needs_cubin
@pytest.mark.parametrize("tier", ["base", "fp4", "refine"])
def test_cuda_decode_every_tuning_matches_float64(tier):
    from moet.kernels.cuda import TUNINGS
    from moet.kernels.moe import cuda_config, fused_moe_w2

    hidden, inter, experts, top_k, tokens = 640, 384, 8, 3, 40  # some experts get > 16 tokens: two passes
    s13 = random_stored(experts, 2 * inter, hidden, "mx32", "cuda", seed=21)
    s2 = random_stored(experts, hidden, inter, "mx32", "cuda", seed=22)
    w13 = StackedWeights.from_stored(
        s13.codes, s13.scales, "mx32", s13.row_scale, s13.fp4, s13.refine, mma=True, gate_up=True
    )
    w2 = StackedWeights.from_stored(s2.codes, s2.scales, "mx32", s2.row_scale, s2.fp4, s2.refine, mma=True)
    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    weights, ids = select_experts(torch.randn(tokens, experts, device="cuda"), top_k)
    ref = moe_reference(x, weights, ids, s13, s2, tier)
    for tuning in TUNINGS:
        out = fused_moe_w2(x, weights, ids, w13, w2, tier=tier, configs=(cuda_config(tuning),) * 2)
        assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2, tuning
