"""FP4 nibbles → 2-bit base and FP4 tier, against hand-written bit patterns and float64 math."""

from __future__ import annotations

import math

import pytest
import torch

from moet.quant.codebook import (
    base_codes,
    base_from_fp4,
    dequantize_base,
    dequantize_fp4,
    nibbles_from_refinement,
    pack_codes,
    pack_nibbles,
    pack_refinement,
    refinement_from_fp4,
    unpack_codes,
    unpack_nibbles,
    zero_sign_stats,
)
from moet.quant.scales import E4M3_VALUES, UE8M0_VALUES

# nibble → (value, base code under the sign policy, refinement digit), written out by hand.
NIBBLES = {
    0x0: (0.0, 2, 0),
    0x1: (0.5, 2, 1),
    0x2: (1.0, 2, 2),
    0x3: (1.5, 2, 3),
    0x4: (2.0, 2, 4),
    0x5: (3.0, 3, 0),
    0x6: (4.0, 3, 1),
    0x7: (6.0, 3, 2),
    0x8: (-0.0, 1, 0),
    0x9: (-0.5, 1, 1),
    0xA: (-1.0, 1, 2),
    0xB: (-1.5, 1, 3),
    0xC: (-2.0, 1, 4),
    0xD: (-3.0, 0, 0),
    0xE: (-4.0, 0, 1),
    0xF: (-6.0, 0, 2),
}
CODE_VALUE = {0: -4.0, 1: -1.0, 2: 1.0, 3: 4.0}


def _all_nibbles(rows: int = 2) -> torch.Tensor:
    """uint8 [rows, 32]: every nibble twice per row, in a different order per row."""
    base = torch.arange(16, dtype=torch.uint8).repeat(2)
    return torch.stack([base.roll(r) for r in range(rows)])


def test_nibble_unpacking_low_nibble_is_even_k() -> None:
    packed = torch.tensor([[0x9A, 0x70]], dtype=torch.uint8)
    assert unpack_nibbles(packed).tolist() == [[0xA, 0x9, 0x0, 0x7]]
    assert pack_nibbles(torch.tensor([[0xA, 0x9, 0x0, 0x7]], dtype=torch.uint8)).tolist() == [[0x9A, 0x70]]


def test_every_nibble_base_code_and_value() -> None:
    nibbles = torch.arange(16, dtype=torch.uint8).repeat(2).reshape(1, 32)
    qw = base_from_fp4(pack_nibbles(nibbles), torch.full((1, 1), 127, dtype=torch.uint8), "mx32", torch.ones(1), zero_policy=("sign", 0))
    codes = unpack_codes(qw.codes)[0].tolist()
    assert codes == [NIBBLES[n][1] for n in range(16)] * 2
    assert dequantize_base(qw)[0].tolist() == [CODE_VALUE[NIBBLES[n][1]] for n in range(16)] * 2


def test_code_packing_hand_bytes() -> None:
    # codes of k=0..3 at bits 0-1, 2-3, 4-5, 6-7: [2, 3, 1, 0] → 0b00_01_11_10 = 0x1E
    packed = pack_codes(torch.tensor([[2, 3, 1, 0, 0, 0, 0, 3]], dtype=torch.uint8))
    assert packed.tolist() == [[0x1E, 0xC0]]


def test_refinement_digits_and_hand_packed_bytes() -> None:
    nibbles = torch.arange(16, dtype=torch.uint8).reshape(1, 16)
    qw = base_from_fp4(pack_nibbles(nibbles), torch.full((1, 1), 0x38, dtype=torch.uint8), "nv16", torch.ones(1), tier="refine", zero_policy=("sign", 0))
    digits = [NIBBLES[n][2] for n in range(16)]
    # group j = digits 4j..4j+3 as d0 + 5 d1 + 25 d2 + 125 d3, at bits 10j of a little-endian 40-bit word
    word = 0
    for j in range(4):
        d = digits[4 * j : 4 * j + 4]
        word |= (d[0] + 5 * d[1] + 25 * d[2] + 125 * d[3]) << (10 * j)
    assert qw.refine[0].tolist() == list(word.to_bytes(5, "little"))


def test_refinement_packing_explicit_bytes() -> None:
    digits = torch.zeros(1, 16, dtype=torch.int64)
    digits[0, 0] = 1  # group 0 = 1 → byte 0 = 0x01
    digits[0, 5] = 1  # group 1 = 5 → 5 << 10 = 0x1400
    digits[0, 12:16] = 4  # group 3 = 624 = 0x270 → << 30 = 0x9C_0000_0000
    assert pack_refinement(digits).tolist() == [[0x01, 0x14, 0x00, 0x00, 0x9C]]


def test_zero_policy_threshold() -> None:
    # 20 zeros: 19 × +0 and 1 × −0 is a 95% share → parity; 18/2 is 90% → sign.
    parity = torch.tensor([0] * 19 + [8] + [1] * 12, dtype=torch.uint8)
    assert zero_sign_stats(parity) == ("parity", 0)
    sign = torch.tensor([0] * 18 + [8] * 2 + [1] * 12, dtype=torch.uint8)
    assert zero_sign_stats(sign) == ("sign", 0)
    assert zero_sign_stats(torch.tensor([8] * 20 + [0], dtype=torch.uint8)) == ("parity", 1)
    assert zero_sign_stats(torch.tensor([1, 2, 3], dtype=torch.uint8)) == ("sign", 0)


def test_parity_policy_alternates_zero_signs_by_k() -> None:
    nibbles = torch.tensor([[0, 0, 0, 0, 8, 8, 5, 13] * 4], dtype=torch.uint8)
    qw = base_from_fp4(pack_nibbles(nibbles), torch.full((1, 1), 127, dtype=torch.uint8), "mx32", torch.ones(1), zero_policy=("parity", 0))
    # zeros (±0) at even k → +1 (code 2), odd k → −1 (code 1); non-zeros keep their sign
    assert unpack_codes(qw.codes)[0, :8].tolist() == [2, 1, 2, 1, 2, 1, 3, 0]


@pytest.mark.parametrize("tier", ["planes", "refine"])
@pytest.mark.parametrize("policy", [("sign", 0), ("sign", 1), ("parity", 0), ("parity", 1)])
def test_all_nibbles_round_trip(tier: str, policy: tuple[str, int]) -> None:
    nibbles = _all_nibbles(rows=3)
    qw = base_from_fp4(pack_nibbles(nibbles), torch.full((3, 2), 0x40, dtype=torch.uint8), "nv16", torch.ones(3), tier=tier, zero_policy=policy)
    back = unpack_nibbles(qw.fp4) if tier == "planes" else nibbles_from_refinement(qw)
    assert torch.equal(back, nibbles)


def test_parity_refinement_restores_minority_zero_signs() -> None:
    nibbles = torch.zeros(2, 64, dtype=torch.uint8)  # all +0 ...
    nibbles[0, 5] = 8  # ... but two −0: under 5% of the 128 zeros
    nibbles[1, 62] = 8
    nibbles[1, 7] = 0xF
    qw = base_from_fp4(pack_nibbles(nibbles), torch.full((2, 2), 127, dtype=torch.uint8), "mx32", torch.ones(2), tier="refine")
    assert (qw.zero_policy, qw.zero_sign) == ("parity", 0)
    assert qw.zero_flips.tolist() == [5, 64 + 62]
    assert torch.equal(nibbles_from_refinement(qw), nibbles)


def test_dequantize_against_float64_math() -> None:
    nibbles = _all_nibbles(rows=2)
    scale_bytes = torch.tensor([[0x38, 0x45], [0x01, 0x7E]], dtype=torch.uint8)  # 1.0, 3.25, 2^-9, 448
    scale_2 = 0.0123
    qw = base_from_fp4(pack_nibbles(nibbles), scale_bytes, "nv16", torch.full((2,), scale_2), tier="planes", zero_policy=("sign", 0))
    block = {0x38: 1.0, 0x45: 3.25, 0x01: 2.0**-9, 0x7E: 448.0}
    s2 = float(torch.tensor(scale_2, dtype=torch.float32))
    fp4 = dequantize_fp4(qw)
    base = dequantize_base(qw)
    for n in range(2):
        for k in range(32):
            nib = int(nibbles[n, k])
            scale = block[int(scale_bytes[n, k // 16])] * s2
            assert fp4[n, k].item() == NIBBLES[nib][0] * scale
            assert base[n, k].item() == CODE_VALUE[NIBBLES[nib][1]] * scale


def test_e4m3_scale_bytes() -> None:
    explicit = {
        0x00: 0.0,
        0x01: 2.0**-9,  # smallest subnormal: 1/8 · 2^-6
        0x07: 7 / 8 * 2.0**-6,  # largest subnormal
        0x08: 2.0**-6,  # smallest normal
        0x38: 1.0,
        0x3C: 1.5,
        0x40: 2.0,
        0x45: 3.25,
        0x7E: 448.0,
        0x80: -0.0,
        0xB8: -1.0,
        0xFE: -448.0,
    }
    for byte, value in explicit.items():
        assert E4M3_VALUES[byte].item() == value
        assert math.copysign(1, E4M3_VALUES[byte].item()) == math.copysign(1, value)
    assert math.isnan(E4M3_VALUES[0x7F].item()) and math.isnan(E4M3_VALUES[0xFF].item())
    # every byte against PyTorch's own float8_e4m3fn decoding
    torch_values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)
    assert torch.equal(E4M3_VALUES.nan_to_num(7.0), torch_values.nan_to_num(7.0))


def test_ue8m0_scale_bytes() -> None:
    explicit = {0: 2.0**-127, 1: 2.0**-126, 126: 0.5, 127: 1.0, 128: 2.0, 130: 8.0, 254: 2.0**127}
    for byte, value in explicit.items():
        assert UE8M0_VALUES[byte].item() == value
    assert math.isnan(UE8M0_VALUES[255].item())
    for byte in range(255):
        assert UE8M0_VALUES[byte].item() == math.ldexp(1.0, byte - 127)


@pytest.mark.parametrize("policy", [("sign", 0), ("parity", 1)])
def test_packed_fast_path_matches_nibble_definitions(policy: tuple[str, int]) -> None:
    gen = torch.Generator().manual_seed(7)
    packed = torch.randint(0, 256, (8, 64), dtype=torch.uint8, generator=gen)
    nibbles = unpack_nibbles(packed)
    qw = base_from_fp4(packed, torch.full((8, 8), 127, dtype=torch.uint8), "mx32", torch.ones(8), tier="refine", zero_policy=policy)
    assert torch.equal(qw.codes, pack_codes(base_codes(nibbles, policy[0])))
    refine, flips = refinement_from_fp4(nibbles, *policy)
    assert torch.equal(qw.refine, refine) and torch.equal(qw.zero_flips, flips)
    auto = base_from_fp4(packed, qw.scales, "mx32", torch.ones(8))
    assert zero_sign_stats(nibbles) == (auto.zero_policy, auto.zero_sign)
