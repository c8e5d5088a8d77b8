"""References the kernels are checked and timed against: the float64 MoE and the bf16 PyTorch MoE.

The float64 one dequantizes stored stacked tensors (docs/FORMAT.md) through moet.quant.codebook
(StackedWeight.dequantize), so it shares no code with the kernels' decoding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from moet.kernels.cpu import GATED_ACTIVATIONS
from moet.quant.codebook import Tier
from moet.quant.stacked import StackedWeight


def moe_reference(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: StackedWeight,
    w2: StackedWeight,
    tier: Tier = Tier.NONE,
    tokens: torch.Tensor | None = None,
    fp4_experts: torch.Tensor | None = None,
    activation: str = "silu",
    inputs: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """float64 MoE output [len(tokens), H] for the given token rows (all by default); activation(gate)·up.

    Every expert is read as `tier` (Tier.NONE: the 2-bit base), except those `fp4_experts` (bool [E]) marks,
    which use the FP4 tier's planes (what the GPU pool's slots hold). `inputs`, when given, rounds each
    projection's input rows as a kernel does (the activation(gate)·up rows are rounded to bf16 before it, as the
    kernels write them), e.g. to e4m3 per row for the FP8 prefill.
    """
    rows = torch.arange(x.shape[0], device=x.device) if tokens is None else tokens
    xs = x[rows].to(torch.float64)
    ids = topk_ids[rows].long()
    wts = topk_weights[rows].to(torch.float64)
    out = torch.zeros(xs.shape[0], w2.codes.shape[1], dtype=torch.float64, device=x.device)
    for e in torch.unique(ids).tolist():
        t, j = torch.nonzero(ids == e, as_tuple=True)
        expert_tier = Tier.PLANES if fp4_experts is not None and bool(fp4_experts[e]) else tier
        gate_up = (xs[t] if inputs is None else inputs(xs[t])) @ w13.dequantize(e, expert_tier).T
        gate, up = gate_up.chunk(2, dim=-1)
        h = GATED_ACTIVATIONS[activation](gate) * up
        if inputs is not None:
            h = inputs(h.to(torch.bfloat16).to(torch.float64))
        y = h @ w2.dequantize(e, expert_tier).T
        out.index_add_(0, t, y * wts[t, j].unsqueeze(-1))
    return out


def bf16_moe_grouped(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """bf16 MoE with torch._grouped_mm over pairs sorted by expert; w13 [E, 2I, H], w2 [E, H, I]; no host sync."""
    tokens, top_k = topk_ids.shape
    flat = topk_ids.flatten().long()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(w13.shape[0], dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    offs = counts.cumsum(0).to(torch.int32)
    h = torch._grouped_mm(x[order // top_k], w13.transpose(1, 2), offs=offs)
    gate, up = h.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=offs)
    y = y * topk_weights.flatten()[order].unsqueeze(-1).to(y.dtype)
    out = torch.zeros(tokens * top_k, x.shape[1], dtype=y.dtype, device=x.device).index_copy_(0, order, y)
    return out.view(tokens, top_k, -1).sum(1)


def bf16_moe_loop(
    x: torch.Tensor, routes: list[tuple[int, torch.Tensor, torch.Tensor]], w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """bf16 MoE as a per-expert loop; `routes` = host-known (expert, token rows, weights) per active expert."""
    out = torch.zeros_like(x)
    for e, rows, wts in routes:
        gate, up = F.linear(x[rows], w13[e]).chunk(2, dim=-1)
        out.index_add_(0, rows, F.linear(F.silu(gate) * up, w2[e]) * wts.unsqueeze(-1).to(x.dtype))
    return out


def host_routes(topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """The per-expert (expert, token rows, weights) lists bf16_moe_loop takes (reads routing to the host once)."""
    ids = topk_ids.long()
    routes = []
    for e in torch.unique(ids).tolist():
        t, j = torch.nonzero(ids == e, as_tuple=True)
        routes.append((e, t, topk_weights[t, j]))
    return routes


def run_poisoned(x, topk_weights, topk_ids, w13, w2, slots, configs, backend: str) -> tuple[torch.Tensor, bool]:
    """moet.kernels.moe.fused_moe_2bit on a workspace filled with NaN, and whether every activation and pair row it
    reads was written (no NaN left in them): the tests assert it, the kernels bench records it."""
    from moet.kernels.moe import fused_moe_2bit, new_workspace

    ws = new_workspace(topk_ids.numel(), w13.shape[1] // 2, x.shape[1], x.device, configs)
    for buf in (ws.act, ws.pair_out, ws.gate_up):
        if buf is not None:
            buf.fill_(float("nan"))
    out = fused_moe_2bit(x, topk_weights, topk_ids, w13, w2, slots=slots, configs=configs, workspace=ws, backend=backend)
    return out, not (ws.act.isnan().any() or ws.pair_out.isnan().any())
