"""The MoE forward on CPU over 2-bit / FP4 stacked experts: the C++ kernel, else vectorised PyTorch.

The kernel (moet/kernels/cpu_src, loaded by moet.kernels.cpu_build) computes the 2-bit base straight
from the packed codes and scales, several times faster than decoding whole experts first; the
PyTorch path serves what it does not take (an expert at the FP4 tier, gpt-oss's biases) and machines
where it was not built. moet.kernels.oracle.select_moe_backend chooses between them (CPU_KERNEL,
CPU_TORCH) and the caller passes its choice. On the PyTorch path tokens are grouped by expert with one sort; each active expert's weights are decoded in
bulk by byte-table lookups; the combine gathers every (token, slot) product back in token order and
sums the k slots in a fixed order, so the result does not depend on how tokens were grouped (the
kernel keeps the same property). moet.vllm.moe_op wraps moe_forward in a `torch.library` custom op
so that vLLM's Dynamo tracing treats it as one node.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moet.kernels import cpu_build
from moet.kernels.oracle import MoeBackend
from moet.quant.scales import SCALE_BLOCK
from moet.quant.stacked import StackedWeight

GATED_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
}


def _dequantize(w: StackedWeight, experts: torch.Tensor, fp4: torch.Tensor) -> torch.Tensor:
    """float32 [A, N, K]: the FP4 tier where `fp4[i]`, the 2-bit base elsewhere."""
    base = w.dequantize_base(experts)
    if bool(fp4.any()):
        base[fp4] = w.dequantize_fp4(experts[fp4])
    return base


def kernel_forward(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: StackedWeight,
    w2: StackedWeight,
    activation: str = "silu",
    present: torch.Tensor | None = None,
    isa: str = "auto",
) -> torch.Tensor:
    """moe_forward's 2-bit base through the C++ kernel; `isa` forces a code path (tests: "avx512", "avx2", "scalar")."""
    if not cpu_build.load():
        raise RuntimeError(f"the CPU MoE kernel is not built ({cpu_build.library_path()} missing)")
    return torch.ops.moet_cpu.moe_forward(
        x, topk_weights, topk_ids, present,
        w13.codes, w13.scales, w13.row_scale, w2.codes, w2.scales, w2.row_scale,
        SCALE_BLOCK[w13.scale_kind], activation, isa,
    )


def moe_forward(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: StackedWeight,
    w2: StackedWeight,
    activation: str = "silu",
    use_fp4: torch.Tensor | None = None,
    present: torch.Tensor | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    *,
    backend: MoeBackend,
) -> torch.Tensor:
    """Routed MoE output [T, H] in x's dtype, weighted and summed over the k selected experts.

    topk_ids are local expert ids (−1 = not on this rank). `use_fp4[e]` computes expert e with
    its FP4 tier; `present[e] == False` makes expert e contribute exactly zero (a cache miss).
    Math: h = act(x·W1ᵀ) ⊙ (x·W3ᵀ), y = h·W2ᵀ, in float32 over weights decoded exactly.
    Per-expert biases (`w13_bias` [E, 2I], gate then up; `w2_bias` [E, H]) and swigluoai: biased_forward.
    `backend`: moet.kernels.oracle.select_moe_backend's choice for the call (CPU_KERNEL or CPU_TORCH).
    """
    biased = is_biased(activation, w13_bias, w2_bias)
    if not biased and activation not in GATED_ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not supported by the CPU path")
    if backend == MoeBackend.CPU_KERNEL:
        if biased:
            raise ValueError(f"the CPU kernel has neither expert biases nor {activation!r}: select_moe_backend(biased=True) picks CPU_TORCH")
        return kernel_forward(x, topk_weights, topk_ids, w13, w2, activation, present)
    if backend != MoeBackend.CPU_TORCH:
        raise ValueError(f"backend {backend!r} is not a CPU backend (CPU_KERNEL or CPU_TORCH)")
    if biased:
        return biased_forward(x, topk_weights, topk_ids, w13, w2, activation, w13_bias, w2_bias, use_fp4, present)
    return torch_forward(x, topk_weights, topk_ids, w13, w2, activation, use_fp4, present)


def is_biased(activation: str, w13_bias: torch.Tensor | None, w2_bias: torch.Tensor | None) -> bool:
    """Whether a call carries per-expert biases or a clamped activation (gpt-oss): the PyTorch path's only."""
    return activation in BIASED_ACTIVATIONS or w13_bias is not None or w2_bias is not None


def torch_forward(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: StackedWeight,
    w2: StackedWeight,
    activation: str = "silu",
    use_fp4: torch.Tensor | None = None,
    present: torch.Tensor | None = None,
) -> torch.Tensor:
    """moe_forward in vectorised PyTorch: every tier, no kernel needed (the path before the kernel)."""
    tokens, k = topk_ids.shape
    num_experts = w13.num_experts
    flat_ids = topk_ids.reshape(-1).long()
    valid = flat_ids >= 0
    if present is not None:
        valid &= present[flat_ids.clamp(min=0)]
    order = torch.argsort(torch.where(valid, flat_ids, num_experts), stable=True)
    counts = torch.bincount(flat_ids[valid], minlength=num_experts)
    active = torch.nonzero(counts).flatten()
    fp4_mask = use_fp4[active] if use_fp4 is not None else torch.zeros_like(active, dtype=torch.bool)
    w13_all = _dequantize(w13, active, fp4_mask)
    w2_all = _dequantize(w2, active, fp4_mask)
    xf = x.float()
    products = torch.zeros(tokens * k, x.shape[-1], dtype=torch.float32)
    inter = w13.shape[0] // 2
    start = 0
    for i, count in enumerate(counts[active].tolist()):
        slots = order[start : start + count]
        start += count
        gate_up = xf[slots // k] @ w13_all[i].T
        hidden = GATED_ACTIVATIONS[activation](gate_up[:, :inter]) * gate_up[:, inter:]
        products[slots] = hidden @ w2_all[i].T
    weighted = products.view(tokens, k, -1) * topk_weights.float().unsqueeze(-1)
    return weighted.sum(dim=1).to(x.dtype)


SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT = 1.702, 7.0  # gpt-oss's, fixed in vLLM's SwigluOAIAndMul and transformers' config


def swigluoai(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU: gate ≤ 7, |up| ≤ 7, (up + 1) · gate · σ(1.702 · gate)."""
    gate = gate.clamp(max=SWIGLUOAI_LIMIT)
    up = up.clamp(min=-SWIGLUOAI_LIMIT, max=SWIGLUOAI_LIMIT)
    return (up + 1) * gate * torch.sigmoid(SWIGLUOAI_ALPHA * gate)


BIASED_ACTIVATIONS = {"swigluoai": swigluoai}


def biased_forward(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: StackedWeight,
    w2: StackedWeight,
    activation: str,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    use_fp4: torch.Tensor | None = None,
    present: torch.Tensor | None = None,
) -> torch.Tensor:
    """moe_forward for gpt-oss-style experts, in PyTorch (the C++ kernel has neither biases nor swigluoai):
    each expert's bias added after its projection, any gated activation. Same grouping and combine as
    torch_forward, so the result does not depend on how tokens were grouped either."""
    def gated(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if activation in BIASED_ACTIVATIONS:
            return BIASED_ACTIVATIONS[activation](gate, up)
        if activation in GATED_ACTIVATIONS:
            return GATED_ACTIVATIONS[activation](gate) * up
        raise ValueError(f"activation {activation!r} is not supported by the CPU path")

    tokens, k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1).long()
    valid = flat_ids >= 0
    if present is not None:
        valid &= present[flat_ids.clamp(min=0)]
    order = torch.argsort(torch.where(valid, flat_ids, w13.num_experts), stable=True)
    counts = torch.bincount(flat_ids[valid], minlength=w13.num_experts)
    active = torch.nonzero(counts).flatten()
    fp4_mask = use_fp4[active] if use_fp4 is not None else torch.zeros_like(active, dtype=torch.bool)
    w13_all, w2_all = _dequantize(w13, active, fp4_mask), _dequantize(w2, active, fp4_mask)
    xf = x.float()
    products = torch.zeros(tokens * k, x.shape[-1], dtype=torch.float32)
    inter = w13.shape[0] // 2
    start = 0
    for i, (expert, count) in enumerate(zip(active.tolist(), counts[active].tolist())):
        slots = order[start : start + count]
        start += count
        gate_up = xf[slots // k] @ w13_all[i].T
        if w13_bias is not None:
            gate_up += w13_bias[expert].float()
        y = gated(gate_up[:, :inter], gate_up[:, inter:]) @ w2_all[i].T
        if w2_bias is not None:
            y += w2_bias[expert].float()
        products[slots] = y
    weighted = products.view(tokens, k, -1) * topk_weights.float().unsqueeze(-1)
    return weighted.sum(dim=1).to(x.dtype)
