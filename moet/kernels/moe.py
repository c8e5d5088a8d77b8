"""The fused MoE forward on GPU: w13 GEMM + SiLU·mul, w2 GEMM × routing weight, fixed-order combine.

One weight layout (moet.kernels.layout) for every kernel; the backend (the CUDA decode kernels or the
Triton kernels) is chosen by moet.kernels.oracle and given here as `backend` (configs, when given, match it).
An optional `Fp4Slots` mixes tiers per expert inside the same launches. Nothing synchronises with the
host, so the whole forward can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache

import torch

from moet.kernels.gemm import e4m3_rows_kernel, moe_gemm_kernel, silu_mul_kernel
from moet.kernels.glue import align, combine
from moet.kernels.layout import Fp4Slots, StackedWeights, mma_k_order
from moet.kernels.oracle import MoeBackend

DECODE_MAX_TOKENS = 64  # up to here every program covers all tokens of its expert (ROUTE 0)
TOPK_GUESS = 6  # experts per token assumed when sizing the decode grid (the 2026-12-02 H200 runs used 6 for all)
DEFAULT_SMS = 132  # SMs assumed where no CUDA device says (H100 and H200 SXM)
TARGET_PROGRAMS = 1024  # ≈ 8 programs of 4 warps per SM on a 132-SM H200
PREFILL_WIDE_FROM = 4096  # past this many tokens the prefill tile takes 128 pairs instead of 64
# ... where a block may take the shared memory that tile asks: up to 120 KiB in the ahead-of-time build (sm_90a, FP4
# tier: 122,880 B; sm_120a, 2-bit base: 106,496 B). An sm_120 GPU gives a block 99 KiB, and Triton would refuse the
# launch (OutOfResources); it keeps the 64-pair tile there (at most 73,728 B).
PREFILL_WIDE_SHARED = 120 << 10
SM90_BLOCK_SHARED = 227 << 10  # the shared memory a block may take where no CUDA device says (H100 and H200)
# prefill tiles this wide run a pair block's row blocks side by side (one read of its activations): 3-4% faster
# at 8,192 tokens; 64-pair tiles at 1-2k tokens were 6% slower that way on DeepSeek-V4-Flash (H200, docs/KERNELS.md)
ROWS_FIRST_FROM_BM = 128


@dataclass(frozen=True)
class GemmConfig:
    """Tiles of one launch: 16-row blocks per program, BM tokens; warps, pipeline stages, K slices.

    backend "cuda": the CUDA decode kernels with the built `tuning` (moet.kernels.cuda.TUNINGS); the
    tile fields then only describe it. backend "gluon" with `fp8`: the 2-bit base experts through an FP8 wgmma,
    their activations e4m3 with one scale per row (moet.kernels.hopper; FP4-tier experts stay bf16).
    """

    blocks: int
    bm: int
    num_warps: int
    num_stages: int
    split: int = 1
    backend: str = "triton"
    tuning: str = ""
    fp8: bool = False

    def __post_init__(self) -> None:
        if self.fp8 and self.backend != "gluon":
            raise ValueError(f"fp8 is a form of the Gluon prefill kernel, not of backend {self.backend!r}")

    @property
    def rows(self) -> int:
        """Weight rows of one program: 16 per block (w13: 8 gate + the matching 8 up rows per block)."""
        return 16 * self.blocks


# the prefill tiles (H200 sweeps, docs/KERNELS.md): Triton's, one warpgroup over 64 weight rows × 64 pairs
# (128 past PREFILL_WIDE_FROM tokens); moet.kernels.hopper's, two warpgroups over 128 rows × 64 pairs, the
# decoded weights in registers, four activation tiles in flight: the fastest of its sweep at 2,048 and 8,192
# tokens on both geometries (H100, 2026-12-05; 128 and 256 pairs 1.1-2.8× slower); the same tile for FP4-tier experts.
PREFILL_TILE = GemmConfig(blocks=8, bm=64, num_warps=4, num_stages=3)
GLUON_TILE = GemmConfig(blocks=8, bm=64, num_warps=8, num_stages=6, backend="gluon")
# Two of its CTAs (2 × 256 threads) an SM; unbounded, ptxas gave the FP4 body with e4m3/16 scales 158-163 (no spills at 128).
GLUON_MAX_REGISTERS = 128


def cuda_config(tuning: str) -> GemmConfig:
    from moet.kernels.cuda import WARPS, rows_per_cta

    return GemmConfig(blocks=rows_per_cta(tuning) // 16, bm=8, num_warps=WARPS, num_stages=0, backend="cuda", tuning=tuning)


def default_configs(
    tokens: int, hidden: int, inter: int, backend: str = "triton", top_k: int = TOPK_GUESS, sms: int = DEFAULT_SMS,
    fp8_prefill: bool = False, block_shared: int = SM90_BLOCK_SHARED,
) -> tuple[GemmConfig, GemmConfig]:
    """(w13, w2) tiles. Triton decode: small register footprint (several programs per SM to hide latency)
    and K split until about TARGET_PROGRAMS programs stream weights; prefill: tiles that feed the tensor
    cores. backend="cuda": the CUDA kernels' tunings (any T; moet.kernels.oracle picks them up to
    moet.kernels.cuda.MAX_TOKENS), per stage from its grid against the `sms` SMs (moet.kernels.cuda.stage_tuning).
    backend="gluon": the sm_90a prefill kernel's tile (both tiers), with `fp8_prefill` its FP8 form. Triton prefill
    takes 128 pairs a tile past PREFILL_WIDE_FROM tokens where a block may take `block_shared` bytes of shared memory
    (block_shared_memory) of at least PREFILL_WIDE_SHARED, else 64.
    """
    if backend == "cuda":
        from moet.kernels.cuda import stage_tuning

        return (cuda_config(stage_tuning(tokens, top_k, 2 * inter, hidden, sms)),
                cuda_config(stage_tuning(tokens, top_k, hidden, inter, sms)))
    if backend == "gluon":
        tile = replace(GLUON_TILE, fp8=fp8_prefill)
        return tile, tile
    if tokens > DECODE_MAX_TOKENS:
        wide = tokens > PREFILL_WIDE_FROM and block_shared >= PREFILL_WIDE_SHARED
        tile = replace(PREFILL_TILE, bm=128) if wide else PREFILL_TILE
        return tile, tile
    bm = max(16, triton_next_pow2(tokens))
    out = []
    for blocks, n_out, k in ((8, inter, hidden), (8, hidden, inter)):  # 64-row dots: wgmma on sm_90a
        programs = tokens * TOPK_GUESS * n_out // (16 * blocks)
        split = 1
        while programs * split < TARGET_PROGRAMS and (k // 128) % (2 * split) == 0 and split < 8:
            split *= 2
        out.append(GemmConfig(blocks=blocks, bm=bm, num_warps=4, num_stages=3, split=split))
    return out[0], out[1]


@cache
def multiprocessors(device: torch.device) -> int:
    """The SM count of a CUDA device (the CUDA kernels fit their grids to it); DEFAULT_SMS elsewhere."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else DEFAULT_SMS


def block_shared_memory(device: torch.device) -> int:
    """The shared memory one block may take on a CUDA device (the Triton prefill tile fits it); SM90_BLOCK_SHARED
    elsewhere."""
    if device.type != "cuda":
        return SM90_BLOCK_SHARED
    from moet.kernels.cuda import block_shared_optin

    return block_shared_optin(device.index if device.index is not None else torch.cuda.current_device())


def triton_next_pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def expert_gemm(
    stage: int,
    x: torch.Tensor,
    out: torch.Tensor,
    w: StackedWeights,
    fp4: torch.Tensor | None,
    table: torch.Tensor | None,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    config: GemmConfig,
    aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> None:
    """Launch one Triton expert GEMM stage (13 or 2) writing `out` rows per (token, slot) pair."""
    tokens, top_k = topk_ids.shape
    _, n_w, k = w.shape
    n_out = n_w // 2 if stage == 13 else n_w
    rows = config.rows
    if n_w % rows or (k // 128) % config.split:
        raise ValueError(f"tile {config} does not divide N={n_w}, K={k}")
    if config.backend == "gluon" and (aligned is None or rows != 16 * config.num_warps):
        raise ValueError(f"tile {config}: the Gluon kernel serves aligned prefill blocks, 16 rows per warp")
    if aligned is None:
        route = 0
        sorted_ids = block_expert = n_padded = topk_ids
    else:
        route = 1
        sorted_ids, block_expert, n_padded = aligned
    # decode: one launch, each program branching on its expert's tier; prefill: one launch per tier
    if config.backend == "gluon":  # moet.kernels.hopper, a launch per tier
        from moet.kernels.hopper import moe_prefill_sm90_kernel

        tiers = (0,) if table is None else (0, 1)
        if config.fp8:  # stage 2's input rows come in the FP8 order from stage 13's base launch
            x8, x_scale = e4m3_rows(x, fp8_order=stage == 13)
        if not config.fp8 or 1 in tiers:
            x_mma = mma_k_order(x) if stage == 13 else x
        for tier in tiers:
            fp8 = config.fp8 and tier == 0
            moe_prefill_sm90_kernel[(n_w // rows, block_expert.numel())](
                x8 if fp8 else x_mma, out, w.words, w.scales, w.row_scale,
                w.words if table is None else table, w.words if fp4 is None else fp4, topk_weights,
                sorted_ids, block_expert, n_padded, x_scale if fp8 else w.row_scale,
                tokens, n_out, k, top_k,
                STAGE=stage, SCALE_B=w.block, HAS_SLOTS=table is not None, TIER=tier, BM=config.bm,
                STAGES=config.num_stages, WARPS=config.num_warps, FP8=fp8, num_warps=config.num_warps,
                maxnreg=GLUON_MAX_REGISTERS,
            )
        return
    for tiers in ((2,) if route == 0 or table is None else (0, 1)):
        grid = (tokens * top_k if route == 0 else block_expert.numel(), n_w // rows, config.split)
        rows_first = route == 1 and config.bm >= ROWS_FIRST_FROM_BM
        if rows_first:
            grid = (grid[1], grid[0], grid[2])
        moe_gemm_kernel[grid](
            x, out, w.words, w.scales, w.row_scale,
            w.words if table is None else table, w.words if fp4 is None else fp4,
            topk_ids, topk_weights, sorted_ids, block_expert, n_padded,
            tokens, n_out, k, top_k,
            STAGE=stage, ROUTE=route, SCALE_B=w.block, HAS_SLOTS=table is not None, TIERS=tiers,
            BLOCKS=config.blocks, BM=config.bm,
            TOPK_P2=triton_next_pow2(top_k), P_P2=triton_next_pow2(tokens * top_k), SPLIT=config.split,
            ROWS_FIRST=rows_first,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )


def sorted_pairs(topk_ids: torch.Tensor, experts: int, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """moet.kernels.glue.align's blocks for the prefill kernels: from one launch of the CUDA decode kernels'
    moe_pass_grid where their cubin loads (align is a chain of torch ops, a launch each), else from align. The order of
    an expert's pairs inside its run may differ between the two; each pair is its own output row, so no bit depends
    on it."""
    from moet.kernels import cuda

    if topk_ids.is_cuda and experts <= cuda.MAX_EXPERTS and cuda.available(topk_ids.device.index):
        return cuda.pass_grid(topk_ids, experts, block)
    return align(topk_ids, experts, block)


def e4m3_rows(x: torch.Tensor, fp8_order: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [M, K], f32 scales [M]) of bf16 x [M, K], one scale per row (moet.kernels.gemm.e4m3_rows_kernel);
    `fp8_order`: the columns put in the FP8 wgmma's k order on the way."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    e4m3_rows_kernel[(m,)](x, q, scale, k, BLOCK=triton_next_pow2(k), FP8_ORDER=fp8_order)
    return q, scale


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
    slots: Fp4Slots | None,
    configs: tuple[GemmConfig, GemmConfig],
    ws: Workspace,
    overlap: bool = True,
) -> None:
    """Both expert GEMMs (and the SiLU·mul between them) into ws.pair_out; no combine.
    overlap: the CUDA kernels' w2 launch starts while w13 drains (False: one after the other, for comparison)."""
    c13, c2 = configs
    if c13.backend == "cuda":
        from moet.kernels.cuda import decode_gemms

        decode_gemms(x, topk_weights, topk_ids, w13, w2, slots, ws.act, ws.pair_out[0], (c13.tuning, c2.tuning), overlap)
        return
    table = None if slots is None else slots.table
    fp4_13 = None if slots is None else slots.w13
    fp4_2 = None if slots is None else slots.w2
    experts = w13.shape[0]
    aligned13 = aligned2 = None
    if topk_ids.shape[0] > DECODE_MAX_TOKENS:
        aligned13 = sorted_pairs(topk_ids, experts, c13.bm)
        aligned2 = aligned13 if c2.bm == c13.bm else sorted_pairs(topk_ids, experts, c2.bm)
    if ws.gate_up is None:
        expert_gemm(13, x, ws.act, w13, fp4_13, table, topk_ids, topk_weights, c13, aligned13)
    else:
        expert_gemm(13, x, ws.gate_up, w13, fp4_13, table, topk_ids, topk_weights, c13, aligned13)
        pairs, inter = ws.act.shape
        block = 512 if inter % 512 == 0 else 128  # inter is a multiple of 128 (the layout's chunk)
        silu_mul_kernel[(pairs, inter // block)](ws.gate_up, ws.act, pairs, inter, SPLIT=c13.split, BLOCK=block)
    expert_gemm(2, ws.act, ws.pair_out, w2, fp4_2, table, topk_ids, topk_weights, c2, aligned2)


def fused_moe_2bit(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: StackedWeights,
    w2: StackedWeights,
    activation: str = "silu",
    slots: Fp4Slots | None = None,
    configs: tuple[GemmConfig, GemmConfig] | None = None,
    workspace: Workspace | None = None,
    *,
    backend: MoeBackend,
    fp8_prefill: bool = False,
) -> torch.Tensor:
    """MoE layer output [T, H] (x's dtype) from bf16 x [T, H] and routing (f32 [T, k], int32 [T, k]).

    Experts with a slot in `slots.table` compute with their FP4 copy, the others with the 2-bit base.
    An id < 0 (a device-cache miss) must not reach the kernels: callers map them to a zero expert.
    `workspace`: buffers from new_workspace with the same configs, e.g. static ones in a graph.
    `backend`: the kernels (moet.kernels.oracle.select_moe_backend's choice: CUDA_DECODE, GLUON_PREFILL or TRITON);
    `configs`, when given, are tiles of that backend (default: default_configs). `fp8_prefill`: under GLUON_PREFILL
    without `configs`, the 2-bit base experts through the FP8 kernel (GemmConfig.fp8); ignored by other backends.
    """
    if activation != "silu":
        raise NotImplementedError(f"activation {activation!r}: only silu is implemented")
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    inter = w13.shape[1] // 2
    x = x.to(torch.bfloat16).contiguous()
    topk_ids = topk_ids.to(torch.int32).contiguous()
    topk_weights = topk_weights.to(torch.float32).contiguous()
    if backend not in (MoeBackend.CUDA_DECODE, MoeBackend.GLUON_PREFILL, MoeBackend.TRITON):
        raise ValueError(f"backend {backend!r} is not a GPU backend (CUDA_DECODE, GLUON_PREFILL or TRITON)")
    if backend == MoeBackend.GLUON_PREFILL and tokens <= DECODE_MAX_TOKENS:
        raise ValueError(f"GLUON_PREFILL serves prefill (> {DECODE_MAX_TOKENS} tokens), not {tokens}")
    if configs is None:
        configs = default_configs(tokens, hidden, inter, backend, top_k, multiprocessors(x.device), fp8_prefill,
                                  block_shared_memory(x.device))
    elif configs[0].backend != backend:
        raise ValueError(f"configs for the {configs[0].backend!r} kernels, backend {backend!r}")
    ws = workspace or new_workspace(tokens * top_k, inter, hidden, x.device, configs)
    expert_gemms(x, topk_weights, topk_ids, w13, w2, slots, configs, ws)
    if configs[0].backend == "cuda":
        from moet.kernels.cuda import combine_pairs

        return combine_pairs(ws.pair_out[0], tokens, top_k)
    return combine(ws.pair_out, tokens, top_k, x.dtype)
