"""The fused MoE forward on GPU: w13 GEMM + SiLU·mul, w2 GEMM × routing weight, fixed-order combine.

Decode launches w13, (with a K split) silu_mul_kernel, w2 and the combine's sum; prefill adds the
alignment's torch ops. Nothing synchronises with the host, so the whole forward can be captured in a
CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moet.kernels.gemm import FORMATS, moe_gemm_kernel, silu_mul_kernel
from moet.kernels.glue import align, combine
from moet.kernels.layout import StackedWeights

DECODE_MAX_TOKENS = 64  # up to here every program covers all tokens of its expert (ROUTE 0)
DECODE_BN = 64
TOPK_GUESS = 6  # experts per token assumed when sizing the decode grid (the 2026-12-02 H200 runs used 6 for all)
TARGET_PROGRAMS = 1024  # ≈ 8 programs of 4 warps per SM on a 132-SM H200


@dataclass(frozen=True)
class GemmConfig:
    """Tile sizes of one launch: BN weight rows, BK reduction, BM tokens; warps, pipeline stages, K slices."""

    bn: int
    bk: int
    bm: int
    num_warps: int
    num_stages: int
    split: int = 1
    backend: str = "triton"  # "cuda": the CUDA decode kernels (moet.kernels.cuda)
    tuning: str = ""  # the CUDA kernels' built tuning (moet.kernels.cuda.TUNINGS); tiles above are informational


def cuda_config(tuning: str) -> GemmConfig:
    from moet.kernels.cuda import WARPS, rows_per_cta

    return GemmConfig(bn=rows_per_cta(tuning), bk=128, bm=8, num_warps=WARPS, num_stages=0,
                      backend="cuda", tuning=tuning)


def cuda_decode_applies(tokens: int, w13: StackedWeights, tier: str) -> bool:
    """The CUDA decode kernels serve this call: few tokens, a tier they run, weights in their layout, a cubin."""
    from moet.kernels import cuda

    layout = {"base": w13.mma_words, "fp4": w13.mma_fp4, "refine": w13.mma_refine}.get(tier)
    if tokens > cuda.MAX_TOKENS or layout is None:
        return False
    words = layout[0] if isinstance(layout, tuple) else layout
    return words.is_cuda and cuda.available(words.device.index)


def default_backend(tokens: int, w13: StackedWeights, tier: str) -> str:
    """The kernels fused_moe_w2 runs when given no configs: "cuda" where the decode kernels apply, else "triton"."""
    return "cuda" if cuda_decode_applies(tokens, w13, tier) else "triton"


def default_configs(
    tokens: int, hidden: int, inter: int, backend: str = "triton", tier: str = "base"
) -> tuple[GemmConfig, GemmConfig]:
    """(w13, w2) tiles. Triton decode: small register footprint (several programs per SM to hide latency)
    and K split until about TARGET_PROGRAMS programs stream weights; prefill: tiles that feed the tensor
    cores. backend="cuda" (decode only): the CUDA kernels with the tier's default tuning.
    """
    if backend == "cuda" and tokens <= DECODE_MAX_TOKENS:
        from moet.kernels.cuda import DEFAULT_TUNINGS

        return cuda_config(DEFAULT_TUNINGS[tier]), cuda_config(DEFAULT_TUNINGS[tier])
    if tokens > DECODE_MAX_TOKENS:
        tile = GemmConfig(bn=128, bk=64, bm=64, num_warps=8, num_stages=3)
        return tile, tile
    bm = max(16, triton_next_pow2(tokens))
    bk = 128 if bm <= 16 else 64
    out = []
    for n_out, k in ((inter, hidden), (hidden, inter)):
        programs = tokens * TOPK_GUESS * n_out // DECODE_BN
        split = 1
        while programs * split < TARGET_PROGRAMS and k % (2 * split * bk) == 0 and split < 8:
            split *= 2
        out.append(GemmConfig(bn=DECODE_BN, bk=bk, bm=bm, num_warps=4, num_stages=3, split=split))
    return out[0], out[1]


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
    if n_out % config.bn or k % (config.bk * config.split):
        raise ValueError(f"tile {config} does not divide N={n_out}, K={k}")
    tier_lo, tier_hi = _tier_tensors(w, tier)
    if aligned is None:
        route, grid = 0, (tokens * top_k, n_out // config.bn, config.split)
        sorted_ids = block_expert = n_padded = topk_ids
    else:
        route = 1
        sorted_ids, block_expert, n_padded = aligned
        grid = (block_expert.numel(), n_out // config.bn, config.split)
    moe_gemm_kernel[grid](
        x, out, w.words, tier_lo, tier_hi, w.scales, w.row_scale,
        topk_ids, topk_weights, sorted_ids, block_expert, n_padded,
        tokens,
        N_OUT=n_out, K=k, TOPK=top_k, FMT=FORMATS[tier], STAGE=stage, ROUTE=route, SCALE_B=w.block,
        BN=config.bn, BK=config.bk, BM=config.bm,
        TOPK_P2=triton_next_pow2(top_k), P_P2=triton_next_pow2(tokens * top_k), SPLIT=config.split,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


@dataclass
class Workspace:
    """Uninitialised per-(token, slot) rows: activations, K-sliced w2 outputs, K-sliced gate/up (if split)."""

    act: torch.Tensor  # bf16 [T·k, I]
    pair_out: torch.Tensor  # f32 [split2, T·k, H]
    gate_up: torch.Tensor | None  # f32 [split13, T·k, 2I] when the w13 stage is split


def new_workspace(
    pairs: int, inter: int, hidden: int, device: torch.device, configs: tuple[GemmConfig, GemmConfig]
) -> Workspace:
    c13, c2 = configs
    return Workspace(
        act=torch.empty(pairs, inter, dtype=torch.bfloat16, device=device),
        pair_out=torch.empty(c2.split, pairs, hidden, dtype=torch.float32, device=device),
        gate_up=None if c13.split == 1 else torch.empty(c13.split, pairs, 2 * inter, dtype=torch.float32, device=device),
    )


def expert_gemms(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: StackedWeights,
    w2: StackedWeights,
    tier: str,
    configs: tuple[GemmConfig, GemmConfig],
    ws: Workspace,
) -> None:
    """Both expert GEMMs (and the SiLU·mul between them) into ws.pair_out; no combine."""
    c13, c2 = configs
    if c13.backend == "cuda":
        from moet.kernels.cuda import decode_gemms

        decode_gemms(x, topk_weights, topk_ids, w13, w2, tier, ws.act, ws.pair_out[0], c13.tuning)
        return
    experts = w13.shape[0]
    aligned13 = aligned2 = None
    if topk_ids.shape[0] > DECODE_MAX_TOKENS:
        aligned13 = align(topk_ids, experts, c13.bm)
        aligned2 = aligned13 if c2.bm == c13.bm else align(topk_ids, experts, c2.bm)
    if ws.gate_up is None:
        expert_gemm(13, x, ws.act, w13, tier, topk_ids, topk_weights, c13, aligned13)
    else:
        expert_gemm(13, x, ws.gate_up, w13, tier, topk_ids, topk_weights, c13, aligned13)
        pairs, inter = ws.act.shape
        block = 512
        silu_mul_kernel[(pairs, inter // block)](ws.gate_up, ws.act, pairs, inter, SPLIT=c13.split, BLOCK=block)
    expert_gemm(2, ws.act, ws.pair_out, w2, tier, topk_ids, topk_weights, c2, aligned2)


def fused_moe_w2(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: StackedWeights,
    w2: StackedWeights,
    activation: str = "silu",
    tier: str = "base",
    configs: tuple[GemmConfig, GemmConfig] | None = None,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """MoE layer output [T, H] (x's dtype) from bf16 x [T, H] and routing (f32 [T, k], int32 [T, k]).

    `tier`: "base" (2-bit), "fp4" (whole planes) or "refine" (base + base-5 digits, bit-exact FP4).
    `workspace`: buffers from new_workspace with the same configs, e.g. static ones in a graph.
    """
    if activation != "silu":
        raise NotImplementedError(f"activation {activation!r}: only silu is implemented")
    if tier not in FORMATS:
        raise ValueError(f"unknown tier {tier!r}")
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    inter = w13.shape[1] // 2
    x = x.to(torch.bfloat16).contiguous()
    topk_ids = topk_ids.to(torch.int32).contiguous()
    topk_weights = topk_weights.to(torch.float32).contiguous()
    if configs is None:
        configs = default_configs(tokens, hidden, inter, default_backend(tokens, w13, tier), tier)
    ws = workspace or new_workspace(tokens * top_k, inter, hidden, x.device, configs)
    expert_gemms(x, topk_weights, topk_ids, w13, w2, tier, configs, ws)
    return combine(ws.pair_out, tokens, top_k, x.dtype)


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
