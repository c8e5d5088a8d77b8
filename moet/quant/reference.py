"""The documented float64 rule that turns FP8/BF16 expert weights into FP4 (e2m1 + UE8M0 per 32).

docs/FORMAT.md states it; this is the only place it is computed.
"""

from __future__ import annotations

import torch

from moet.quant.codebook import pack_nibbles

MX_BLOCK = 32
# |u| above the i-th midpoint snaps to e2m1 magnitude code i+1; equality stays below (ties → lower).
E2M1_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64)


def fp4_from_float(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize float weights [N, K] (K % 32 == 0) to (packed e2m1 uint8 [N, K/2], UE8M0 uint8 [N, K/32])."""
    if weight.shape[-1] % MX_BLOCK:
        raise ValueError(f"K must be a multiple of {MX_BLOCK}, got {weight.shape[-1]}")
    w = weight.to(torch.float64)
    blocks = w.unflatten(-1, (-1, MX_BLOCK))
    amax = blocks.abs().amax(dim=-1)
    exponent = torch.where(
        amax > 0,
        torch.round(torch.log2(amax / 6.0)),
        torch.full_like(amax, -127.0),
    ).clamp(-127, 127)
    u = blocks / torch.exp2(exponent).unsqueeze(-1)
    nibbles = e2m1_nibbles(u).flatten(-2)
    return pack_nibbles(nibbles), (exponent + 127).to(torch.uint8)


def e2m1_nibbles(u: torch.Tensor) -> torch.Tensor:
    """float64 values in e2m1 units → nibbles uint8: nearest magnitude (ties lower, saturating at 6), sign bit kept."""
    magnitude = (u.abs().unsqueeze(-1) > E2M1_MIDPOINTS.to(u.device)).sum(-1).to(torch.uint8)
    return magnitude | (torch.signbit(u).to(torch.uint8) << 3)
