"""The fused MoE forward on GPU: w13 GEMM + SiLU·mul, w2 GEMM × routing weight, fixed-order combine.

One weight layout (moet.kernels.layout) for every kernel; the backend (the CUDA decode kernels, the
Triton kernels, or for long prefills the unpacked path: each routed expert decoded once into a bf16
scratch chunk and multiplied by torch._grouped_mm) is chosen by moet.kernels.oracle and given here,
through `backend` or the configs.
An optional `Fp4Slots` mixes tiers per expert inside the same launches. Nothing synchronises with the
host, so the whole forward can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moet.kernels.gemm import moe_gemm_kernel, silu_mul_kernel, unpack_kernel, unpacked_down_kernel, unpacked_silu_kernel
from moet.kernels.glue import align, combine
from moet.kernels.layout import Fp4Slots, StackedWeights
from moet.kernels.oracle import MoeBackend, select_moe_backend

DECODE_MAX_TOKENS = 64  # up to here every program covers all tokens of its expert (ROUTE 0)
TOPK_GUESS = 6  # experts per token assumed when sizing the decode grid (the 2026-12-02 H200 runs used 6 for all)
TARGET_PROGRAMS = 1024  # ≈ 8 programs of 4 warps per SM on a 132-SM H200
UNPACK_CHUNK_MIB = 512  # bf16 scratch per projection and buffer of the unpacked path


@dataclass(frozen=True)
class GemmConfig:
    """Tiles of one launch: 16-row blocks per program, BM tokens; warps, pipeline stages, K slices.

    backend "cuda": the CUDA decode kernels with the built `tuning` (moet.kernels.cuda.TUNINGS); the
    tile fields then only describe it. backend "unpacked": `blocks`/`num_warps` tile the unpack kernel,
    `num_stages` is its number of scratch buffers (2: the next chunk is unpacked on a side stream while
    this one multiplies), each `chunk_mib` MiB per projection.
    """

    blocks: int
    bm: int
    num_warps: int
    num_stages: int
    split: int = 1
    backend: str = "triton"
    tuning: str = ""
    chunk_mib: int = 0

    @property
    def rows(self) -> int:
        """Weight rows of one program: 16 per block (w13: 8 gate + the matching 8 up rows per block)."""
        return 16 * self.blocks


def cuda_config(tuning: str) -> GemmConfig:
    from moet.kernels.cuda import WARPS, rows_per_cta

    return GemmConfig(blocks=rows_per_cta(tuning) // 16, bm=8, num_warps=WARPS, num_stages=0, backend="cuda", tuning=tuning)


def default_configs(tokens: int, hidden: int, inter: int, backend: str = "triton") -> tuple[GemmConfig, GemmConfig]:
    """(w13, w2) tiles. Triton decode: small register footprint (several programs per SM to hide latency)
    and K split until about TARGET_PROGRAMS programs stream weights; prefill: tiles that feed the tensor
    cores. backend="cuda" (decode only): the CUDA kernels with their default tuning.
    """
    if backend == "unpacked":
        unpack = GemmConfig(blocks=4, bm=0, num_warps=4, num_stages=2, backend="unpacked", chunk_mib=UNPACK_CHUNK_MIB)
        return unpack, unpack
    if backend == "cuda" and tokens <= DECODE_MAX_TOKENS:
        from moet.kernels.cuda import DEFAULT_TUNING

        return cuda_config(DEFAULT_TUNING), cuda_config(DEFAULT_TUNING)
    if tokens > DECODE_MAX_TOKENS:
        return GemmConfig(blocks=8, bm=64, num_warps=8, num_stages=3), GemmConfig(blocks=8, bm=64, num_warps=8, num_stages=3)
    bm = max(16, triton_next_pow2(tokens))
    out = []
    for blocks, n_out, k in ((8, inter, hidden), (8, hidden, inter)):  # 64-row dots: wgmma on sm_90a
        programs = tokens * TOPK_GUESS * n_out // (16 * blocks)
        split = 1
        while programs * split < TARGET_PROGRAMS and (k // 128) % (2 * split) == 0 and split < 8:
            split *= 2
        out.append(GemmConfig(blocks=blocks, bm=bm, num_warps=4, num_stages=3, split=split))
    return out[0], out[1]


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
    if aligned is None:
        route, grid = 0, (tokens * top_k, n_w // rows, config.split)
        sorted_ids = block_expert = n_padded = topk_ids
    else:
        route = 1
        sorted_ids, block_expert, n_padded = aligned
        grid = (block_expert.numel(), n_w // rows, config.split)
    moe_gemm_kernel[grid](
        x, out, w.words, w.scales, w.row_scale,
        w.words if table is None else table, w.words if fp4 is None else fp4,
        topk_ids, topk_weights, sorted_ids, block_expert, n_padded,
        tokens, n_out, k, top_k,
        STAGE=stage, ROUTE=route, SCALE_B=w.block, HAS_SLOTS=table is not None,
        BLOCKS=config.blocks, BM=config.bm,
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
    slots: Fp4Slots | None,
    configs: tuple[GemmConfig, GemmConfig],
    ws: Workspace,
) -> None:
    """Both expert GEMMs (and the SiLU·mul between them) into ws.pair_out; no combine."""
    c13, c2 = configs
    if c13.backend == "cuda":
        from moet.kernels.cuda import decode_gemms

        decode_gemms(x, topk_weights, topk_ids, w13, w2, slots, ws.act, ws.pair_out[0], c13.tuning)
        return
    if c13.backend == "unpacked":
        unpacked_expert_gemms(x, topk_weights, topk_ids, w13, w2, slots, c13, ws)
        return
    table = None if slots is None else slots.table
    fp4_13 = None if slots is None else slots.w13
    fp4_2 = None if slots is None else slots.w2
    experts = w13.shape[0]
    aligned13 = aligned2 = None
    if topk_ids.shape[0] > DECODE_MAX_TOKENS:
        aligned13 = align(topk_ids, experts, c13.bm)
        aligned2 = aligned13 if c2.bm == c13.bm else align(topk_ids, experts, c2.bm)
    if ws.gate_up is None:
        expert_gemm(13, x, ws.act, w13, fp4_13, table, topk_ids, topk_weights, c13, aligned13)
    else:
        expert_gemm(13, x, ws.gate_up, w13, fp4_13, table, topk_ids, topk_weights, c13, aligned13)
        pairs, inter = ws.act.shape
        silu_mul_kernel[(pairs, inter // _row_block(inter))](ws.gate_up, ws.act, pairs, inter, SPLIT=c13.split,
                                                             BLOCK=_row_block(inter))
    expert_gemm(2, ws.act, ws.pair_out, w2, fp4_2, table, topk_ids, topk_weights, c2, aligned2)


def unpacked_expert_gemms(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: StackedWeights,
    w2: StackedWeights,
    slots: Fp4Slots | None,
    config: GemmConfig,
    ws: Workspace,
) -> None:
    """Both expert GEMMs of a long prefill into ws.pair_out[0], each routed expert's weights decoded once.

    Pairs are sorted by expert; the routed experts go in chunks of at most `config.chunk_mib` MiB of bf16
    w13 weights: unpack_kernel decodes a chunk's w13 and w2 into scratch (exact values, block scales
    applied), torch._grouped_mm multiplies the chunk's rows, and two small kernels apply the row scales,
    SiLU·mul and the routing weights in f32. With two buffers (`config.num_stages`) the next chunk is
    unpacked on a side stream while this one multiplies. ws.act holds the activations in sorted order.
    Reads the experts' pair counts to the host once (a sync): never under CUDA-graph capture
    (moet.kernels.oracle does not choose it there).
    """
    tokens, top_k = topk_ids.shape
    experts, n13, hidden = w13.shape
    inter = n13 // 2
    flat = topk_ids.flatten()
    order = torch.argsort(flat, stable=True)
    row_expert = flat[order].contiguous()
    row_pair = order.to(torch.int32)
    counts = torch.bincount(flat, minlength=experts).tolist()
    x_sorted = x.index_select(0, order // top_k)
    group = max(1, (config.chunk_mib << 20) // (n13 * hidden * 2))
    active = [e for e in range(experts) if counts[e]]
    chunks = [active[i : i + group] for i in range(0, len(active), group)]
    host: list[int] = []  # per chunk: its experts, then their cumulative row counts (grouped_mm's offsets)
    for chunk in chunks:
        host += chunk + torch.tensor([counts[e] for e in chunk]).cumsum(0).tolist()
    index = torch.tensor(host, dtype=torch.int32).to(x.device)
    starts = [2 * sum(map(len, chunks[:c])) for c in range(len(chunks))]
    buffers = [(torch.empty(group, n13, hidden, dtype=torch.bfloat16, device=x.device),
                torch.empty(group, hidden, inter, dtype=torch.bfloat16, device=x.device))
               for _ in range(min(config.num_stages, len(chunks)))]
    fp4 = (None, None) if slots is None else (slots.w13, slots.w2)
    table = None if slots is None else slots.table

    def unpack(c: int) -> None:
        ids = index[starts[c] : starts[c] + len(chunks[c])]
        for w, planes, out, gate_up in zip((w13, w2), fp4, buffers[c % len(buffers)], (True, False)):
            _, n_w, k = w.shape
            unpack_kernel[(len(chunks[c]), n_w // (16 * config.blocks), k // 128)](
                w.words, w.scales, w.words if table is None else table, w.words if planes is None else planes, ids, out,
                n_w, k, GATE_UP=gate_up, SCALE_B=w.block, HAS_SLOTS=table is not None, BLOCKS=config.blocks,
                num_warps=config.num_warps,
            )

    overlap = x.is_cuda and len(buffers) > 1
    if overlap:
        main, side = torch.cuda.current_stream(x.device), torch.cuda.Stream(x.device)
        unpacked = [torch.cuda.Event() for _ in chunks]
        consumed = [torch.cuda.Event() for _ in chunks]
        side.wait_stream(main)

    def unpack_on_side(c: int) -> None:
        """Chunk c into its buffer on the side stream, once the chunk that used the buffer before is done."""
        if c >= len(buffers):
            side.wait_event(consumed[c - len(buffers)])
        with torch.cuda.stream(side):
            unpack(c)
            unpacked[c].record(side)

    if overlap:
        unpack_on_side(0)
    row = 0
    for c, chunk in enumerate(chunks):
        if overlap:
            if c + 1 < len(chunks):
                unpack_on_side(c + 1)
            main.wait_event(unpacked[c])
        else:
            unpack(c)
        n = len(chunk)
        offs = index[starts[c] + n : starts[c] + 2 * n]
        rows = sum(counts[e] for e in chunk)
        b13, b2 = buffers[c % len(buffers)]
        h = torch._grouped_mm(x_sorted[row : row + rows], b13[:n].transpose(1, 2), offs=offs)
        act = ws.act[row : row + rows]
        unpacked_silu_kernel[(rows, inter // _row_block(inter))](
            h, act, row_expert[row:], w13.row_scale, inter, BLOCK=_row_block(inter)
        )
        y = torch._grouped_mm(act, b2[:n].transpose(1, 2), offs=offs)
        unpacked_down_kernel[(rows, hidden // _row_block(hidden))](
            y, ws.pair_out[0], row_expert[row:], row_pair[row:], w2.row_scale, topk_weights, hidden,
            BLOCK=_row_block(hidden),
        )
        if overlap:
            consumed[c].record(main)
        row += rows
    if overlap:
        main.wait_stream(side)


def _row_block(n: int) -> int:
    """Columns per program of the row-wise epilogues (n is a multiple of 128, the layout's chunk)."""
    return 512 if n % 512 == 0 else 128


def fused_moe_w2(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: StackedWeights,
    w2: StackedWeights,
    activation: str = "silu",
    slots: Fp4Slots | None = None,
    configs: tuple[GemmConfig, GemmConfig] | None = None,
    workspace: Workspace | None = None,
    backend: MoeBackend | None = None,
) -> torch.Tensor:
    """MoE layer output [T, H] (x's dtype) from bf16 x [T, H] and routing (f32 [T, k], int32 [T, k]).

    Experts with a slot in `slots.table` compute with their FP4 copy, the others with the 2-bit base.
    An id < 0 (a device-cache miss) must not reach the kernels: callers map them to a zero expert.
    `workspace`: buffers from new_workspace with the same configs, e.g. static ones in a graph.
    `backend` (without `configs`): the kernels, by default moet.kernels.oracle.select_moe_backend's.
    """
    if activation != "silu":
        raise NotImplementedError(f"activation {activation!r}: only silu is implemented")
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    inter = w13.shape[1] // 2
    x = x.to(torch.bfloat16).contiguous()
    topk_ids = topk_ids.to(torch.int32).contiguous()
    topk_weights = topk_weights.to(torch.float32).contiguous()
    if configs is None:
        backend = backend or select_moe_backend(x.device, tokens)
        configs = default_configs(tokens, hidden, inter, backend)
    ws = workspace or new_workspace(tokens * top_k, inter, hidden, x.device, configs)
    expert_gemms(x, topk_weights, topk_ids, w13, w2, slots, configs, ws)
    return combine(ws.pair_out, tokens, top_k, x.dtype)
