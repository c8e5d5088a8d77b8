"""Random stacked expert weights in the stored format, for kernel tests and benchmarks.

Drawn as random FP4 nibbles and mapped through moet.quant.codebook, so base codes, planes and
refinement describe the same weights; scales are drawn in a realistic range (never all zero).
Works in expert chunks so that a 1T-class layer fits beside its int64 intermediates.
"""

from __future__ import annotations

import torch

from moet.quant.codebook import base_codes, pack_codes, pack_nibbles, refinement_from_fp4
from moet.quant.scales import SCALE_BLOCK
from moet.quant.stacked import StackedWeight


def random_scales(shape: tuple[int, ...], scale_kind: str, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """uint8 block scales: e4m3 in [2^-1, 2^5) for nv16, UE8M0 2^-10..2^-4 for mx32."""
    if scale_kind == "nv16":
        exponent = torch.randint(6, 12, shape, device=device, generator=gen)
        mantissa = torch.randint(0, 8, shape, device=device, generator=gen)
        return ((exponent << 3) | mantissa).to(torch.uint8)
    return torch.randint(117, 124, shape, device=device, generator=gen).to(torch.uint8)


def random_stored(
    experts: int,
    rows: int,
    cols: int,
    scale_kind: str,
    device: torch.device | str = "cpu",
    seed: int = 0,
    chunk: int = 4,
    refine: bool = True,
) -> StackedWeight:
    """Stacked [E, N, K] weights with the 2-bit base, FP4 planes and (with `refine`) refinement of the same nibbles."""
    gen = torch.Generator(device=device).manual_seed(seed)
    block = SCALE_BLOCK[scale_kind]
    codes, planes, digits = [], [], []
    for start in range(0, experts, chunk):
        n = min(chunk, experts - start)
        nibbles = torch.randint(0, 16, (n, rows, cols), device=device, generator=gen).to(torch.uint8)
        codes.append(pack_codes(base_codes(nibbles, "sign")))
        planes.append(pack_nibbles(nibbles))
        if refine:
            digits.append(refinement_from_fp4(nibbles, "sign", 0)[0].view(n, rows, -1))
        del nibbles
    scales = random_scales((experts, rows, cols // block), scale_kind, device, gen)
    if scale_kind == "nv16":
        row_scale = torch.rand(experts, rows, device=device, generator=gen) * 2.0**-9 + 2.0**-10
    else:
        row_scale = torch.ones(experts, rows, device=device)
    return StackedWeight(
        codes=torch.cat(codes),
        scales=scales,
        scale_kind=scale_kind,
        row_scale=row_scale,
        fp4=torch.cat(planes),
        refine=torch.cat(digits) if refine else None,
    )
