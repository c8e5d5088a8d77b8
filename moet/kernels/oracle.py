"""Which kernels compute an MoE forward, and the weight layout they read: the one place that decides.

As vLLM's fused-MoE oracle modules (model_executor/layers/fused_moe/oracle/: a backend enum,
`select_*_moe_backend`, `convert_to_*_moe_kernel_format`), a layer's weights are converted once at
load to the layout of its device's backends, and each forward picks its backend here and hands it
to the kernels explicitly:

* `CPU_KERNEL`: the C++ kernel of moet.kernels.cpu over the stored stacked tensors
  (moet.quant.stacked.StackedWeight): the 2-bit base, when the kernel is built;
* `CPU_TORCH`: moet.kernels.cpu's PyTorch path over the same tensors: a call that reads an expert at
  the FP4 tier or carries gpt-oss's biases and swigluoai (the kernel has neither), and every call on a
  machine without the built kernel;
* `CUDA_DECODE`: the CUDA decode kernels (moet.kernels.cuda) for few tokens, when their cubin loads;
* `GLUON_PREFILL`: prefill on an sm_90 GPU under Triton 3.6: the Gluon kernel of moet.kernels.hopper (decode
  overlapped with async wgmma), a launch for the 2-bit base experts and one for the FP4-tier ones;
* `TRITON`: the Triton kernels (moet.kernels.gemm): prefill elsewhere, and decode without a cubin.

The GPU backends read the one mma layout (moet.kernels.layout.StackedWeights), so a step can change
backend without a second copy of the experts.
"""

from __future__ import annotations

from enum import StrEnum

import torch

from moet.kernels import cpu_build
from moet.kernels.layout import StackedWeights, gpu_layer
from moet.quant.stacked import StackedWeight


class MoeBackend(StrEnum):
    CPU_KERNEL = "cpu_kernel"
    CPU_TORCH = "cpu_torch"
    CUDA_DECODE = "cuda"
    GLUON_PREFILL = "gluon"
    TRITON = "triton"


def select_moe_backend(
    device: torch.device, tokens: int, use_fp4: torch.Tensor | None = None, biased: bool = False
) -> MoeBackend:
    """The kernels of one forward of `tokens` tokens on `device`. On CPU, `use_fp4` (bool [E], the experts
    read at the FP4 tier) and `biased` (per-expert biases or swigluoai: moet.kernels.cpu.is_biased) send
    the call to the PyTorch path, as does a missing kernel build; on a GPU both tiers and every activation
    the kernels take run in the same launches, so only the token count decides."""
    if device.type != "cuda":
        if biased or (use_fp4 is not None and bool(use_fp4.any())) or not cpu_build.load():
            return MoeBackend.CPU_TORCH
        return MoeBackend.CPU_KERNEL
    return gpu_backends(device.index, tokens)[0]


# Past this many tokens the Gluon prefill beats the CUDA kernels (H100, 2026-12-06, the pass grid, docs/KERNELS.md
# "Decode: the pass grid"): on the bench's routing Gluon took 1.33× the CUDA kernels' time at 384 tokens in 2-bit and
# 1.12-1.18× in FP4, at 512 1.05-1.06× and 0.89-0.96×, at 1,024 0.57-0.62×. Where one expert takes 90% of the tokens
# Gluon is faster from 256 tokens on (0.64-0.84× at 256-384: it reads a weight tile once per 64 tokens, the CUDA kernels
# once per 8); the oracle sees only the count.
GLUON_PAST_TOKENS = 384


def gpu_backends(index: int | None, tokens: int) -> list[MoeBackend]:
    """The backends able to run a forward of `tokens` tokens on CUDA device `index`, the oracle's pick first:
    the CUDA decode kernels (they run any count) up to GLUON_PAST_TOKENS where the Gluon kernel runs, else up to
    their MAX_TOKENS; the Gluon kernel past DECODE_MAX_TOKENS (aligned prefill blocks only); else Triton, which
    runs everywhere."""
    from moet.kernels import cuda
    from moet.kernels.moe import DECODE_MAX_TOKENS

    cuda_ok = cuda.available(index)
    gluon_ok = tokens > DECODE_MAX_TOKENS and gluon_prefill_available(index)
    able = [b for b, ok in ((MoeBackend.CUDA_DECODE, cuda_ok), (MoeBackend.GLUON_PREFILL, gluon_ok), (MoeBackend.TRITON, True)) if ok]
    if cuda_ok and tokens <= (GLUON_PAST_TOKENS if gluon_ok else cuda.MAX_TOKENS):
        pick = MoeBackend.CUDA_DECODE
    elif gluon_ok:
        pick = MoeBackend.GLUON_PREFILL
    else:
        pick = MoeBackend.TRITON
    return [pick] + [b for b in able if b != pick]


def gluon_prefill_available(index: int | None) -> bool:
    """Whether moet.kernels.hopper's kernel runs on CUDA device `index` (sm_90, Triton 3.6 with Gluon)."""
    try:
        from moet.kernels import hopper
    except ImportError:  # a Triton without Gluon
        return False
    return hopper.available(torch.cuda.current_device() if index is None else index)


def convert_to_moe_kernel_format(
    w13: StackedWeight, w2: StackedWeight, device: torch.device, fp4: bool
) -> tuple[StackedWeight | StackedWeights, StackedWeight | StackedWeights, list[torch.Tensor]]:
    """One layer's stacked experts (on the host) in the layout `device`'s backends read, plus the host
    FP4 copies the GPU pool fills its slots from (empty on CPU, where the FP4 tier stays in the
    stacked tensors and the pool is a mask)."""
    if device.type != "cuda":
        return w13, w2, []
    return gpu_layer(w13, w2, device, fp4)
