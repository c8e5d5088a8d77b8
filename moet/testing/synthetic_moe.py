"""A synthetic MoE for the tier tests, `moet bench tiers` and the GPU check.

Random FP4 experts quantized to the 2-bit base, a router whose logits carry a Zipf prior (a few
experts take most tokens, as in real decode traces), and a float64 reference forward that reads
its experts through any source: the quantized weights themselves (fully resident) or a device
cache, where a miss contributes exactly zero.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moet.quant.codebook import QuantizedWeight, Tier, base_from_fp4, dequantize_base
from moet.quant.scales import SCALE_BLOCK
from moet.store.cache import ExpertCache
from moet.store.layout import RowLayout

ExpertSource = Callable[[int, Sequence[int]], Sequence[Sequence[QuantizedWeight] | None]]
SCALE_BITS = {"mx32": (120, 124), "nv16": (0x28, 0x38)}  # UE8M0 2^-7..2^-4; e4m3 ≈ 0.016..0.06


@dataclass
class SyntheticMoE:
    layout: RowLayout
    router: torch.Tensor  # float64 [L, H, E]
    prior: torch.Tensor  # float64 [L, E], Zipf log-prior added to the router logits
    weights: list[list[list[QuantizedWeight]]]  # [layer][expert] → the layout's matrices
    top_k: int

    @property
    def layers(self) -> int:
        return self.router.shape[0]

    @property
    def experts(self) -> int:
        return self.router.shape[2]

    @property
    def hidden(self) -> int:
        return self.router.shape[1]


def random_source(layout: RowLayout, gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """One expert as an FP4 checkpoint stores it: per matrix (packed nibbles, block scales, row scale)."""
    lo, hi = SCALE_BITS[layout.scale_kind]
    block = SCALE_BLOCK[layout.scale_kind]
    out = []
    for _, n, k in layout.matrices:
        packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
        scales = torch.randint(lo, hi, (n, k // block), generator=gen, dtype=torch.uint8)
        out.append((packed, scales, torch.full((n,), 0.5 if layout.scale_kind == "nv16" else 1.0)))
    return out


def quantize_source(layout: RowLayout, source: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> list[QuantizedWeight]:
    """What a re-quantizing boot does for one expert."""
    return [base_from_fp4(packed, scales, layout.scale_kind, row, layout.tier) for packed, scales, row in source]


def random_expert(layout: RowLayout, gen: torch.Generator) -> list[QuantizedWeight]:
    return quantize_source(layout, random_source(layout, gen))


def make_model(layers: int, experts: int, hidden: int, inter: int, top_k: int, zipf_s: float = 1.0,
               scale_kind: str = "mx32", tier: Tier = Tier.NONE, seed: int = 0) -> SyntheticMoE:
    """A random MoE whose expert popularity follows Zipf(s) in a random order per layer."""
    gen = torch.Generator().manual_seed(seed)
    layout = RowLayout.for_moe(hidden, inter, scale_kind, tier)
    router = torch.randn(layers, hidden, experts, generator=gen, dtype=torch.float64) / hidden**0.5
    ranks = torch.stack([torch.randperm(experts, generator=gen) for _ in range(layers)]).to(torch.float64)
    prior = -zipf_s * torch.log1p(ranks)
    weights = [[random_expert(layout, gen) for _ in range(experts)] for _ in range(layers)]
    return SyntheticMoE(layout, router, prior, weights, top_k)


def resident(model: SyntheticMoE) -> ExpertSource:
    """Every expert from the quantized weights themselves: the fully resident reference."""
    return lambda layer, ids: [model.weights[layer][e] for e in ids]


def cached(cache: ExpertCache) -> ExpertSource:
    """Experts through the device cache: misses are recorded and come back as None."""
    return cache.expert_weights


def forward(model: SyntheticMoE, x: torch.Tensor, source: ExpertSource) -> torch.Tensor:
    """float64 MoE stack (routing, SwiGLU experts, residual, RMS norm); x [T, H] on any device."""
    h = x.to(torch.float64)
    for layer in range(model.layers):
        logits = h @ model.router[layer].to(h.device) + model.prior[layer].to(h.device)
        top_v, top_i = logits.topk(model.top_k, dim=-1)
        gates = torch.softmax(top_v, dim=-1)
        ids = torch.unique(top_i).tolist()
        out = torch.zeros_like(h)
        for expert, mats in zip(ids, source(layer, ids)):
            if mats is None:
                continue  # a missing expert contributes exactly zero
            tok, pos = (top_i == expert).nonzero(as_tuple=True)
            w13, w2 = (_dense(qw, h.device) for qw in mats)
            gate, up = (h[tok] @ w13.T).chunk(2, dim=-1)
            out.index_add_(0, tok, (F.silu(gate) * up) @ w2.T * gates[tok, pos, None])
        h = h + out
        h = h / h.pow(2).mean(-1, keepdim=True).sqrt()
    return h


def _dense(qw: QuantizedWeight, device: torch.device) -> torch.Tensor:
    """float64 weights of a base matrix; decoded on the host (the scale tables live there), used on `device`."""
    host = QuantizedWeight(qw.codes.cpu(), qw.scales.cpu(), qw.scale_kind, qw.row_scale.cpu(), qw.zero_policy)
    return dequantize_base(host).to(device)
