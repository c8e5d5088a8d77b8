"""MoE glue on the GPU in plain torch ops: routing, token→expert alignment, combine.

Every op here has a static output shape and no data-dependent host read, so the forward stays
CUDA-graph capturable (no .item(), no nonzero/unique/bincount, which synchronise).
"""

from __future__ import annotations

import torch

PAD = 2**30  # sorted-pair sentinel: larger than any pair index


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    scoring: str = "softmax",
    renormalize: bool = True,
    correction_bias: torch.Tensor | None = None,
    routed_scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing → (weights f32 [T, k], expert ids int32 [T, k]).

    `scoring` is "softmax" (Qwen/Mixtral) or "sigmoid" (DeepSeek-V3 family, GLM, Kimi-K2); the
    correction bias, if any, only chooses the experts and is not part of their weights.
    """
    logits = router_logits.float()
    if scoring == "softmax":
        scores = logits.softmax(dim=-1)
    elif scoring == "sigmoid":
        scores = logits.sigmoid()
    else:
        raise ValueError(f"unknown scoring {scoring!r}")
    choice = scores if correction_bias is None else scores + correction_bias.float()
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(-1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * routed_scaling, ids.to(torch.int32)


def max_blocks(pairs: int, experts: int, block: int) -> int:
    """Upper bound of Σ_e ceil(count_e / block) over any routing of `pairs` pairs to `experts` experts."""
    return -(-pairs // block) + min(experts, pairs)


def align(topk_ids: torch.Tensor, experts: int, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pairs (t·k + j) sorted by expert, each expert's run padded to a multiple of `block`.

    Returns (sorted pair ids int32 [max_blocks·block], PAD in the gaps; expert of each block int32
    [max_blocks]; padded length int32 [1]). Blocks at or past the padded length are idle.
    """
    flat = topk_ids.flatten().long()
    pairs = flat.numel()
    nblocks = max_blocks(pairs, experts, block)
    counts = torch.zeros(experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block - 1) // block * block
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    by_expert = flat[order]
    rank = torch.arange(pairs, device=flat.device) - (counts.cumsum(0) - counts)[by_expert]
    sorted_ids = torch.full((nblocks * block,), PAD, dtype=torch.int32, device=flat.device)
    sorted_ids[(ends - padded)[by_expert] + rank] = order.to(torch.int32)
    starts = torch.arange(nblocks, device=flat.device) * block
    block_expert = torch.searchsorted(ends, starts, right=True).clamp_(max=experts - 1).to(torch.int32)
    return sorted_ids, block_expert, ends[-1:].to(torch.int32)


def combine(pair_out: torch.Tensor, tokens: int, top_k: int, dtype: torch.dtype) -> torch.Tensor:
    """Σ over K slices and the k slots of each token's weighted expert outputs [split, T·k, H] (fixed order)."""
    return pair_out.view(pair_out.shape[0], tokens, top_k, -1).sum(dim=(0, 2)).to(dtype)
