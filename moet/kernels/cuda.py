"""The CUDA C++ decode kernels (moet/kernels/src/moe_decode.cu): load their ahead-of-time cubin, launch them.

The cubins are built by scripts/build_kernels.py (nvcc, sm_90a and sm_120a) into moet/kernels/cubins/ or the
directory named by MOET_KERNELS_DIR. They are loaded through the CUDA driver API (ctypes over
libcuda, which every CUDA install has) and launched on PyTorch's current stream, so the launches
are captured by CUDA graphs like any other kernel.
"""

from __future__ import annotations

import ctypes
import os
import re
from importlib import resources
from functools import cache, lru_cache
from pathlib import Path

import torch

from moet.kernels.glue import max_blocks
from moet.kernels.layout import Fp4Slots, StackedWeights

WARPS = 4  # moet/kernels/src/moe_decode.cu WARPS
PASS_ROWS = 8  # moet/kernels/src/moe_decode.cu PASS_ROWS: the pairs of one expert a pass holds (one n-tile)
# The oracle's limit for these kernels where no Gluon prefill runs (H100 2026-12-06, the pass grid, docs/KERNELS.md
# "Decode: the pass grid"): at 512 tokens the Triton kernels took 1.75-1.84× their time on the bench's routing and
# 0.97-1.03× where one expert takes 90% of the tokens; at 1,024 1.03-1.04× and 0.77-0.81×.
MAX_TOKENS = 512
# Up to here one block per (token, slot) pair, the first naming an expert serves it (no launch before the GEMMs); past
# it one block per pass (the pass grid): moe_pass_grid sorts the pairs by expert in runs of PASS_ROWS, so the passes of
# an expert that takes many tokens run side by side. At 32-64 tokens the pass grid took 0.89-0.97 of the pair grid's
# time on the bench's routing and 0.66-0.90 on skewed routing; at 16 0.995-1.03 and 0.86-0.96 (H100 2026-12-06).
PAIR_GRID_TOKENS = 16
# Built tunings "<base>_<FP4>", each r<RING>b<BLOCKS>k<KSPLIT>x<XAHEAD> (moet/kernels/src/moe_decode.cu): the
# default (the fastest measured per tier on the H200, 2026-12-02), then each sweep tuning for both
# tiers with the same bytes in flight (an FP4 chunk is twice a base chunk: half the ring).
# x: activations loaded per chunk (0), a chunk ahead (1), staged in shared memory per pass (2), or staged with the
# 2-bit ring refilled by halves from a half-filled prologue (3). A part "_o<N>" asks ptxas for N blocks per SM
# (fewer registers, more resident warps; default 4); "_s" streams row blocks (streamed()); a last part "_c<N>" caps a
# staged pass at N activation rows (pass_cap(), a launch argument).
DEFAULT_TUNING = "r8b1k1x0_r2b2k2x1"
# Per stage (stage_tuning; H100 sweep 2026-12-05, docs/KERNELS.md), one n-tile (8 tokens a pass) at every token count:
# K split over two warps at 80 registers, six blocks per SM, where the stage's grid fits one wave of them (its 2-bit
# body staged with a ring of six by halves since 2026-12-07: DeepSeek-V4-Flash T = 1 7% faster on an H100 than the
# ring of four with activations from global memory, docs/KERNELS.md "Decode: a ring of six by halves in the one-wave
# grid"; its FP4 body keeps them from global memory), and the pass's staged rows fit WIDE_STAGED_BYTES; else the
# activations staged in shared memory, where a pass's rows take at most 64 KiB (three blocks per SM; with the 2026-12-05
# bit layout Kimi-K2's w13 at T = 4, 57 KB, ran 5% faster staged); else the default. An expert with more than 8 tokens
# takes more passes, each reading its rows; still, one n-tile took 0.79-0.98 of the time of two with the default tuning
# at 9-64 tokens and 0.52-0.87 of four with r8b1k1x0_r4b1k1x0 at 128-2,048 (H100 2026-12-06, docs/KERNELS.md "Decode:
# one n-tile at every token count").
WIDE_TUNING, WIDE_BLOCKS_PER_SM = "r6b1k2x3_r2b1k2x0_o6", 6
# Six such blocks an SM hold 6 × (their staged rows + 6,160 B of static shared memory + 1 KiB the driver keeps a block)
# within the SM's 228 KiB (sm_90): staged rows of at most 31.7 KB; this leaves a margin (a GPU test asks the driver's
# occupancy answer, resident_blocks, for six at this size).
WIDE_STAGED_BYTES = 24 << 10
STAGED_TUNING, STAGED_PICK_BYTES = "r8b1k1x2_r4b1k1x2", 64 << 10
# In the pair grid, where a pass's min(T, 8) staged rows would take more than CAPPED_FROM_BYTES, the staged pick holds
# CAPPED_ROWS rows a pass ("_c3", pass_cap): four blocks an SM where more rows held three (or, past STAGED_PICK_BYTES,
# sent w13 to the default tuning), and an expert serving more of the step's tokens takes another pass. H100 2026-12-07
# 22:58 (docs/KERNELS.md "Decode: a staged pass capped at three rows"): 2-bit GEMMs 3-8% faster at DeepSeek-V4-Flash
# T = 7-16 and Kimi-K2 T = 4-16, FP4 -10.5% to +1% (Kimi-K2 T = 16 +1.8% a layer); DeepSeek-V4-Flash T = 6 -0.8% in
# 2-bit, -10.5% in FP4 (T = 5 not measured); 2-bit bit-identical, FP4 where the pick staged. DeepSeek-V4-Flash T = 4
# (32,832 B) moved by 0.4% at most, so it keeps its four rows. Two rows lost where the bench's routing gives experts 3-4
# tokens (+3-7%); four or six rows (49 KB, or three blocks an SM) lost in FP4 (+4-12%).
CAPPED_FROM_BYTES, CAPPED_ROWS = 40 << 10, 3
# The staged pick with each warp streaming several row blocks (streamed(), stream_rows()) in the pair grid where a row
# block is at most STREAMED_MAX_K inputs (16 chunks, two fills of the ring of eight: w2 of every geometry): a fill and
# an epilogue once a warp, not once a row block, and the grid one wave. H100 2026-12-07 15:34 and 16:09
# (docs/KERNELS.md "Decode: streamed row blocks in w2"): 2-bit GEMMs 1-6% faster at 8 of the 9 shapes of several waves
# measured (T = 2-16), FP4 -1.4% to +3.3%; w13 (32-56 chunks a row block) streamed was 4-40% slower, and w2 in the pass
# grid (T = 64) 13-32%.
STREAMED_TUNING, STREAMED_MAX_K = STAGED_TUNING + "_s", 2048
TUNINGS = (
    DEFAULT_TUNING, "r8b1k1x0_r4b1k1x0", "r8b1k1x1_r4b1k1x1", "r8b1k2x0_r4b1k2x0", "r4b1k1x1_r2b1k1x1",
    "r4b2k1x1_r2b2k1x1", "r4b2k2x1_r2b2k2x1", "r8b1k1x2_r4b1k1x2", "r4b2k2x2_r2b2k2x2",
    WIDE_TUNING, STREAMED_TUNING,
)
# The most shared memory a staging launch may ask, or less where the GPU allows a block less (staged_shared_limit);
# past it an x2 tuning runs as its x1 twin, an x3 one is refused.
STAGED_SHARED_LIMIT = 160 << 10
CUBIN = "moe_decode.cubin"
FUNC_SHARED = 1  # CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES: the entry point's static shared memory
MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
SHARED_PER_BLOCK_OPTIN = 97  # CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
_TUNING = re.compile(r"r(\d+)b(\d+)k(\d+)x(\d)")
_CAP = re.compile(r"_c(\d+)$")
_STREAM = re.compile(r"_s(\d*)(?=_c\d+$|$)")


def kernels_dir() -> Path:
    """MOET_KERNELS_DIR (the Nix package's cubins), else the package's own cubins/ (built in place or shipped in the wheel)."""
    if "MOET_KERNELS_DIR" in os.environ:
        return Path(os.environ["MOET_KERNELS_DIR"])
    return Path(str(resources.files("moet.kernels") / "cubins"))


def cubin_path(major: int, minor: int) -> Path:
    return kernels_dir() / f"sm_{major}{minor}a" / CUBIN


class CudaError(RuntimeError):
    """A CUDA driver call failed, or the cubin for this GPU is missing."""


@lru_cache(maxsize=1)
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _check(status: int, what: str) -> None:
    if status != 0:
        message = ctypes.c_char_p()
        _driver().cuGetErrorString(status, ctypes.byref(message))
        raise CudaError(f"{what}: CUDA error {status} ({(message.value or b'?').decode()})")


@cache
def _module(device: int) -> ctypes.c_void_p:
    """The decode cubin loaded into `device`'s primary context (made current by PyTorch)."""
    major, minor = torch.cuda.get_device_capability(device)
    path = cubin_path(major, minor)
    if not path.is_file():
        raise CudaError(f"{path}: no decode-kernel cubin for sm_{major}{minor}; build it with `python scripts/build_kernels.py`")
    with torch.cuda.device(device):
        torch.empty(1, device=f"cuda:{device}")  # makes PyTorch create its (primary) context and make it current
        module = ctypes.c_void_p()
        _check(_driver().cuModuleLoadData(ctypes.byref(module), path.read_bytes()), f"loading {path}")
    return module


@cache
def _function(device: int, name: str) -> ctypes.c_void_p:
    """The kernel; one that stages activations (an x2 or x3 half) is allowed the most dynamic shared memory the GPU
    lets it ask, at most STAGED_SHARED_LIMIT (past 48 KiB this must be asked for; the attribute belongs to the kernel,
    so it is set once, to the most: dynamic_shared_limit)."""
    func = ctypes.c_void_p()
    _check(_driver().cuModuleGetFunction(ctypes.byref(func), _module(device), name.encode()), f"kernel {name}")
    if stages_activations(name):
        static = ctypes.c_int()
        _check(_driver().cuFuncGetAttribute(ctypes.byref(static), FUNC_SHARED, func), f"static shared memory of {name}")
        limit = dynamic_shared_limit(block_shared_optin(device), static.value)
        _check(_driver().cuFuncSetAttribute(func, MAX_DYNAMIC_SHARED, limit), f"shared memory of {name} ({limit} B)")
    return func


@cache
def block_shared_optin(device: int) -> int:
    """The most shared memory one block may take on CUDA device `device` when it asks (227 KiB on sm_90, 99 KiB on
    sm_120): the driver's CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN."""
    ordinal, optin = ctypes.c_int(), ctypes.c_int()
    _check(_driver().cuDeviceGet(ctypes.byref(ordinal), device), f"device {device}")
    _check(_driver().cuDeviceGetAttribute(ctypes.byref(optin), SHARED_PER_BLOCK_OPTIN, ordinal), f"device {device}")
    return optin.value


def dynamic_shared_limit(optin: int, static: int) -> int:
    """Dynamic shared memory a staging entry point may ask on a GPU that gives a block at most `optin` bytes, of which
    its static shared memory takes `static`: STAGED_SHARED_LIMIT on sm_90 (227 KiB a block), less on sm_120 (99 KiB),
    where asking STAGED_SHARED_LIMIT is refused by the driver (CUDA_ERROR_INVALID_VALUE)."""
    return min(STAGED_SHARED_LIMIT, optin - static)


@cache
def staged_shared_limit(device: int, name: str) -> int:
    """The dynamic shared memory a launch of staging entry point `name` may ask on `device` (what _function set)."""
    limit = ctypes.c_int()
    _check(_driver().cuFuncGetAttribute(ctypes.byref(limit), MAX_DYNAMIC_SHARED, _function(device, name)),
           f"shared memory of {name}")
    return limit.value


@cache
def resident_blocks(device: int, name: str, shared: int) -> int:
    """Blocks of kernel `name` with `shared` bytes of dynamic shared memory that one SM holds at once: the driver's
    occupancy answer, from the cubin's registers and static shared memory (so no figure is copied from the source)."""
    blocks = ctypes.c_int()
    _check(_driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(blocks), _function(device, name),
                                                                 WARPS * 32, ctypes.c_size_t(shared)),
           f"occupancy of {name}")
    return blocks.value


def pass_cap(tuning: str) -> int:
    """Activation rows a staged pass of `tuning` holds: N for a tuning ending in "_c<N>" (1 ≤ N ≤ PASS_ROWS), else
    PASS_ROWS. Fewer rows take less shared memory a block, so more blocks fit an SM; an expert serving more of the
    step's tokens takes more passes, each reading its rows again. A kernel argument: no entry point of its own."""
    match = _CAP.search(tuning)
    if match is None:
        return PASS_ROWS
    cap = int(match.group(1))
    if not 1 <= cap <= PASS_ROWS:
        raise ValueError(f"tuning {tuning}: a staged pass holds 1 to {PASS_ROWS} rows, not {cap}")
    return cap


def staged_bytes(tokens: int, k: int, cap: int = PASS_ROWS) -> int:
    """Dynamic shared memory of a staging launch (x2, x3): a pass's activation rows (at most `cap`, pass_cap), 2K + 16
    bytes each; an expert with more pairs than that takes more passes."""
    return min(tokens, cap) * (2 * k + 16)


def available(device: int | None = None) -> bool:
    """True when CUDA device `device` (default: the current one) exists and the decode cubin for it loads."""
    if not torch.cuda.is_available():
        return False
    try:
        _module(torch.cuda.current_device() if device is None else device)
    except (CudaError, OSError):
        return False
    return True


def stage_tuning(tokens: int, top_k: int, n: int, k: int, sms: int) -> str:
    """The tuning of one stage (N rows, K inputs) at `tokens` tokens on a GPU of `sms` SMs (see WIDE_TUNING): the
    wide one only where the pair grid's blocks fit one wave of six per SM, their staged rows included; the staged one
    streamed in the pair grid where a row block is short (STREAMED_TUNING), and its pass capped at CAPPED_ROWS rows
    there where more would pass CAPPED_FROM_BYTES."""
    pair_grid = tokens <= PAIR_GRID_TOKENS
    one_wave = tokens * top_k * (n // rows_per_cta(WIDE_TUNING)) <= sms * WIDE_BLOCKS_PER_SM
    staged, cap = staged_bytes(tokens, k), ""
    if pair_grid and one_wave and staged <= WIDE_STAGED_BYTES:
        return WIDE_TUNING
    if pair_grid and staged > CAPPED_FROM_BYTES:
        staged, cap = staged_bytes(tokens, k, CAPPED_ROWS), f"_c{CAPPED_ROWS}"
    if staged > STAGED_PICK_BYTES:
        return DEFAULT_TUNING
    streams = pair_grid and k <= STREAMED_MAX_K and rings_divide(STREAMED_TUNING, k)
    return (STREAMED_TUNING if streams else STAGED_TUNING) + cap


def kernel_name(scale_block: int, stage: int, tuning: str) -> str:
    """The entry point of moet/kernels/src/moe_decode.cu for this call (a streamed one takes its row count as an
    argument, a capped one its pass's rows)."""
    return f"moe_decode_b{scale_block}_w{stage}_{_STREAM.sub('_s', _CAP.sub('', tuning))}"


def tuning_halves(tuning: str) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int]]:
    """(RING, BLOCKS, KSPLIT, XAHEAD) of a tuning's 2-bit base half and of its FP4 half."""
    base, fp4 = (tuple(map(int, _TUNING.fullmatch(part).groups())) for part in tuning.split("_")[:2])
    return base, fp4


def streamed(tuning: str) -> int | None:
    """None for a tuning whose warps own one row block each; for "_s" (each warp streams its row blocks one after
    another, the ring running on across them) 0, "take enough to fill one wave", and for "_s<N>" N."""
    match = _STREAM.search(tuning)
    return None if match is None else int(match.group(1) or 0)


def rings_divide(tuning: str, k: int) -> bool:
    """True when K / 128 is a multiple of each half's ring: a streamed tuning's ring runs on from one row block into
    the next only then (chunk c of a warp's run sits in slot c % RING)."""
    return not any((k // 128) % ring for ring, *_ in tuning_halves(tuning))


def stream_rows(asked: int, pair_blocks: int, groups: int, wave: int) -> int:
    """Row blocks per warp of a streamed stage: `asked`, or (0) the fewest with which the grid of `pair_blocks` ×
    ceil(groups / rows) blocks fits one wave of `wave` blocks (the SMs × the blocks one holds, resident_blocks)."""
    if asked:
        return asked
    return next((r for r in range(1, groups) if pair_blocks * -(-groups // r) <= wave), groups)


def rows_per_cta(tuning: str) -> int:
    """Weight rows one thread block of a tuning covers: 16 per row block, WARPS / KSPLIT warps (both tiers alike); a
    streamed tuning's warps cover that many times its row blocks each."""
    rows = {16 * blocks * WARPS // ksplit for _, blocks, ksplit, _ in tuning_halves(tuning)}
    if len(rows) != 1:
        raise ValueError(f"tuning {tuning}: the base and FP4 halves cover different rows per block")
    return rows.pop()


def stages_activations(tuning: str) -> bool:
    """True when a half of `tuning` (or of a kernel name) copies its activations into shared memory (x2, x3)."""
    return any(int(x) >= 2 for *_, x in _TUNING.findall(tuning))


def _stage_launch(tuning: str, tokens: int, k: int, limit: int) -> tuple[int, str]:
    """(dynamic shared bytes, tuning to launch): a staging half stages the activations unless they pass `limit`
    (staged_shared_limit)."""
    if not stages_activations(tuning):
        return 0, tuning
    shared = staged_bytes(tokens, k, pass_cap(tuning))
    if shared <= limit:
        return shared, tuning
    twin = re.sub(r"x[23]", "x1", _CAP.sub("", tuning))
    if twin not in TUNINGS:  # stage_tuning picks an x3 tuning only where its rows fit; a config may ask for more
        raise ValueError(f"tuning {tuning}: {shared} B of staged activations (K {k}) pass the {limit} B this GPU "
                         f"allows and no x1 twin ({twin}) is built; pick one of moet.kernels.cuda.TUNINGS without x3")
    return 0, twin


class _LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute (cuda.h): an id, padding to 8 bytes, a 64-byte value union."""

    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (cuda.h)."""

    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


def _launch(
    name: str, grid: tuple[int, int], shared: int, args: list, device: int, overlap: bool = False, threads: int = WARPS * 32
) -> None:
    """Launch on PyTorch's current stream. overlap: a programmatic dependent launch (sm_90+), which may start
    while the previous kernel drains; the kernel waits (griddepcontrol.wait) before it reads that kernel's output."""
    storage = []
    for a in args:
        if isinstance(a, torch.Tensor):
            storage.append(ctypes.c_void_p(a.data_ptr()))
        elif a is None:
            storage.append(ctypes.c_void_p(0))
        else:
            storage.append(ctypes.c_int(a))
    params = (ctypes.c_void_p * len(storage))(*[ctypes.addressof(s) for s in storage])
    stream = ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)
    attr = _LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
    config = _LaunchConfig((grid[0], grid[1], 1), (threads, 1, 1), shared, stream, ctypes.pointer(attr), int(overlap))
    _check(_driver().cuLaunchKernelEx(ctypes.byref(config), _function(device, name), params, None), f"launching {name}")


MAX_EXPERTS = 1024  # moet/kernels/src/moe_decode.cu MAX_EXPERTS: moe_pass_grid's shared counts


def pass_grid(topk_ids: torch.Tensor, experts: int, block: int = PASS_ROWS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """moet.kernels.glue.align's (sorted pair ids, expert of each block, padded length) in one launch of
    moe_pass_grid (align is a chain of torch ops, a launch each); an expert's pairs may come in another order inside
    its run (shared-memory atomics)."""
    if experts > MAX_EXPERTS:
        raise ValueError(f"the CUDA decode kernels take at most {MAX_EXPERTS} experts a layer, not {experts}")
    pairs = topk_ids.numel()
    blocks = max_blocks(pairs, experts, block)
    sorted_ids = torch.empty(blocks * block, dtype=torch.int32, device=topk_ids.device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=topk_ids.device)
    n_padded = torch.empty(1, dtype=torch.int32, device=topk_ids.device)
    _launch("moe_pass_grid", (1, 1), 0, [topk_ids, pairs, experts, block, blocks, sorted_ids, block_expert, n_padded],
            topk_ids.device.index or 0, threads=1024)
    return sorted_ids, block_expert, n_padded


def decode_gemms(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: StackedWeights,
    w2: StackedWeights,
    slots: Fp4Slots | None,
    act: torch.Tensor,
    pair_out: torch.Tensor,
    tunings: tuple[str, str] = (DEFAULT_TUNING, DEFAULT_TUNING),
    overlap: bool = True,
) -> None:
    """act[pair] = SiLU(gate)·up (bf16 [T·k, I]); pair_out[pair] = w2 · act[pair] × routing weight (f32 [T·k, H]).

    Experts with an entry ≥ 0 in `slots.table` read their FP4 copy from that slot, in the same launch.
    overlap: the w2 launch starts while the w13 launch drains (its weights in flight before it waits).
    """
    tokens, top_k = topk_ids.shape
    device = x.device.index or 0
    if tokens > PAIR_GRID_TOKENS:
        passes = pass_grid(topk_ids, w13.shape[0])
        blocks_x = passes[1].numel()
    else:
        passes = (None, None, None)
        blocks_x = tokens * top_k
    table = None if slots is None else slots.table
    for stage, w, inp, out, tuning in ((13, w13, x, act, tunings[0]), (2, w2, act, pair_out, tunings[1])):
        _, n, k = w.shape
        rows = rows_per_cta(tuning)
        if n % rows or k % 128:
            raise ValueError(f"tuning {tuning} needs rows divisible by {rows} and K by 128 (w{stage} {n}×{k})")
        groups, seq, asked = n // rows, 1, streamed(tuning)
        if asked is not None and not rings_divide(tuning, k):
            raise ValueError(f"tuning {tuning} streams its row blocks: K / 128 must be a multiple of each ring "
                             f"(w{stage} K {k})")
        limit = staged_shared_limit(device, kernel_name(w.block, stage, tuning)) if stages_activations(tuning) else 0
        shared, launch_tuning = _stage_launch(tuning, tokens, k, limit)
        name = kernel_name(w.block, stage, launch_tuning)
        if asked is not None:
            from moet.kernels.moe import multiprocessors

            wave = multiprocessors(x.device) * resident_blocks(device, name, shared)
            seq = stream_rows(asked, blocks_x, groups, wave)
        fp4 = None if slots is None else (slots.w13 if stage == 13 else slots.w2)
        args = [inp, out, w.words, fp4, table, w.scales, w.row_scale, topk_ids, topk_weights, *passes, tokens, top_k, n, k,
                seq, pass_cap(launch_tuning)]
        _launch(name, (blocks_x, -(-groups // seq)), shared, args, device, overlap=overlap and stage == 2)


def combine_pairs(pair_out: torch.Tensor, tokens: int, top_k: int) -> torch.Tensor:
    """bf16 [T, H]: each token's k rows of pair_out (f32 [T·k, H], decode_gemms' output) summed in slot order,
    in one launch that starts while the w2 launch drains."""
    hidden = pair_out.shape[1]
    out = torch.empty(tokens, hidden, dtype=torch.bfloat16, device=pair_out.device)
    grid = (-(-hidden // (4 * WARPS * 32)), tokens)
    _launch("moe_combine_bf16", grid, 0, [pair_out, out, tokens, top_k, hidden], pair_out.device.index or 0, overlap=True)
    return out
