"""The CUDA C++ decode kernels (kernels/moe_decode.cu): load their ahead-of-time cubin, launch them.

The cubins are built by kernels/build.py (nvcc, sm_90a and sm_120a) into kernels/build/ or the
directory named by MOET_KERNELS_DIR. They are loaded through the CUDA driver API (ctypes over
libcuda, which every CUDA install has) and launched on PyTorch's current stream, so the launches
are captured by CUDA graphs like any other kernel.
"""

from __future__ import annotations

import ctypes
import os
import re
from functools import cache, lru_cache
from pathlib import Path

import torch

from moet.kernels.layout import StackedWeights

WARPS = 4  # kernels/moe_decode.cu WARPS
MAX_TOKENS = 64  # kernels/moe_decode.cu MAX_ROWS
N_TILES = (1, 2)  # the MAX_NT specialisations built (8 tokens per n-tile; more tokens take more passes)
# Built tunings r<RING>b<BLOCKS>k<KSPLIT>x<XAHEAD> (kernels/moe_decode.cu): RING is the base's; FP4 and the
# refinement, whose chunks hold twice the bytes, use half.
# x: activations loaded per chunk (0), a chunk ahead (1), or staged in shared memory per pass (2).
TUNINGS = ("r8b1k1x0", "r8b1k1x1", "r8b1k2x0", "r4b1k1x1", "r4b2k1x1", "r4b2k2x1", "r8b1k1x2", "r4b2k2x2")
MAX_STAGED_BYTES = 160 << 10  # past this, an x2 tuning runs as its x1 twin (shared memory per block)
# the fastest at T = 1 and 4 on the H200 (base, FP4); the refinement's registers allow one row block
DEFAULT_TUNINGS = {"base": "r8b1k1x0", "fp4": "r4b2k2x1", "refine": "r8b1k1x0"}
TIERS = ("base", "fp4", "refine")
CUBIN = "moe_decode.cubin"
MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


def kernels_dir() -> Path:
    return Path(os.environ.get("MOET_KERNELS_DIR", Path(__file__).resolve().parents[2] / "kernels" / "build"))


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
        raise CudaError(f"{path}: no decode-kernel cubin for sm_{major}{minor}; build it with `python kernels/build.py`")
    with torch.cuda.device(device):
        torch.empty(1, device=f"cuda:{device}")  # makes PyTorch create its (primary) context and make it current
        module = ctypes.c_void_p()
        _check(_driver().cuModuleLoadData(ctypes.byref(module), path.read_bytes()), f"loading {path}")
    return module


@cache
def _function(device: int, name: str, shared: int) -> ctypes.c_void_p:
    """The kernel, allowed `shared` bytes of dynamic shared memory (past 48 KiB this must be asked for)."""
    func = ctypes.c_void_p()
    _check(_driver().cuModuleGetFunction(ctypes.byref(func), _module(device), name.encode()), f"kernel {name}")
    _check(_driver().cuFuncSetAttribute(func, MAX_DYNAMIC_SHARED, shared), f"shared memory of {name}")
    return func


def staged_bytes(tokens: int, k: int) -> int:
    """Dynamic shared memory of an x2 launch: the pass's activation rows, 2K + 16 bytes each."""
    return min(tokens, 8 * n_tiles(tokens)) * (2 * k + 16)


def available(device: int | None = None) -> bool:
    """True when CUDA device `device` (default: the current one) exists and the decode cubin for it loads."""
    if not torch.cuda.is_available():
        return False
    try:
        _module(torch.cuda.current_device() if device is None else device)
    except (CudaError, OSError):
        return False
    return True


def n_tiles(tokens: int) -> int:
    """MAX_NT for `tokens` tokens: one n-tile up to 8, else two (an expert with more takes more passes)."""
    if tokens > MAX_TOKENS:
        raise ValueError(f"the decode kernels serve at most {MAX_TOKENS} tokens, got {tokens}")
    return 1 if tokens <= 8 else 2


def kernel_name(tier: str, scale_block: int, stage: int, tokens: int, tuning: str) -> str:
    """The entry point of kernels/moe_decode.cu for this call."""
    ring, rest = re.fullmatch(r"r(\d+)(b\d+k\d+x\d)", tuning).groups()
    if tier != "base":  # FP4 and refinement chunks hold twice the bytes: half the ring
        ring = str(int(ring) // 2)
    return f"moe_decode_{tier}_b{scale_block}_w{stage}_nt{n_tiles(tokens)}_r{ring}{rest}"


def rows_per_cta(tuning: str) -> int:
    """Weight rows one thread block of a tuning covers: 16 per row block, WARPS / KSPLIT warps."""
    blocks, ksplit = re.fullmatch(r"r\d+b(\d+)k(\d+)x\d", tuning).groups()
    return 16 * int(blocks) * WARPS // int(ksplit)


def _launch(name: str, grid: tuple[int, int], shared: int, args: list, device: int) -> None:
    storage = []
    for a in args:
        if isinstance(a, torch.Tensor):
            storage.append(ctypes.c_void_p(a.data_ptr()))
        else:
            storage.append(ctypes.c_int(a))
    params = (ctypes.c_void_p * len(storage))(*[ctypes.addressof(s) for s in storage])
    stream = ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)
    _check(
        _driver().cuLaunchKernel(_function(device, name, shared), grid[0], grid[1], 1, WARPS * 32, 1, 1, shared, stream, params, None),
        f"launching {name}",
    )


def _operands(w: StackedWeights, tier: str) -> list[torch.Tensor]:
    """words, refinement words (first, second plane; the words again for other tiers), scales."""
    words = w.mma_fp4 if tier == "fp4" else w.mma_words
    if words is None or w.mma_scales is None or (tier == "refine" and w.mma_refine is None):
        raise ValueError(f"these weights carry no decode-kernel layout for tier {tier!r} (from_stored(..., mma=True))")
    refine_a, refine_b = w.mma_refine if tier == "refine" else (words, words)
    return [words, refine_a, refine_b, w.mma_scales]


def decode_gemms(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: StackedWeights,
    w2: StackedWeights,
    tier: str,
    act: torch.Tensor,
    pair_out: torch.Tensor,
    tuning: str | None = None,
) -> None:
    """act[pair] = SiLU(gate)·up (bf16 [T·k, I]); pair_out[pair] = w2 · act[pair] × routing weight (f32 [T·k, H])."""
    if tier not in TIERS:
        raise ValueError(f"the decode kernels run the tiers {TIERS}, not {tier!r}")
    tuning = tuning or DEFAULT_TUNINGS[tier]
    tokens, top_k = topk_ids.shape
    _, n13, hidden = w13.shape
    _, n2, inter = w2.shape
    rows = rows_per_cta(tuning)
    if n13 % rows or n2 % rows or hidden % 128 or inter % 128:
        raise ValueError(f"tuning {tuning} needs rows divisible by {rows} and K by 128 (w13 {n13}×{hidden}, w2 {n2}×{inter})")
    device = x.device.index or 0
    pairs = tokens * top_k
    for stage, w, inp, out, n, k in ((13, w13, x, act, n13, hidden), (2, w2, act, pair_out, n2, inter)):
        shared, launch_tuning = 0, tuning
        if tuning.endswith("x2"):
            shared = staged_bytes(tokens, k)
            if shared > MAX_STAGED_BYTES:
                shared, launch_tuning = 0, tuning[:-1] + "1"
        name = kernel_name(tier, w.block, stage, tokens, launch_tuning)
        grid = (pairs, n // rows)
        args = [inp, out, *_operands(w, tier), w.row_scale, topk_ids, topk_weights, tokens, top_k, n, k]
        _launch(name, grid, shared, args, device)
