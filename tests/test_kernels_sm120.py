"""The sm_120a block-scaled MoE path on CPU: its operands against hand-written bits and float64, the kernel's
bit operations in torch on the GPU layout, and the Triton kernels under TRITON_INTERPRET against float64.

No sm_120 GPU exists in this project: moet.kernels.blackwell has been built (tests/test_kernels_build.py
reads its SASS) but never run on a GPU.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from moet.kernels.layout import mma_base_words, mma_fp4_words, mma_scales
from moet.kernels.mx import (
    E2M1_SHIFT,
    block_scaled_matmul,
    e2m1_from_codes,
    e4m3_from_e2m1,
    layout_operand,
    layout_scales,
    mx_values,
    quantize_activations,
    weight_operand,
)
from moet.testing.random_stacked import random_stored
from moet.quant.codebook import FP4_VALUES, Tier, pack_codes, unpack_nibbles
from moet.quant.scales import E4M3_VALUES, SCALE_BLOCK, scale_values
from tests.interpreted import run_interpreted


def test_codes_become_e2m1_and_e4m3_bit_patterns():
    """Codes 0..3 (−4, −1, +1, +4) → e2m1 0xE, 0xA, 0x2, 0x6 (low nibble = even k) → e4m3 value × 2^-6."""
    codes = pack_codes(torch.tensor([[0, 1, 2, 3, 3, 2, 1, 0]], dtype=torch.uint8))
    assert codes.tolist() == [[0b11100100, 0b00011011]]
    nibbles = e2m1_from_codes(codes)
    assert nibbles.tolist() == [[0xAE, 0x62, 0x26, 0xEA]]
    assert e4m3_from_e2m1(nibbles).tolist() == [[0x98, 0x88, 0x08, 0x18, 0x18, 0x08, 0x88, 0x98]]
    every = torch.tensor([[lo | (lo + 1) << 4 for lo in range(0, 16, 2)]], dtype=torch.uint8)  # nibbles 0..15
    e4m3 = e4m3_from_e2m1(every)
    assert e4m3.tolist() == [[0x00, 0x04, 0x08, 0x0C, 0x10, 0x14, 0x18, 0x1C, 0x80, 0x84, 0x88, 0x8C, 0x90, 0x94, 0x98, 0x9C]]
    assert torch.equal(E4M3_VALUES[e4m3.long()][0] * 2.0**E2M1_SHIFT, FP4_VALUES)  # −0 included (0x80)


@pytest.mark.parametrize("scale_kind", ["mx32", "nv16"])
@pytest.mark.parametrize("tier", [Tier.NONE, Tier.PLANES])
def test_e2m1_blocks_times_stored_scales_are_the_stored_weights(scale_kind, tier):
    """A base block is an MXFP4 (UE8M0/32) or NVFP4 (e4m3/16) block: its e2m1 nibbles × the stored scales ×
    the row scale are the stored weights, exactly in float64; the FP4 tier's planes too."""
    stored = random_stored(3, 32, 256, scale_kind, seed=2, refine=False)
    nibbles = e2m1_from_codes(stored.codes) if tier == Tier.NONE else stored.fp4
    block = scale_values(stored.scales, scale_kind).repeat_interleave(SCALE_BLOCK[scale_kind], dim=-1)
    values = FP4_VALUES[unpack_nibbles(nibbles).long()] * block * stored.row_scale.double().unsqueeze(-1)
    assert torch.equal(values, torch.stack([stored.dequantize(e, tier) for e in range(3)]))


@pytest.mark.parametrize("tier", [Tier.NONE, Tier.PLANES])
def test_weight_operand_reproduces_the_stored_weights(tier):
    """The kernel's e4m3 operand × its UE8M0 scale × 2^6 × the row scale is the stored weight, exactly."""
    stored = random_stored(3, 32, 256, "mx32", seed=3, refine=False)
    data, scales = weight_operand(stored, tier)
    assert data.shape == (3, 32, 256) and torch.equal(scales, stored.scales)
    values = mx_values(data, scales) * 2.0**E2M1_SHIFT * stored.row_scale.double().unsqueeze(-1)
    assert torch.equal(values, torch.stack([stored.dequantize(e, tier) for e in range(3)]))


def test_weight_operand_refuses_e4m3_scales():
    """NVFP4's e4m3/16 scales have no e4m3 × e4m3 block-scaled MMA (only kind::mxf4nvf4, e2m1 on both sides)."""
    with pytest.raises(ValueError, match="mx32"):
        weight_operand(random_stored(1, 16, 128, "nv16", seed=4, refine=False), Tier.NONE)


@pytest.mark.parametrize("scale_kind", ["mx32", "nv16"])
@pytest.mark.parametrize("gate_up", [False, True])
def test_kernel_bit_operations_on_the_layout_give_the_operand(scale_kind, gate_up):
    """moet.kernels.blackwell's register decode (rotate, shift, mask per 16-bit half; FP4 field and sign shifts),
    run in torch on the one GPU layout, is the e4m3 operand of the stored codes and planes, bit for bit; the
    scale bytes it loads per lane are the stored UE8M0 scales."""
    stored = random_stored(2, 64, 256, scale_kind, seed=5, refine=False)
    base = e4m3_from_e2m1(e2m1_from_codes(stored.codes))
    assert torch.equal(layout_operand(mma_base_words(stored.codes, gate_up), gate_up), base)
    assert torch.equal(layout_operand(mma_fp4_words(stored.fp4, gate_up), gate_up), e4m3_from_e2m1(stored.fp4))
    if scale_kind == "mx32":
        assert torch.equal(layout_scales(mma_scales(stored.scales, "mx32", gate_up), gate_up), stored.scales)


def test_quantize_activations_bit_patterns():
    """Per 32 k: the smallest 2^e with amax / 2^e ≤ 448, round to nearest even e4m3; a second term quantizes
    the residual with its own scale."""
    x = torch.zeros(1, 64)
    x[0, :4] = torch.tensor([448.0, 125.0, -17.0, 0.5])  # block 0: amax 448 → 2^0
    x[0, 32:34] = torch.tensor([449.0, 3.0])  # block 1: amax > 448 → 2^1
    q, s = quantize_activations(x, terms=2)
    assert q.shape == (2, 1, 64) and s.shape == (2, 1, 2)
    assert s[0].tolist() == [[127, 128]]
    # 448 = 0x7E; 125 → 128 = 0x70; −17 → −16 (tie to even) = 0xD8; 0.5 = 0x30; 449/2 → 224 = 0x76; 3/2 = 0x3C
    assert q[0, 0, :4].tolist() == [0x7E, 0x70, 0xD8, 0x30] and q[0, 0, 32:34].tolist() == [0x76, 0x3C]
    hi = mx_values(q[0], s[0])
    assert hi[0, :4].tolist() == [448.0, 128.0, -16.0, 0.5] and hi[0, 32:34].tolist() == [448.0, 3.0]
    both = hi + mx_values(q[1], s[1])
    assert both[0, :4].tolist() == [448.0, 125.0, -17.0, 0.5] and both[0, 32:34].tolist() == [449.0, 3.0]


@pytest.mark.parametrize("terms,bound", [(1, 2.0**-4), (2, 2.0**-8)])
def test_quantize_activations_error_bound(terms, bound):
    """Each element within `bound` of itself (relative) plus a tiny fraction of its block's amax (subnormals)."""
    x = (torch.randn(16, 256) * torch.logspace(-3, 3, 16).unsqueeze(-1)).to(torch.bfloat16).double()
    q, s = quantize_activations(x, terms)
    got = sum(mx_values(qt, st) for qt, st in zip(q, s))
    amax = x.abs().unflatten(-1, (-1, 32)).amax(-1).repeat_interleave(32, dim=-1)
    assert ((got - x).abs() <= bound * x.abs() + 2.0**-16 * amax).all()


def test_block_scaled_matmul_applies_each_scale_to_its_block():
    """The emulated product is Σ over 32-k blocks of 2^(sa + sb − 254) · (e4m3 dot product of the block),
    which is how the MMA applies its two scale operands."""
    gen = torch.Generator().manual_seed(6)
    a = torch.randint(0, 0x7F, (8, 128), generator=gen, dtype=torch.uint8)  # finite e4m3 (no 0x7F / 0xFF)
    b = torch.randint(0x80, 0xFF, (4, 128), generator=gen, dtype=torch.uint8)
    sa = torch.randint(110, 140, (8, 4), generator=gen, dtype=torch.uint8)
    sb = torch.randint(110, 140, (4, 4), generator=gen, dtype=torch.uint8)
    va, vb = E4M3_VALUES[a.long()].view(8, 4, 32), E4M3_VALUES[b.long()].view(4, 4, 32)
    per_block = torch.einsum("mjk,njk->mnj", va, vb) * 2.0 ** (sa.double().unsqueeze(1) + sb.double().unsqueeze(0) - 254)
    torch.testing.assert_close(block_scaled_matmul(a, sa, b, sb), per_block.sum(-1), rtol=1e-12, atol=0)  # sum order


_INTERPRETED = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from moet.kernels.blackwell import DECODE_CONFIG, PREFILL_CONFIG, fused_moe_mx, new_mx_workspace
    from moet.kernels.glue import select_experts
    from moet.kernels.layout import Fp4Slots, StackedWeights, mma_fp4_words
    from moet.kernels.mx import mx_linear, mx_moe_reference, weight_operand
    from moet.quant.codebook import Tier
    from moet.testing.reference import moe_reference
    from moet.testing.random_stacked import random_stored

    torch.manual_seed(0)
    hidden, inter, experts, top_k = 256, 128, 6, 2
    s13 = random_stored(experts, 2 * inter, hidden, "mx32", seed=1, refine=False)
    s2 = random_stored(experts, hidden, inter, "mx32", seed=2, refine=False)
    w13 = StackedWeights.from_stacked(s13, torch.device("cpu"), gate_up=True)
    w2 = StackedWeights.from_stacked(s2, torch.device("cpu"), gate_up=False)
    held = [4, 1, 3]  # experts in slots 0, 1, 2 of a 3-slot pool
    table = torch.full((experts,), -1, dtype=torch.int32)
    table[held] = torch.arange(3, dtype=torch.int32)
    slots = Fp4Slots(table, mma_fp4_words(s13.fp4[held], True), mma_fp4_words(s2.fp4[held], False))
    fp4 = table >= 0
    ops = {tier: (weight_operand(s13, tier), weight_operand(s2, tier)) for tier in (Tier.NONE, Tier.PLANES)}
    for tokens, terms, config in ((3, 2, DECODE_CONFIG), (40, 1, PREFILL_CONFIG)):
        x = torch.randn(tokens, hidden).to(torch.bfloat16)
        weights, ids = select_experts(torch.randn(tokens, experts), top_k)
        ws = new_mx_workspace(tokens, tokens * top_k, inter, hidden, terms, x.device)
        ws.act.fill_(float("nan"))
        ws.pair_out.fill_(float("nan"))
        out = fused_moe_mx(x, weights, ids, w13, w2, slots=slots, terms=terms, config=config, workspace=ws)
        assert not ws.act.isnan().any() and not ws.pair_out.isnan().any()
        # each projection against its float64 emulation, pair by pair; the second one fed the kernel's own
        # bf16 activations (the interpreter truncates f32 -> bf16 where the GPU rounds to nearest: <= 1 ulp)
        for p, (t, j) in enumerate((t, j) for t in range(tokens) for j in range(top_k)):
            e = int(ids[t, j])
            (a13, c13), (a2, c2) = ops[Tier.PLANES if fp4[e] else Tier.NONE]
            gate, up = mx_linear(x[t : t + 1], a13[e], c13[e], s13.row_scale[e], terms).chunk(2, dim=-1)
            h = (F.silu(gate) * up)[0]
            assert ((ws.act[p].double() - h).abs() <= 2.0**-7 * h.abs() + 1e-30).all(), (tokens, p)
            y = mx_linear(ws.act[p : p + 1], a2[e], c2[e], s2.row_scale[e], terms)[0] * weights[t, j].double()
            assert ((ws.pair_out[0, p].double() - y).norm() / y.norm()).item() < 1e-5, (tokens, p)
        emulated = mx_moe_reference(x, weights, ids, s13, s2, terms, fp4)
        exact = moe_reference(x, weights, ids, s13, s2, fp4_experts=fp4)
        err = ((out.double() - emulated).norm() / emulated.norm()).item()
        err64 = ((out.double() - exact).norm() / exact.norm()).item()
        emu64 = ((emulated - exact).norm() / exact.norm()).item()
        # the layer drifts from the emulation more than its projections do: the interpreter's truncated bf16
        # activations flip some e4m3 roundings of the second projection's input (~1 in 16 with one term)
        assert err < (1e-2 if terms == 2 else 4e-2) and err64 < (1e-2 if terms == 2 else 8e-2), (tokens, terms, err, err64)
        print(f"T={tokens} terms={terms}: kernel vs emulation {err:.2e}, vs float64 {err64:.2e}, emulation vs float64 {emu64:.2e}")
    print("mx ok")
    """
)


def test_block_scaled_kernels_interpreted_against_float64():
    """moet.kernels.blackwell under Triton's interpreter (it runs tl.dot_scaled), mixed tiers (3 of 6 experts at
    FP4): both projections pair by pair against their float64 emulation, and the layer against the
    emulation and against the float64 MoE of moet.testing.reference (decode tile with two activation terms,
    prefill tile with one); NaN-poisoned buffers. Never run on a GPU."""
    print(run_interpreted(_INTERPRETED, "mx ok", timeout=900))
