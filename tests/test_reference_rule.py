"""The float64 FP8/BF16 → FP4 reference rule on hand-picked values (docs/FORMAT.md)."""

from __future__ import annotations

import math

import torch

from moet.quant.codebook import unpack_nibbles
from moet.quant.reference import fp4_from_float


def _quantize_block(values: list[float]) -> tuple[list[int], int]:
    """One row of 32 values (padded with zeros) → (nibbles, UE8M0 byte)."""
    row = torch.zeros(1, 32, dtype=torch.float64)
    row[0, : len(values)] = torch.tensor(values, dtype=torch.float64)
    packed, exponents = fp4_from_float(row)
    return unpack_nibbles(packed)[0, : len(values)].tolist(), int(exponents[0, 0])


def test_midpoints_tie_to_the_lower_magnitude() -> None:
    # amax 6 → e = 0, u = w; each midpoint goes down, just above it goes up.
    values = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    above = [math.nextafter(v, math.inf) for v in values[1:]]
    nibbles, byte = _quantize_block(values + above)
    assert byte == 127
    assert nibbles == [7, 0, 1, 2, 3, 4, 5, 6] + [1, 2, 3, 4, 5, 6, 7]


def test_negative_values_and_negative_zero_keep_their_sign() -> None:
    nibbles, _ = _quantize_block([-6.0, -0.25, -0.26, -1.0, -0.0, 0.0, -5.0, -5.01])
    assert nibbles == [0xF, 0x8, 0x9, 0xA, 0x8, 0x0, 0xE, 0xF]


def test_exponent_rounds_log2_half_to_even_and_scales() -> None:
    assert math.log2(2**1.5) == 1.5 and math.log2(2**2.5) == 2.5  # exact ties below
    # amax = 6·2^1.5: log2(amax/6) = 1.5 → e = 2 (half to even); u = w/4
    nibbles, byte = _quantize_block([6 * 2**1.5, 4.0, -2.0])
    assert byte == 127 + 2
    assert nibbles == [0x6, 0x2, 0x9]  # 4.24 → 4, 1 → 1, -0.5 → -0.5
    # amax = 6·2^2.5 → e = 2 again (2.5 rounds to even)
    _, byte = _quantize_block([6 * 2**2.5])
    assert byte == 127 + 2
    # amax 3 → log2(0.5) = -1 → e = -1, u = 2w
    nibbles, byte = _quantize_block([3.0, 0.25, -1.0])
    assert byte == 126
    assert nibbles == [0x7, 0x1, 0xC]


def test_saturation_at_six() -> None:
    # amax = 6·2^0.4 → e = round(0.4) = 0, u = amax ≈ 7.9 saturates to 6
    nibbles, byte = _quantize_block([6 * 2**0.4, -6 * 2**0.4, 5.5])
    assert byte == 127
    assert nibbles == [0x7, 0xF, 0x7]


def test_all_zero_block_and_exponent_clamps() -> None:
    nibbles, byte = _quantize_block([0.0, -0.0])
    assert byte == 0  # e = -127
    assert nibbles == [0x0, 0x8]
    _, byte = _quantize_block([1e-300])
    assert byte == 0  # log2 far below -127 clamps
    nibbles, byte = _quantize_block([1e300, 1.0])
    assert byte == 254  # clamps at +127
    assert nibbles == [0x7, 0x0]


def test_blocks_are_independent_along_k() -> None:
    row = torch.zeros(1, 64, dtype=torch.float64)
    row[0, 0] = 6.0
    row[0, 32] = 12.0
    row[0, 33] = 1.0
    packed, exponents = fp4_from_float(row)
    assert exponents.tolist() == [[127, 128]]
    nibbles = unpack_nibbles(packed)[0]
    assert nibbles[0].item() == 7 and nibbles[32].item() == 7 and nibbles[33].item() == 1  # 1/2 = 0.5 → code 1
