"""The vectorised CPU MoE against a float64 per-token loop over the same quantized experts.

The reference decodes each expert through moet.quant.codebook (nibble-level code, not the stacked
byte tables the fast path uses) and loops over tokens and their k experts in float64.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moet.kernels.cpu import moe_forward
from moet.kernels.oracle import select_moe_backend
from moet.quant.codebook import QuantizedWeight, base_from_fp4, dequantize_base, dequantize_fp4
from moet.store.build import fuse_rows
from moet.quant.stacked import StackedWeight

E, H, I, K_TOP = 6, 64, 32, 2


def random_expert(n: int, k: int, kind: str, gen: torch.Generator) -> QuantizedWeight:
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    block = 16 if kind == "nv16" else 32
    low, high = (0x30, 0x40) if kind == "nv16" else (120, 130)  # e4m3 0.5..1.9 / 2^-7..2^2
    scales = torch.randint(low, high, (n, k // block), dtype=torch.uint8, generator=gen)
    row = torch.rand(n, generator=gen, dtype=torch.float64).to(torch.float32) + 0.5
    return base_from_fp4(packed, scales, kind, row, tier="refine")


def stack(weights: list[QuantizedWeight], kind: str) -> StackedWeight:
    n, k = weights[0].shape
    stacked = StackedWeight.empty(len(weights), n, k, kind, "refine")
    for e, qw in enumerate(weights):
        stacked.put(e, slice(None), qw)
    return stacked


def reference(x, weights, ids, w13, w2, use_fp4, present) -> torch.Tensor:
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0 or not present[e]:
                continue
            decode = dequantize_fp4 if use_fp4[e] else dequantize_base
            gate_up = decode(w13[e]) @ x[t].double()
            hidden = F.silu(gate_up[:I]) * gate_up[I:]
            out[t] += float(weights[t, j]) * (decode(w2[e]) @ hidden)
    return out


@pytest.mark.parametrize("kind", ["nv16", "mx32"])
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_cpu_moe_equals_float64_loop(kind: str, tokens: int) -> None:
    gen = torch.Generator().manual_seed(tokens)
    w13 = [fuse_rows([random_expert(I, H, kind, gen), random_expert(I, H, kind, gen)]) for _ in range(E)]
    w2 = [random_expert(H, I, kind, gen) for _ in range(E)]
    x = torch.randn(tokens, H, generator=gen)
    ids = torch.randint(-1, E, (tokens, K_TOP), generator=gen, dtype=torch.int32)  # −1: not on this rank
    ids[0, 0] = 0  # at least one present expert
    weights = torch.rand(tokens, K_TOP, generator=gen)
    use_fp4 = torch.tensor([True, False, True, False, False, True])
    present = torch.tensor([True, True, True, False, True, True])  # expert 3 is a cache miss
    got = moe_forward(x, weights, ids, stack(w13, kind), stack(w2, kind), "silu", use_fp4, present,
                      backend=select_moe_backend(x.device, tokens, use_fp4))
    want = reference(x, weights, ids, w13, w2, use_fp4, present)
    assert got.dtype == torch.float32
    assert torch.linalg.norm(got.double() - want) / torch.linalg.norm(want) < 1e-5
    missing_only = [t for t in range(tokens) if all(int(e) in (-1, 3) for e in ids[t])]
    for t in missing_only:
        assert torch.equal(got[t], torch.zeros(H))


@pytest.mark.parametrize("mode", ["sign", "parity"])
def test_zero_mode_knob_forces_the_policy(mode: str) -> None:
    """VLLM_MOE_W2_ZERO_MODE overrides the per-tensor choice: all +0 zeros (which `auto` turns into
    parity) follow the forced rule, checked on hand-made nibbles."""
    from moet.formats.source import ExpertKey, SourceWeight
    from moet.quant.codebook import pack_nibbles, unpack_codes
    from moet.quant.requant import requantize

    nibbles = torch.tensor([[0, 0, 0, 0, 1, 9, 5, 13] * 2], dtype=torch.uint8)  # four +0, then ±0.5, ±3
    src = SourceWeight("w", ExpertKey(0, 0, "down"), "nvfp4", pack_nibbles(nibbles), torch.full((1, 1), 0x38, dtype=torch.uint8), 1.0, "f")
    codes = unpack_codes(requantize(src, "refine", mode).codes)[0].tolist()
    zeros = [2, 2, 2, 2] if mode == "sign" else [2, 1, 2, 1]  # +1 for +0; parity: +1 at even k, −1 at odd
    assert codes[:4] == zeros and codes[4:8] == [2, 1, 3, 0]
    assert requantize(src, "none", "auto").zero_policy == "parity"
