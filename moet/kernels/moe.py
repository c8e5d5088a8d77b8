"""The fused MoE forward on GPU: w13 GEMM + SiLU·mul, w2 GEMM × routing weight, fixed-order combine.

Three launches for decode (w13, w2, combine) and a few more torch ops for prefill's alignment; no
host synchronisation, so the whole forward can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moet.kernels.gemm import FORMATS, moe_gemm_kernel
from moet.kernels.glue import align, combine
from moet.kernels.layout import StackedWeights

DECODE_MAX_TOKENS = 64  # up to here every program covers all tokens of its expert (ROUTE 0)


@dataclass(frozen=True)
class GemmConfig:
    """Tile sizes of one launch: BN weight rows, BK reduction, BM tokens; warps and pipeline stages."""

    bn: int
    bk: int
    bm: int
    num_warps: int
    num_stages: int


def default_config(tokens: int) -> GemmConfig:
    """Decode tiles keep many programs streaming weights; prefill tiles feed the tensor cores.

    (BM = 128 tokens with BN = 128 spills registers in the w2 stage: 168-byte stack on sm_90a.)
    """
    if tokens <= DECODE_MAX_TOKENS:
        return GemmConfig(bn=64, bk=256, bm=max(16, triton_next_pow2(tokens)), num_warps=4, num_stages=3)
    return GemmConfig(bn=128, bk=64, bm=64, num_warps=8, num_stages=3)


def triton_next_pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def _tier_tensors(w: StackedWeights, tier: str) -> tuple[torch.Tensor, torch.Tensor]:
    if tier == "fp4":
        if w.fp4 is None:
            raise ValueError("these weights carry no FP4 planes")
        return w.fp4, w.fp4
    if tier == "refine":
        if w.refine_lo is None:
            raise ValueError("these weights carry no refinement")
        return w.refine_lo, w.refine_hi
    return w.words, w.words


def expert_gemm(
    stage: int,
    x: torch.Tensor,
    out: torch.Tensor,
    w: StackedWeights,
    tier: str,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    config: GemmConfig,
    aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> None:
    """Launch one expert GEMM stage (13 or 2) writing `out` rows per (token, slot) pair."""
    tokens, top_k = topk_ids.shape
    _, n_w, k = w.shape
    n_out = n_w // 2 if stage == 13 else n_w
    if n_out % config.bn or k % config.bk:
        raise ValueError(f"tile {config} does not divide N={n_out}, K={k}")
    tier_lo, tier_hi = _tier_tensors(w, tier)
    if aligned is None:
        route, grid = 0, (tokens * top_k, n_out // config.bn)
        sorted_ids = block_expert = n_padded = topk_ids
    else:
        route = 1
        sorted_ids, block_expert, n_padded = aligned
        grid = (block_expert.numel(), n_out // config.bn)
    moe_gemm_kernel[grid](
        x, out, w.words, tier_lo, tier_hi, w.scales, w.row_scale,
        topk_ids, topk_weights, sorted_ids, block_expert, n_padded,
        tokens,
        N_OUT=n_out, K=k, TOPK=top_k, FMT=FORMATS[tier], STAGE=stage, ROUTE=route, SCALE_B=w.block,
        BN=config.bn, BK=config.bk, BM=config.bm,
        TOPK_P2=triton_next_pow2(top_k), P_P2=triton_next_pow2(tokens * top_k),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


def new_workspace(pairs: int, inter: int, hidden: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised (activation, weighted expert output) rows, one per (token, slot) pair."""
    act = torch.empty(pairs, inter, dtype=torch.bfloat16, device=device)
    return act, torch.empty(pairs, hidden, dtype=torch.float32, device=device)


def fused_moe_w2(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: StackedWeights,
    w2: StackedWeights,
    activation: str = "silu",
    tier: str = "base",
    configs: tuple[GemmConfig, GemmConfig] | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """MoE layer output [T, H] (x's dtype) from bf16 x [T, H] and routing (f32 [T, k], int32 [T, k]).

    `tier`: "base" (2-bit), "fp4" (whole planes) or "refine" (base + base-5 digits, bit-exact FP4).
    `workspace`: (bf16 [T·k, I], f32 [T·k, H]) buffers for the pair rows, e.g. static ones in a graph.
    """
    if activation != "silu":
        raise NotImplementedError(f"activation {activation!r}: only silu is implemented")
    if tier not in FORMATS:
        raise ValueError(f"unknown tier {tier!r}")
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    experts, n13, _ = w13.shape
    inter = n13 // 2
    x = x.to(torch.bfloat16).contiguous()
    topk_ids = topk_ids.to(torch.int32).contiguous()
    topk_weights = topk_weights.to(torch.float32).contiguous()
    c13, c2 = configs or (default_config(tokens),) * 2
    act, pair_out = workspace or new_workspace(tokens * top_k, inter, hidden, x.device)
    aligned13 = aligned2 = None
    if tokens > DECODE_MAX_TOKENS:
        aligned13 = align(topk_ids, experts, c13.bm)
        aligned2 = aligned13 if c2.bm == c13.bm else align(topk_ids, experts, c2.bm)
    expert_gemm(13, x, act, w13, tier, topk_ids, topk_weights, c13, aligned13)
    expert_gemm(2, act, pair_out, w2, tier, topk_ids, topk_weights, c2, aligned2)
    return combine(pair_out, tokens, top_k, x.dtype)


def fused_moe_fp4(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: StackedWeights,
    w2: StackedWeights,
    activation: str = "silu",
) -> torch.Tensor:
    """The FP4 tier's forward: whole planes when present, else the refinement of the base."""
    tier = "fp4" if w13.fp4 is not None else "refine"
    return fused_moe_w2(x, topk_weights, topk_ids, w13, w2, activation, tier)
