"""Kernel layout, glue and references on CPU; the Triton kernels under TRITON_INTERPRET; the fused MoE on GPU."""

from __future__ import annotations

import itertools
import math
import textwrap

import pytest
import torch

from moet.kernels.glue import PAD, align, combine, max_blocks, select_experts
from moet.kernels.layout import (
    BIG_BITS,
    SIGN_BITS,
    Fp4Slots,
    StackedWeights,
    mma_base_words,
    mma_fp4_words,
    mma_k_order,
    mma_scales,
)
from moet.testing.reference import bf16_moe_grouped, bf16_moe_loop, host_routes, moe_reference, run_poisoned
from moet.testing.random_stacked import random_stored
from moet.quant.codebook import Tier, decode_base, unpack_codes
from tests.interpreted import run_interpreted

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton GPU kernels need a CUDA device (CI has none)")


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


def _expected(stored, tier: Tier) -> torch.Tensor:
    """float64 [E, N, K] weights without the row scale (the kernels apply it in the epilogue)."""
    experts = stored.codes.shape[0]
    return torch.stack([stored.dequantize(e, tier) / stored.row_scale[e].double().unsqueeze(-1) for e in range(experts)])


@pytest.mark.parametrize("scale_kind", ["mx32", "nv16"])
@pytest.mark.parametrize("gate_up", [False, True])
def test_mma_base_layout_decodes_like_the_kernel(scale_kind, gate_up):
    """decode_base of moet/kernels/src/moe_decode.cu on the mma layout gives 2× the base: pair p < 7 is
    (w & 0x01020102 << p)·2^(7−p) + e, pair 7 (w & 0x00010001)·2^8 + (w & 0x80008000 | e), where e is the bf16
    exponent field pair of 2× the UE8M0 scale, or of 2.0 with the pairs then times the e4m3 scale."""
    stored = random_stored(2, 64, 256, scale_kind, seed=7)
    words = mma_base_words(stored.codes, gate_up).to(torch.int64) & 0xFFFFFFFF  # [E, NB, KC, 32, q]
    assert words.shape == (2, 4, 2, 32, 4)
    if scale_kind == "mx32":  # scale byte r of the lane: rows g + 8r
        e = (mma_scales(stored.scales, "mx32", gate_up).to(torch.int64) + 1) * 0x00800080  # [E, NB, KC, 32, r]
        e = [e[..., r : r + 1] for r in range(2)]
        scale = 1.0
    else:
        e = [0x40004000, 0x40004000]
        scale = _lane_scales(stored, gate_up)
    pairs = torch.stack(
        [((words & (0x01020102 << p)) << (7 - p)) + e[p % 2] for p in range(7)]
        + [((words & 0x00010001) << 8) + ((words & 0x80008000) | e[1])],
        dim=-1,
    ) & 0xFFFFFFFF
    halves = torch.stack([pairs & 0xFFFF, pairs >> 16], dim=-1)  # [E, NB, KC, 32, q, p, h]
    values = _bf16_bits_to_float(halves).view(2, 4, 2, 8, 4, 4, 2, 2, 2, 2) * scale
    assert torch.equal(_mma_dense(values, gate_up), 2 * _expected(stored, Tier.NONE))


def test_base_word_bits_each_hold_one_weight_bit():
    """The 16 weights' sign and "big" bits tile a 32-bit word, each half's pair 7 at bits 0 and 15, pair p < 7 at
    p + 1 and p + 8."""
    assert sorted(SIGN_BITS + BIG_BITS) == list(range(32))
    assert (SIGN_BITS[14], BIG_BITS[14], SIGN_BITS[15], BIG_BITS[15]) == (15, 0, 31, 16)
    assert (SIGN_BITS[6], BIG_BITS[6], SIGN_BITS[7], BIG_BITS[7]) == (11, 4, 27, 20)


@pytest.mark.parametrize("gate_up", [True, False])
def test_mma_base_words_converted_in_parts_equal_one_conversion(monkeypatch, gate_up):
    """Large layers are re-laid a few experts at a time (bounded temporaries); the words do not depend on it."""
    from moet.kernels import layout

    codes = torch.randint(0, 256, (7, 64, 64), dtype=torch.uint8)
    whole = layout.mma_base_words(codes, gate_up)
    monkeypatch.setattr(layout, "CONVERT_WEIGHTS", 2 * 64 * 256)  # two experts a part: parts of 2, 2, 2, 1
    assert torch.equal(layout.mma_base_words(codes, gate_up), whole)


def test_mma_k_order_puts_each_lane_offset_at_its_wgmma_position():
    """Lane t's k 32t + 4s + 2b + h (k16 step s, operand half b, element h) goes to position 16s + 8b + 2t + h of
    its 128-k chunk (the A fragment of wgmma / mma.sync: lane t holds k 2t, 2t + 1, 2t + 8, 2t + 9 of a step)."""
    x = torch.arange(3 * 384, dtype=torch.int64).view(3, 384)
    expected = torch.empty_like(x)
    for c, t, s, b, h in itertools.product(range(3), range(4), range(8), range(2), range(2)):
        expected[:, 128 * c + 16 * s + 8 * b + 2 * t + h] = x[:, 128 * c + 32 * t + 4 * s + 2 * b + h]
    assert torch.equal(mma_k_order(x), expected)


def test_mma_k_order_fp8_puts_each_lane_byte_at_its_wgmma_position():
    """With fp8: lane t's k 32t + 8w + 4s' + 2b + h goes to position 32w + 16s' + 4t + 2h + b of its chunk (the A
    fragment of an e4m3 wgmma: a register holds k 4t..4t + 3 of one row, the second pair of registers k + 16, per
    k32 step w; the decode puts the word's pair b = 0 in bytes 0 and 2 of a register, b = 1 in bytes 1 and 3)."""
    x = torch.arange(2 * 256, dtype=torch.int64).view(2, 256)
    expected = torch.empty_like(x)
    for c, t, w, s, b, h in itertools.product(range(2), range(4), range(4), range(2), range(2), range(2)):
        expected[:, 128 * c + 32 * w + 16 * s + 4 * t + 2 * h + b] = x[:, 128 * c + 32 * t + 8 * w + 4 * s + 2 * b + h]
    assert torch.equal(mma_k_order(x, fp8=True), expected)


_INTERPRETED_E4M3_POWER = textwrap.dedent(
    """
    import torch
    import triton
    import triton.language as tl
    from moet.kernels.gemm import e4m3_power
    from moet.quant.scales import scale_values

    @triton.jit
    def powers(top_ptr, p_ptr, SCALE_B: tl.constexpr):
        i = tl.arange(0, 256)
        tl.store(p_ptr + i, e4m3_power(tl.load(top_ptr + i), SCALE_B))

    top = torch.arange(256, dtype=torch.int32)
    for scale_kind, block in (("mx32", 32), ("nv16", 16)):
        p = torch.empty(256, dtype=torch.float32)
        powers[(1,)](top, p, SCALE_B=block)
        scale = scale_values(top.to(torch.uint8), scale_kind)
        v = scale.clamp(min=2.0**-120) if scale_kind == "mx32" else scale  # UE8M0 bytes below 7 count as 7
        want = torch.exp2(torch.ceil(torch.log2(4 * v / 448)))
        want = torch.where(v > 0, want, 1.0)  # e4m3's zero scale
        live = torch.isfinite(v)
        assert torch.equal(p.double()[live], want[live]), scale_kind
        if scale_kind == "nv16":
            assert p[0x3E] * 448 == 4 * 1.75  # 4 · scale / P = 448 exactly: 448 itself is then a weight
        # every ±1, ±4 × scale / P of a chunk is an e4m3 value for scales down to 2^-15 (UE8M0) of the largest
        for t in range(256):
            if not live[t] or v[t] <= 0:  # NaN, zero and (e4m3) negative scales: P = 1
                continue
            low = scale[max(0, t - 15) : t + 1] if scale_kind == "mx32" else scale[t : t + 1]
            for code in (1.0, 4.0):
                w = code * low / p[t].double()
                assert w.max() <= 448 and torch.equal(w.to(torch.float8_e4m3fn).double(), w), (scale_kind, t)
    print("e4m3 powers ok")
    """
)


def test_e4m3_power_puts_each_chunk_row_in_e4m3():
    """The FP8 prefill's power of two per row and 128-k chunk (moet.kernels.gemm.e4m3_power, under Triton's CPU
    interpreter) for every scale byte of both kinds, against float64: the smallest P with 4 · scale / P ≤ 448 (1 for
    a zero scale; UE8M0 bytes below 7 taken as 7), and every 2-bit base weight of a chunk whose scales are within
    2^15 of its largest is an e4m3 value of at most 448 over it."""
    run_interpreted(_INTERPRETED_E4M3_POWER, "e4m3 powers ok", tensor_loops=False)


_INTERPRETED_E4M3_ROWS = textwrap.dedent(
    """
    import torch
    from moet.eval.variants import fp8_rows
    from moet.kernels.layout import mma_k_order
    from moet.kernels.moe import e4m3_rows

    x = (torch.randn(5, 384) * torch.logspace(-3, 3, 5)[:, None]).to(torch.bfloat16)
    x[2] = 0
    x[3, :4] = torch.tensor([448.0, 2.125, -2.125, 2.375])  # scale 1; steps of 0.25 from 2: ties, to even
    for fp8_order in (False, True):
        q, scale = e4m3_rows(x, fp8_order)
        want = x.float().abs().amax(-1) / 448
        want = torch.where(want > 0, want, torch.ones_like(want))
        assert torch.equal(scale, want), (scale, want)
        ref = (x.float() / want[:, None]).to(torch.float8_e4m3fn)
        ref = mma_k_order(ref.view(torch.uint8), fp8=True) if fp8_order else ref.view(torch.uint8)
        assert torch.equal(q.view(torch.uint8), ref), fp8_order
        hand = [0x7E, 0xC0, 0x40, 0x42] if fp8_order else [0x7E, 0x40, 0xC0, 0x42]  # the FP8 order swaps k 1 and 2
        assert torch.equal(q.view(torch.uint8)[3, :4], torch.tensor(hand, dtype=torch.uint8))
        dequant = (q.float() * scale[:, None]).double()
        assert torch.equal(dequant, mma_k_order(fp8_rows(x.double()), fp8=True) if fp8_order else fp8_rows(x.double()))
    print("e4m3 rows ok")
    """
)


def test_e4m3_rows_interpreted_round_like_fp8_rows():
    """The FP8 prefill's activation rows (moet.kernels.gemm.e4m3_rows_kernel, Triton's CPU interpreter): one scale
    per row max |x| / 448 (1 for a zero row), x / scale to nearest even e4m3 bit for bit as torch casts it (bytes
    written by hand for 448 and two ties), the FP8 k order on the way, and the values moet.eval.variants.fp8_rows
    (the scheme docs/QUALITY.md measured) gives."""
    run_interpreted(_INTERPRETED_E4M3_ROWS, "e4m3 rows ok", tensor_loops=False)


@pytest.mark.parametrize("scale_kind", ["mx32", "nv16"])
@pytest.mark.parametrize("gate_up", [False, True])
def test_mma_fp4_layout_decodes_like_the_kernel(scale_kind, gate_up):
    """decode_fp4 of moet/kernels/src/moe_decode.cu (shifts and masks to e2m1·2^-126 bf16 bits) gives the FP4 planes exactly."""
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
    assert torch.equal(_mma_dense(values, gate_up), _expected(stored, Tier.PLANES))


@pytest.mark.parametrize("tier", ["base", "fp4"])
def test_ue8m0_scale_pair_is_the_byte_in_the_exponent_field(tier):
    """scale_pairs of moet/kernels/src/moe_decode.cu builds the bf16 pair of 2^(b − 127) · 2^PRE as (b + PRE) · 0x00800080
    (PRE 1 for the base with UE8M0 scales: the exponent field decode_base adds, 2× the scale as POST_BASE undoes; 63 for
    FP4's 2^63): the same bits as rounding the float64 power of two to bf16, for every byte whose pair stays finite."""
    from moet.kernels.gemm import POST_BASE, SCALE_FP4

    pre = -int(math.log2(POST_BASE.value)) if tier == "base" else int(math.log2(SCALE_FP4.value))
    assert pre in (1, 63)
    b = torch.arange(1, 255 - pre, dtype=torch.int64)
    bits = torch.tensor([2.0 ** (int(v) - 127 + pre) for v in b], dtype=torch.float64).to(torch.bfloat16)
    half = bits.view(torch.int16).to(torch.int64) & 0xFFFF
    assert torch.equal(((b + pre) * 0x00800080) & 0xFFFFFFFF, half | (half << 16))


def test_stacked_weights_bytes():
    """The GPU holds one layout: 2 bits/weight of words, the block scales' bytes, 4 bytes of row scale per row."""
    stored = random_stored(4, 32, 256, "mx32", seed=5)
    w = StackedWeights.from_stacked(stored, torch.device("cpu"), gate_up=False)
    assert w.shape == (4, 32, 256)
    per_expert = 32 * 256 // 4 + 32 * 256 // 32 + 32 * 4
    assert w.base_nbytes() == 4 * per_expert and w.base_nbytes(experts=1) == per_expert
    assert w.words.numel() * 4 == stored.codes.numel() and w.scales.numel() == stored.scales.numel()
    assert w.fp4_nbytes(3) == 3 * 32 * 256 // 2 == mma_fp4_words(stored.fp4[:3], False).numel() * 4


@pytest.mark.parametrize("scale_kind,gate_up", [("mx32", False), ("nv16", True)])
def test_layout_permutes_the_stored_bytes_of_each_expert(scale_kind, gate_up):
    """The kernels' layout of a stored stack holds each expert's stored 2-bit base, permuted: the same byte
    counts (base_nbytes means the same on both), the same block-scale bytes in another order, the same row
    scales, one sign and one "big" bit per weight; the FP4 tier the stack also holds is not part of it."""
    stored = random_stored(3, 32, 256, scale_kind, seed=6)
    w = StackedWeights.from_stacked(stored, torch.device("cpu"), gate_up=gate_up)
    assert stored.fp4 is not None and stored.refine is not None and stored.tier_nbytes() > 0
    assert w.base_nbytes() == stored.base_nbytes()
    codes = unpack_codes(stored.codes)
    for e in range(3):
        assert w.base_nbytes(experts=1) == stored.expert(e).base_nbytes()
        assert torch.equal(w.scales[e].flatten().sort().values, stored.scales[e].flatten().sort().values)
        assert torch.equal(w.row_scale[e], stored.row_scale[e])
        bits = w.words[e].view(torch.uint8).flatten().unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8) & 1
        negative, big = int((codes[e] <= 1).sum()), int(((codes[e] == 0) | (codes[e] == 3)).sum())
        assert int(bits.sum()) == negative + big


@pytest.mark.parametrize("scale_kind,bits", [("mx32", 2.25), ("nv16", 2.5)])
def test_laid_out_layer_holds_the_documented_bits_per_weight(scale_kind, bits):
    """A layer laid out as the plugin does it (gpu_layer) holds its experts once: the documented bits/weight
    (docs/FORMAT.md) within 1%, whatever FP4 tier it was quantized with (that stays on the host)."""
    from moet.kernels.layout import gpu_layer

    hidden, inter = 4096, 2048  # DeepSeek-V4-Flash's expert shapes (the row scales' share depends on K)
    s13 = random_stored(1, 2 * inter, hidden, scale_kind, seed=11, refine=False)
    s2 = random_stored(1, hidden, inter, scale_kind, seed=12, refine=False)
    w13, w2, host = gpu_layer(s13, s2, torch.device("cpu"), fp4=True)
    weights = 3 * hidden * inter
    assert abs(8 * (w13.base_nbytes() + w2.base_nbytes()) / weights - bits) / bits < 0.01
    assert sum(t.numel() * 4 for t in host) * 8 / weights == 4.0  # the pool's host copies: whole FP4 planes


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


@pytest.mark.parametrize("tier", list(Tier))
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
        assert torch.equal(stored.dequantize(e, Tier.PLANES), stored.dequantize(e, Tier.REFINE))


_INTERPRETED_GEMMS = textwrap.dedent(
    """
    import torch
    from moet.kernels.glue import select_experts
    from moet.kernels.layout import Fp4Slots, StackedWeights, mma_fp4_words
    from moet.kernels.moe import GemmConfig, fused_moe_2bit, new_workspace
    from moet.testing.reference import moe_reference
    from moet.testing.random_stacked import random_stored

    hidden, inter, experts, top_k = 256, 128, 6, 2
    decode = (GemmConfig(2, 16, 4, 1, split=2), GemmConfig(2, 16, 4, 1))
    prefill = (GemmConfig(2, 16, 4, 1), GemmConfig(4, 128, 4, 1))  # w2's tile wide enough for ROWS_FIRST
    for scale_kind, tokens, configs in (("mx32", 3, decode), ("nv16", 70, prefill)):
        s13 = random_stored(experts, 2 * inter, hidden, scale_kind, seed=tokens)
        s2 = random_stored(experts, hidden, inter, scale_kind, seed=tokens + 1)
        w13 = StackedWeights.from_stacked(s13, torch.device("cpu"), gate_up=True)
        w2 = StackedWeights.from_stacked(s2, torch.device("cpu"), gate_up=False)
        held = [4, 1, 3]  # experts in slots 0, 1, 2 of a 3-slot pool
        table = torch.full((experts,), -1, dtype=torch.int32)
        table[held] = torch.arange(3, dtype=torch.int32)
        slots = Fp4Slots(table, mma_fp4_words(s13.fp4[held], True), mma_fp4_words(s2.fp4[held], False))
        x = torch.randn(tokens, hidden).to(torch.bfloat16)
        weights, ids = select_experts(torch.randn(tokens, experts), top_k)
        base = moe_reference(x, weights, ids, s13, s2)
        mixed = moe_reference(x, weights, ids, s13, s2, fp4_experts=table >= 0)
        assert ((mixed - base).norm() / base.norm()).item() > 0.05  # the tiers differ: the check below can tell
        for sl, ref in ((None, base), (slots, mixed)):
            ws = new_workspace(tokens * top_k, inter, hidden, x.device, configs)
            for buf in (ws.act, ws.pair_out, ws.gate_up):
                if buf is not None:
                    buf.fill_(float("nan"))
            out = fused_moe_2bit(x, weights, ids, w13, w2, slots=sl, configs=configs, workspace=ws, backend=configs[0].backend)
            err = ((out.double() - ref).norm() / ref.norm()).item()
            assert not ws.pair_out.isnan().any() and err < 1e-2, (scale_kind, tokens, sl is not None, err)
    print("gemms ok")
    """
)


def test_triton_gemms_interpreted_with_mixed_tiers():
    """The Triton kernels, run by Triton's CPU interpreter on the one layout: decode (ROUTE 0, K split) and
    prefill (ROUTE 1, both grid orders) against float64, with and without a slot table that puts 3 of 6 experts
    at FP4."""
    run_interpreted(_INTERPRETED_GEMMS, "gemms ok")


def _layer(experts: int, hidden: int, inter: int, scale_kind: str, seed: int, device: str = "cuda"):
    """Stored weights, their kernel layout and a pool holding every other expert's FP4 copy (slot table)."""
    s13 = random_stored(experts, 2 * inter, hidden, scale_kind, device, seed=seed)
    s2 = random_stored(experts, hidden, inter, scale_kind, device, seed=seed + 1)
    w13 = StackedWeights.from_stacked(s13, torch.device(device), gate_up=True)
    w2 = StackedWeights.from_stacked(s2, torch.device(device), gate_up=False)
    held = list(range(1, experts, 2))
    table = torch.full((experts,), -1, dtype=torch.int32, device=device)
    table[held] = torch.arange(len(held), dtype=torch.int32, device=device)
    mixed = Fp4Slots(table, mma_fp4_words(s13.fp4[held], True), mma_fp4_words(s2.fp4[held], False))
    every = Fp4Slots.every_expert(mma_fp4_words(s13.fp4, True), mma_fp4_words(s2.fp4, False))
    return s13, s2, w13, w2, {"base": None, "fp4": every, "mixed": mixed}


def _fp4_mask(slots: Fp4Slots | None, experts: int) -> torch.Tensor | None:
    return None if slots is None else (slots.table >= 0)


def _run_poisoned(x, weights, ids, w13, w2, slots, configs, backend: str) -> torch.Tensor:
    """fused_moe_2bit on a workspace filled with NaN: every activation and pair row it reads must have been written."""
    out, written = run_poisoned(x, weights, ids, w13, w2, slots, configs, backend)
    assert written
    return out


@needs_gpu
@pytest.mark.parametrize("scale_kind", ["nv16", "mx32"])
@pytest.mark.parametrize("tier", ["base", "fp4", "mixed"])
@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_fused_moe_matches_float64(scale_kind, tier, tokens):
    """The Triton kernels on the GPU (their decode and prefill routes) against float64, NaN-poisoned buffers."""
    from moet.kernels.moe import default_configs, fused_moe_2bit, new_workspace

    hidden, inter, experts, top_k = 512, 1024, 16, 4
    s13, s2, w13, w2, slots = _layer(experts, hidden, inter, scale_kind, seed=tokens)
    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    weights, ids = select_experts(torch.randn(tokens, experts, device="cuda"), top_k)
    configs = default_configs(tokens, hidden, inter)
    ws = new_workspace(tokens * top_k, inter, hidden, x.device, configs)
    for buf in (ws.act, ws.pair_out, ws.gate_up):
        if buf is not None:
            buf.fill_(float("nan"))
    out = fused_moe_2bit(x, weights, ids, w13, w2, slots=slots[tier], configs=configs, workspace=ws, backend=configs[0].backend)
    assert not ws.pair_out.isnan().any() and not ws.act.isnan().any()
    ref = moe_reference(x, weights, ids, s13, s2, fp4_experts=_fp4_mask(slots[tier], experts))
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2


@needs_gpu
@pytest.mark.parametrize("scale_kind", ["nv16", "mx32"])
@pytest.mark.parametrize("tier", ["base", "fp4", "mixed"])
@pytest.mark.parametrize("tokens", [65, 300, 5000])
def test_gluon_prefill_matches_float64(scale_kind, tier, tokens):
    """moet.kernels.hopper against float64 (one block, several, many), NaN-poisoned buffers, and against the
    Triton kernels; with a slot table the FP4-tier experts take the same kernel's FP4 body (a launch per tier)."""
    from moet.kernels.moe import default_configs, fused_moe_2bit
    from moet.kernels.oracle import gluon_prefill_available

    if not gluon_prefill_available(None):
        pytest.skip("the Gluon prefill kernel needs an sm_90 GPU and Triton 3.6")
    hidden, inter, experts, top_k = 512, 1024, 16, 4
    s13, s2, w13, w2, slots = _layer(experts, hidden, inter, scale_kind, seed=tokens)
    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    weights, ids = select_experts(torch.randn(tokens, experts, device="cuda"), top_k)
    configs = default_configs(tokens, hidden, inter, "gluon")
    out = _run_poisoned(x, weights, ids, w13, w2, slots[tier], configs, "gluon")
    rows = torch.arange(0, tokens, max(1, tokens // 256), device="cuda")
    ref = moe_reference(x, weights, ids, s13, s2, tokens=rows, fp4_experts=_fp4_mask(slots[tier], experts))
    assert ((out[rows].double() - ref).norm() / ref.norm()).item() < 1e-2
    triton = fused_moe_2bit(x, weights, ids, w13, w2, slots=slots[tier], backend="triton")
    assert ((out.float() - triton.float()).norm() / triton.float().norm()).item() < 1e-3


def _assert_fp8_near(out: torch.Tensor, ref: torch.Tensor, bf16: torch.Tensor) -> None:
    """The FP8 prefill's output within 1% of its float64 reference (e4m3 inputs), which the bf16 kernel's output misses
    by over three times as much: the check tells the FP8 path from the bf16 one."""
    err = ((out.double() - ref).norm() / ref.norm()).item()
    gap = ((bf16.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-2 and gap > 3 * err, (err, gap)


@needs_gpu
@pytest.mark.parametrize("scale_kind", ["nv16", "mx32"])
@pytest.mark.parametrize("tier", ["base", "mixed"])
def test_gluon_fp8_prefill_matches_float64(scale_kind, tier):
    """The FP8 form of moet.kernels.hopper (GemmConfig.fp8): the 2-bit base experts' inputs e4m3 with a scale per
    row (moet.eval.variants.fp8_rows, the scheme docs/QUALITY.md measured) and their weights exact over each row's
    power of two, against float64 with those inputs; a mixed layer's FP4-tier experts in bf16. NaN-poisoned
    buffers; the bf16 kernel is several times farther from that reference (the check can tell FP8 from bf16)."""
    from moet.eval.variants import fp8_rows
    from moet.kernels.moe import default_configs, fused_moe_2bit
    from moet.kernels.oracle import gluon_prefill_available

    if not gluon_prefill_available(None):
        pytest.skip("the Gluon prefill kernel needs an sm_90 GPU and Triton 3.6")
    hidden, inter, experts, top_k, tokens = 512, 1024, 16, 4, 300
    s13, s2, w13, w2, slots = _layer(experts, hidden, inter, scale_kind, seed=7)
    gen = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    weights, ids = select_experts(torch.randn(tokens, experts, device="cuda", generator=gen), top_k)
    configs = default_configs(tokens, hidden, inter, "gluon", fp8_prefill=True)
    out = _run_poisoned(x, weights, ids, w13, w2, slots[tier], configs, "gluon")
    fp4 = _fp4_mask(slots[tier], experts)
    at_fp4 = torch.zeros_like(ids, dtype=torch.bool) if fp4 is None else fp4[ids.long()]
    ref = moe_reference(x, weights.masked_fill(at_fp4, 0), ids, s13, s2, inputs=fp8_rows)
    if fp4 is not None:
        ref += moe_reference(x, weights.masked_fill(~at_fp4, 0), ids, s13, s2, fp4_experts=fp4)
    # the FP8 wgmma's own sum over each 128-k chunk (0.4-0.55% on the H100, 2026-12-06), then bf16 output
    _assert_fp8_near(out, ref, fused_moe_2bit(x, weights, ids, w13, w2, slots=slots[tier], backend="gluon"))


@needs_gpu
@pytest.mark.parametrize("scale_kind", ["nv16", "mx32"])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("hidden", [128, 384])
def test_gluon_prefill_takes_any_chunk_count_and_ring_depth(scale_kind, fp8, hidden):
    """The activation ring holds chunk c in its allocation c % 2 and the loop takes chunks in pairs, an odd last one
    alone: K of 1 or 3 chunks (w13) and 5 (w2) against float64 (bf16: a mixed layer; FP8: its base experts with e4m3
    inputs), and the same bits with 4 and 6 stages (1 and 3 chunks ahead)."""
    from dataclasses import replace

    from moet.eval.variants import fp8_rows
    from moet.kernels.moe import default_configs
    from moet.kernels.oracle import gluon_prefill_available

    if not gluon_prefill_available(None):
        pytest.skip("the Gluon prefill kernel needs an sm_90 GPU and Triton 3.6")
    inter, experts, top_k, tokens = 640, 16, 4, 300
    s13, s2, w13, w2, slots = _layer(experts, hidden, inter, scale_kind, seed=hidden)
    gen = torch.Generator(device="cuda").manual_seed(hidden)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    weights, ids = select_experts(torch.randn(tokens, experts, device="cuda", generator=gen), top_k)
    layer_slots = None if fp8 else slots["mixed"]
    tile = default_configs(tokens, hidden, inter, "gluon", fp8_prefill=fp8)[0]
    outs = [_run_poisoned(x, weights, ids, w13, w2, layer_slots, (replace(tile, num_stages=stages),) * 2, "gluon")
            for stages in (4, 6)]
    assert torch.equal(outs[0], outs[1])
    if fp8:
        ref = moe_reference(x, weights, ids, s13, s2, inputs=fp8_rows)
    else:
        ref = moe_reference(x, weights, ids, s13, s2, fp4_experts=_fp4_mask(layer_slots, experts))
    assert ((outs[0].double() - ref).norm() / ref.norm()).item() < 1e-2


@needs_gpu
def test_gluon_fp8_prefill_takes_each_chunk_over_its_own_power():
    """The FP8 weights are e4m3 over a power of two per row and 128-k chunk (moet.kernels.gemm.e4m3_power), not per
    row: w13's first chunk gets block scales 2^20 larger while x is 0 there, so the layer is made of chunks whose
    weights are 2^-20 of their row's largest (below e4m3's 2^-9 over a per-row power: the layer would be ~0); it
    still matches float64 with the same e4m3 inputs, and differs from the bf16 kernel as the FP8 path does."""
    from moet.eval.variants import fp8_rows
    from moet.kernels.moe import default_configs, fused_moe_2bit
    from moet.kernels.oracle import gluon_prefill_available

    if not gluon_prefill_available(None):
        pytest.skip("the Gluon prefill kernel needs an sm_90 GPU and Triton 3.6")
    hidden, inter, experts, top_k, tokens = 512, 1024, 16, 4, 300
    s13, s2, _, w2, _ = _layer(experts, hidden, inter, "mx32", seed=5)
    s13.scales[:, :, :4] += 20  # k 0-127: four UE8M0 blocks of 32
    w13 = StackedWeights.from_stacked(s13, torch.device("cuda"), gate_up=True)
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    x[:, :128] = 0
    weights, ids = select_experts(torch.randn(tokens, experts, device="cuda", generator=gen), top_k)
    out = fused_moe_2bit(x, weights, ids, w13, w2, configs=default_configs(tokens, hidden, inter, "gluon", fp8_prefill=True),
                         backend="gluon")
    ref = moe_reference(x, weights, ids, s13, s2, inputs=fp8_rows)
    _assert_fp8_near(out, ref, fused_moe_2bit(x, weights, ids, w13, w2, backend="gluon"))


@needs_gpu
def test_apply_moe_takes_the_fp8_prefill_from_its_layer():
    """VLLM_MOE_W2_PREFILL_FP8 reaches the kernels: the plugin's forward (moet.vllm.moe_op.apply_moe) over a layer
    with moet_prefill_fp8 gives fused_moe_2bit's FP8 output bit for bit at a prefill the Gluon kernel serves, and
    without it the bf16 one (which differs)."""
    from types import SimpleNamespace

    from moet.kernels.moe import fused_moe_2bit
    from moet.kernels.oracle import GLUON_PAST_TOKENS, gluon_prefill_available
    from moet.vllm.moe_op import apply_moe

    if not gluon_prefill_available(None):
        pytest.skip("the Gluon prefill kernel needs an sm_90 GPU and Triton 3.6")
    hidden, inter, experts, top_k, tokens = 512, 1024, 16, 4, GLUON_PAST_TOKENS + 100
    _, _, w13, w2, _ = _layer(experts, hidden, inter, "mx32", seed=11)
    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    weights, ids = select_experts(torch.randn(tokens, experts, device="cuda"), top_k)
    outs = []
    for fp8 in (False, True):
        layer = SimpleNamespace(expert_map=None, moet_cache=None, moet_fp4=None, moet_ordinal=0, moet_w13=w13,
                                moet_w2=w2, activation=SimpleNamespace(value="silu"), moet_prefill_fp8=fp8)
        outs.append(apply_moe(layer, x, weights, ids))
        assert torch.equal(outs[-1], fused_moe_2bit(x, weights, ids, w13, w2, backend="gluon", fp8_prefill=fp8))
    assert not torch.equal(outs[0], outs[1])


needs_cubin = pytest.mark.skipif(
    not torch.cuda.is_available() or not __import__("moet.kernels.cuda", fromlist=["available"]).available(),
    reason="the CUDA decode kernels need a CUDA device and their cubin (python scripts/build_kernels.py)",
)


@needs_cubin
@pytest.mark.parametrize("tokens,experts,top_k,block,hot", [
    (65, 256, 6, 8, 0), (300, 8, 3, 8, 1), (2048, 384, 8, 8, 0), (700, 384, 8, 8, 1), (100, 1000, 4, 64, 0),
])
def test_pass_grid_sorts_like_align(tokens, experts, top_k, block, hot):
    """moe_pass_grid gives align's blocks, experts and padded length, and inside each expert's run the same pairs
    (the kernel may place them in another order); `hot`: every token names expert 5 (a run of `tokens` pairs)."""
    from moet.kernels.cuda import pass_grid

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    logits = torch.randn(tokens, experts, device="cuda", generator=gen)
    logits[:, 5] += 100.0 * hot
    ids = logits.topk(top_k, dim=-1).indices.to(torch.int32)
    sorted_ids, block_expert, n_padded = pass_grid(ids, experts, block)
    ref_ids, ref_expert, ref_padded = align(ids, experts, block)
    assert torch.equal(n_padded, ref_padded) and torch.equal(block_expert, ref_expert)
    assert sorted_ids.shape == ref_ids.shape
    runs = torch.cat([torch.tensor([0]), torch.nonzero(ref_expert[1:] != ref_expert[:-1]).cpu().flatten() + 1]) * block
    for start, end in zip(runs.tolist(), runs[1:].tolist() + [sorted_ids.numel()]):
        assert torch.equal(sorted_ids[start:end].sort().values, ref_ids[start:end]), (start, end)


@needs_cubin
@pytest.mark.parametrize("top_k", [1, 6, 20])
def test_cuda_combine_sums_every_slot_in_slot_order(top_k):
    """moe_combine_bf16 gives each token's f32 pair rows summed in slot order and rounded to bf16 once, bit for bit,
    at H not a multiple of its 512-column blocks; a column of -0 in every slot sums to -0 (the kernel's sum starts
    from -0, the identity of f32 addition), one with a +0 among them to +0."""
    from moet.kernels.cuda import combine_pairs

    tokens, hidden = 3, 1000
    pair_out = torch.randn(tokens * top_k, hidden, device="cuda", generator=torch.Generator(device="cuda").manual_seed(top_k))
    rows = pair_out.view(tokens, top_k, hidden)
    rows[:, :, :2] = -0.0
    rows[:, 0, 1] = 0.0
    expected = rows[:, 0]
    for slot in range(1, top_k):
        expected = expected + rows[:, slot]
    got = combine_pairs(pair_out, tokens, top_k)
    assert got[:, 0].view(torch.int16).eq(-0x8000).all() and got[:, 1].view(torch.int16).eq(0).all()
    assert torch.equal(got.view(torch.int16), expected.to(torch.bfloat16).view(torch.int16))


@needs_cubin
@pytest.mark.parametrize("scale_kind", ["nv16", "mx32"])
@pytest.mark.parametrize("tier", ["base", "fp4", "mixed"])
@pytest.mark.parametrize("tokens", [1, 5, 13, 64])
def test_cuda_decode_matches_float64(scale_kind, tier, tokens):
    """moet/kernels/src/moe_decode.cu against the float64 MoE; K = 640 is 5 chunks (not a multiple of the ring);
    1-13 tokens in the pair grid, 64 over 8 experts (up to 64 on one, several passes) in the pass grid; NaN-poisoned
    buffers."""
    from moet.kernels.moe import default_configs, fused_moe_2bit

    hidden, inter, experts, top_k = 640, 384, 8, 3
    s13, s2, w13, w2, slots = _layer(experts, hidden, inter, scale_kind, seed=tokens)
    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    weights, ids = select_experts(torch.randn(tokens, experts, device="cuda"), top_k)
    configs = default_configs(tokens, hidden, inter, "cuda")
    assert configs[0].backend == "cuda"
    out = _run_poisoned(x, weights, ids, w13, w2, slots[tier], configs, configs[0].backend)
    ref = moe_reference(x, weights, ids, s13, s2, fp4_experts=_fp4_mask(slots[tier], experts))
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
    triton = fused_moe_2bit(x, weights, ids, w13, w2, slots=slots[tier], configs=default_configs(tokens, hidden, inter), backend="triton")
    assert ((out.double() - triton.double()).norm() / ref.norm()).item() < 1e-2


@needs_cubin
@pytest.mark.parametrize("scale_kind", ["nv16", "mx32"])
@pytest.mark.parametrize("tier", ["base", "fp4", "mixed"])
def test_cuda_kernels_serve_many_tokens_per_expert(scale_kind, tier):
    """Past 64 tokens the CUDA kernels run one block per pass (8 pairs of one expert, moe_pass_grid): 300 tokens that
    all name expert 5 (38 passes side by side) and two more experts each, against float64 and the Triton kernels;
    NaN-poisoned buffers."""
    from moet.kernels.moe import default_configs, fused_moe_2bit

    hidden, inter, experts, top_k, tokens = 640, 384, 8, 3, 300
    s13, s2, w13, w2, slots = _layer(experts, hidden, inter, scale_kind, seed=30)
    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    logits = torch.randn(tokens, experts, device="cuda")
    logits[:, 5] += 100.0
    weights, ids = select_experts(logits, top_k)
    assert int((ids == 5).sum()) == tokens
    configs = default_configs(tokens, hidden, inter, "cuda")
    assert configs[0].backend == "cuda"
    out = _run_poisoned(x, weights, ids, w13, w2, slots[tier], configs, "cuda")
    ref = moe_reference(x, weights, ids, s13, s2, fp4_experts=_fp4_mask(slots[tier], experts))
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
    triton = fused_moe_2bit(x, weights, ids, w13, w2, slots=slots[tier], backend="triton")
    assert ((out.double() - triton.double()).norm() / ref.norm()).item() < 1e-2


@needs_cubin
@pytest.mark.parametrize("tier", ["base", "mixed"])
@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("tokens", [4, 80])
def test_cuda_decode_serves_an_expert_named_in_many_slots(tier, staged, tokens):
    """One expert in most slots of every token, as cache misses mapped to one zero-weight filler are. 4 tokens: a
    decode step whose pairs fit one gather round (T·k ≤ 32; with staged activations each block's first chunks are
    loaded before it gathers its pairs), 27 of the 32 pairs on expert 3, four passes of one n-tile, the later ones
    refilling the ring; the blocks of the other 26 pairs naming it exit. 80 tokens: the pass grid, 80 passes of
    expert 3, whose 8 pairs come from one token (the staged rows hold the same activations 8 times). Against float64;
    NaN-poisoned buffers."""
    from moet.kernels.cuda import STAGED_TUNING
    from moet.kernels.moe import cuda_config, default_configs

    hidden, inter, experts, top_k = 640, 384, 8, 8
    s13, s2, w13, w2, slots = _layer(experts, hidden, inter, "mx32", seed=40)
    gen = torch.Generator(device="cuda").manual_seed(40)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    ids = torch.full((tokens, top_k), 3, dtype=torch.int32, device="cuda")
    ids[:, 0] = torch.tensor([0, 1, 2, 1], dtype=torch.int32).repeat(tokens // 4)
    ids[0, 1] = 5
    weights = torch.rand(tokens, top_k, device="cuda", generator=gen)
    assert int((ids == 3).sum()) == 7 * tokens - 1
    configs = (cuda_config(STAGED_TUNING),) * 2 if staged else default_configs(tokens, hidden, inter, "cuda")
    out = _run_poisoned(x, weights, ids, w13, w2, slots[tier], configs, "cuda")
    ref = moe_reference(x, weights, ids, s13, s2, fp4_experts=_fp4_mask(slots[tier], experts))
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2


@needs_gpu
@pytest.mark.parametrize("backend,tokens", [("triton", 3), ("cuda", 3), ("cuda", 100), ("gluon", 100)])
def test_fused_moe_graph_capturable_and_deterministic(backend, tokens):
    """Every kernel family with a slot table (the CUDA kernels in both grids; the Gluon kernel serves prefill only):
    graph replay == eager == a rerun, bit for bit (the pass grid places an expert's pairs by atomics, in any order);
    a table rewritten in place between replays (what commit() does) is what the next replay reads."""
    from moet.kernels import cuda
    from moet.kernels.moe import default_configs, fused_moe_2bit
    from moet.kernels.oracle import gluon_prefill_available

    if backend == "cuda" and not cuda.available():
        pytest.skip("the CUDA decode kernels need their cubin (python scripts/build_kernels.py)")
    if backend == "gluon" and not gluon_prefill_available(None):
        pytest.skip("the Gluon prefill kernel needs an sm_90 GPU and Triton 3.6")
    hidden, inter, experts, top_k = 512, 1024, 8, 2
    s13, s2, w13, w2, slots = _layer(experts, hidden, inter, "mx32", seed=1)
    mixed = slots["mixed"]
    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    weights, ids = select_experts(torch.randn(tokens, experts, device="cuda"), top_k)
    configs = default_configs(tokens, hidden, inter, backend)
    eager = fused_moe_2bit(x, weights, ids, w13, w2, slots=mixed, configs=configs, backend=backend)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused_moe_2bit(x, weights, ids, w13, w2, slots=mixed, configs=configs, backend=backend)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(eager, captured)
    assert torch.equal(eager, fused_moe_2bit(x, weights, ids, w13, w2, slots=mixed, configs=configs, backend=backend))
    saved = mixed.table.clone()
    mixed.table.fill_(-1)
    graph.replay()
    assert torch.equal(captured, fused_moe_2bit(x, weights, ids, w13, w2, configs=configs, backend=backend))
    mixed.table.copy_(saved)


@needs_cubin
@pytest.mark.parametrize("tier", ["base", "fp4", "mixed"])
def test_cuda_decode_every_tuning_matches_float64(tier):
    from moet.kernels.cuda import TUNINGS, streamed
    from moet.kernels.moe import cuda_config, fused_moe_2bit

    hidden, inter, experts, top_k = 640, 384, 8, 3  # K = 5 chunks: uneven K slices
    s13, s2, w13, w2, slots = _layer(experts, hidden, inter, "mx32", seed=21)
    for tokens in (4, 40):  # the pair grid; the pass grid, where experts with > 8 tokens take several passes
        x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
        weights, ids = select_experts(torch.randn(tokens, experts, device="cuda"), top_k)
        ref = moe_reference(x, weights, ids, s13, s2, fp4_experts=_fp4_mask(slots[tier], experts))
        for tuning in (t for t in TUNINGS if streamed(t) is None):  # streamed ones: their own test (K / 128 = 5)
            out = fused_moe_2bit(x, weights, ids, w13, w2, slots=slots[tier], configs=(cuda_config(tuning),) * 2, backend="cuda")
            assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2, (tokens, tuning)


@needs_gpu
def test_prefill_tile_follows_the_drivers_block_shared_memory():
    """The shared memory a block may take comes from the driver: 227 KiB on sm_90 (H100, H200), where the Triton
    prefill takes its 128-pair tile past PREFILL_WIDE_FROM tokens (elsewhere the tile that figure allows)."""
    from moet.kernels.moe import (PREFILL_WIDE_FROM, PREFILL_WIDE_SHARED, SM90_BLOCK_SHARED, block_shared_memory,
                                  default_configs)

    shared = block_shared_memory(torch.device("cuda"))
    if torch.cuda.get_device_capability() == (9, 0):
        assert shared == SM90_BLOCK_SHARED
    wide = default_configs(PREFILL_WIDE_FROM + 1, 4096, 2048, block_shared=shared)[0].bm
    assert wide == (128 if shared >= PREFILL_WIDE_SHARED else 64), shared


@needs_cubin
def test_cuda_occupancy_holds_the_blocks_the_picks_count_on():
    """The driver's occupancy answer for the built cubin: six blocks of the wide pick an SM with WIDE_STAGED_BYTES of
    staged rows (stage_tuning's one-wave test assumes six), and four of the streamed pick with DeepSeek-V4-Flash's w2
    rows at T = 4 (16,448 B; the grids of its H100 measurements); four with the most staged rows the staged pick
    takes (STAGED_PICK_BYTES) would pass the SM's shared memory, so fewer. On sm_90 (227 KiB a block) each staging
    entry point may ask STAGED_SHARED_LIMIT, as the driver reads back."""
    from moet.kernels import cuda

    device = torch.cuda.current_device()
    for block in (16, 32):
        for stage in (13, 2):
            wide = cuda.kernel_name(block, stage, cuda.WIDE_TUNING)
            assert cuda.resident_blocks(device, wide, cuda.WIDE_STAGED_BYTES) >= cuda.WIDE_BLOCKS_PER_SM, wide
            assert cuda.staged_shared_limit(device, wide) == cuda.STAGED_SHARED_LIMIT, wide
            streamed = cuda.kernel_name(block, stage, cuda.STREAMED_TUNING)
            assert cuda.staged_shared_limit(device, streamed) == cuda.STAGED_SHARED_LIMIT, streamed
            assert cuda.resident_blocks(device, streamed, cuda.staged_bytes(4, 2048)) == 4, streamed
            assert 1 <= cuda.resident_blocks(device, streamed, cuda.STAGED_PICK_BYTES) < 4, streamed


@needs_cubin
@pytest.mark.parametrize("tier", ["base", "fp4", "mixed"])
def test_cuda_decode_capped_passes_match_the_uncapped_bit_for_bit(tier):
    """A staged pass capped at N activation rows ("_c<N>", a launch argument) serves an expert's tokens N at a time,
    each pass reading its rows again; every token's products are added in the same order, so the bits are those of
    the uncapped tuning, and float64's answer within 1%. Every token names experts 0 and 1: six tokens in the pair grid
    (two passes each at N = 3, six at N = 1), 40 in the pass grid (8-pair passes cut in 3, 3 and 2 at N = 3)."""
    from moet.kernels.cuda import TUNINGS, stages_activations
    from moet.kernels.moe import cuda_config, fused_moe_2bit

    hidden, inter, experts, top_k = 1024, 1024, 8, 3
    s13, s2, w13, w2, slots = _layer(experts, hidden, inter, "mx32", seed=29)
    tunings = [t for t in TUNINGS if stages_activations(t)]
    assert tunings
    for tokens in (6, 40):
        x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
        logits = torch.randn(tokens, experts, device="cuda")
        logits[:, :2] += 10  # every token names experts 0 and 1: several capped passes each
        weights, ids = select_experts(logits, top_k)
        ref = moe_reference(x, weights, ids, s13, s2, fp4_experts=_fp4_mask(slots[tier], experts))
        run = lambda t: fused_moe_2bit(x, weights, ids, w13, w2, slots=slots[tier], configs=(cuda_config(t),) * 2,  # noqa: E731
                                       backend="cuda")
        for tuning in tunings:
            uncapped = run(tuning)
            for cap in (1, 3):
                out = run(f"{tuning}_c{cap}")
                assert torch.equal(out, uncapped), (tokens, tuning, cap)
                assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2, (tokens, tuning, cap)


@needs_cubin
@pytest.mark.parametrize("tier", ["base", "fp4", "mixed"])
def test_cuda_decode_streamed_row_blocks_match_their_twin_bit_for_bit(tier):
    """A streamed tuning ("_s": each warp runs several row blocks one after another, its ring running on across them)
    adds every row's products in the order of its twin without "_s": the same bits, and float64's answer within 1%,
    at the host's row count and at 3 rows a warp (the last block's warps then hold 3, 1 and none of w2's 64 row blocks,
    64 = 5 × 12 + 4). K = 1,024 in both stages (8 chunks, a multiple of either ring); 1 and 4 tokens in the pair grid,
    40 in the pass grid."""
    from moet.kernels.cuda import TUNINGS, streamed
    from moet.kernels.moe import cuda_config, fused_moe_2bit

    hidden, inter, experts, top_k = 1024, 1024, 8, 3
    s13, s2, w13, w2, slots = _layer(experts, hidden, inter, "mx32", seed=23)
    tunings = [t for t in TUNINGS if streamed(t) is not None]
    assert tunings
    for tokens in (1, 4, 40):
        x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
        weights, ids = select_experts(torch.randn(tokens, experts, device="cuda"), top_k)
        ref = moe_reference(x, weights, ids, s13, s2, fp4_experts=_fp4_mask(slots[tier], experts))
        run = lambda t: fused_moe_2bit(x, weights, ids, w13, w2, slots=slots[tier], configs=(cuda_config(t),) * 2,  # noqa: E731
                                       backend="cuda")
        for tuning in tunings:
            twin = run(tuning[: -len("_s")])
            for count in ("", "3"):
                out = run(tuning + count)
                assert torch.equal(out, twin), (tokens, tuning, count)
                assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2, (tokens, tuning, count)
