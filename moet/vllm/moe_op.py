"""The routed-expert forward as one `torch.library` op, so vLLM's Dynamo tracing sees a single node.

Each op asks moet.kernels.oracle for the backend of its call and passes it on: the CPU op takes the
stacked tensors and runs moet.kernels.cpu (C++ kernel or PyTorch path); the GPU op the one-layout
tensors and the FP4 slots, and runs moet.kernels.moe (CUDA decode or Triton).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from moet.kernels.oracle import select_moe_backend
from moet.quant.stacked import StackedWeight

if TYPE_CHECKING:
    from moet.kernels import Fp4Slots, StackedWeights


def _cpu_routed_moe(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_codes: torch.Tensor,
    w13_scales: torch.Tensor,
    w13_row_scale: torch.Tensor,
    w13_fp4: Optional[torch.Tensor],
    w13_refine: Optional[torch.Tensor],
    w2_codes: torch.Tensor,
    w2_scales: torch.Tensor,
    w2_row_scale: torch.Tensor,
    w2_fp4: Optional[torch.Tensor],
    w2_refine: Optional[torch.Tensor],
    use_fp4: Optional[torch.Tensor],
    scale_kind: str,
    activation: str,
    w13_bias: Optional[torch.Tensor] = None,
    w2_bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    from moet.kernels.cpu import is_biased, moe_forward

    w13 = StackedWeight(w13_codes, w13_scales, w13_row_scale, scale_kind, w13_fp4, w13_refine)
    w2 = StackedWeight(w2_codes, w2_scales, w2_row_scale, scale_kind, w2_fp4, w2_refine)
    backend = select_moe_backend(x.device, x.shape[0], use_fp4, is_biased(activation, w13_bias, w2_bias))
    return moe_forward(x, topk_weights, topk_ids, w13, w2, activation, use_fp4, w13_bias=w13_bias, w2_bias=w2_bias, backend=backend)


_routed_moe = torch.library.custom_op("moet::routed_moe", mutates_args=())(_cpu_routed_moe)


@_routed_moe.register_fake
def _(x: torch.Tensor, *args: object) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("moet::routed_moe_gpu", mutates_args=())
def _routed_moe_gpu(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_words: torch.Tensor,
    w13_scales: torch.Tensor,
    w13_row_scale: torch.Tensor,
    w2_words: torch.Tensor,
    w2_scales: torch.Tensor,
    w2_row_scale: torch.Tensor,
    slot_table: Optional[torch.Tensor],
    fp4_w13: Optional[torch.Tensor],
    fp4_w2: Optional[torch.Tensor],
    scale_kind: str,
    activation: str,
    prefill_fp8: bool = False,
) -> torch.Tensor:
    """The GPU kernels (moet.kernels.moe) as one opaque op: torch.compile neither traces nor breaks on them,
    nor on the backend choice (moet.kernels.oracle), made here per call from the token count; `prefill_fp8`:
    a Gluon prefill takes its FP8 form."""
    from moet.kernels import Fp4Slots, StackedWeights, fused_moe_2bit

    w13 = StackedWeights(w13_words, w13_scales, scale_kind, w13_row_scale)
    w2 = StackedWeights(w2_words, w2_scales, scale_kind, w2_row_scale)
    slots = None if slot_table is None else Fp4Slots(slot_table, fp4_w13, fp4_w2)
    return fused_moe_2bit(x, topk_weights, topk_ids, w13, w2, activation, slots=slots,
                          backend=select_moe_backend(x.device, x.shape[0]), fp8_prefill=prefill_fp8)


@_routed_moe_gpu.register_fake
def _(x: torch.Tensor, *args: object) -> torch.Tensor:
    return torch.empty_like(x)


def apply_moe(layer: torch.nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The body of MoetMoEMethod.apply, free of vLLM imports so that stand-in models run the same path.

    `layer` carries `expert_map` (global → local ids or None), `moet_cache` (the tiers: device expert
    cache `.cache` and, with VLLM_MOE_W2_CACHE_MISS=cpu/both, `.hybrid`; or None), `moet_fp4` (the FP4 runtime or None), `moet_ordinal`, `moet_w13`, `moet_w2`, `activation`,
    and may carry `moet_prefill_fp8` (VLLM_MOE_W2_PREFILL_FP8; absent: off).
    """
    ids = topk_ids if layer.expert_map is None else layer.expert_map[topk_ids.long()]
    cache = None if layer.moet_cache is None else layer.moet_cache.cache
    # the pool records the routed experts; under the device cache it answers per cache slot
    fp4 = None if layer.moet_fp4 is None else layer.moet_fp4.route(
        layer.moet_ordinal, ids, None if cache is None else cache.owner_index)
    hybrid = None if cache is None else getattr(layer.moet_cache, "hybrid", None)
    if hybrid is not None:  # VLLM_MOE_W2_CACHE_MISS=cpu/both: misses computed on the host, no replay
        return hybrid.apply(layer, x, topk_weights, ids, fp4)
    if cache is not None:
        ids = cache.lookup(layer.moet_ordinal, ids)
    if x.is_cuda and (layer.expert_map is not None or layer.moet_cache is not None):
        # ids < 0 (not on this rank, or a cache miss) must not reach the GPU kernels. Without either there
        # is none (no extra kernels).
        topk_weights, ids = zero_weight_fillers(ids >= 0, topk_weights, ids, layer.moet_w13.shape[0])
    biases = getattr(layer, "moet_w13_bias", None), getattr(layer, "moet_w2_bias", None)  # gpt-oss; CPU only
    return routed_moe(x, topk_weights, ids, layer.moet_w13, layer.moet_w2, layer.activation.value, fp4, *biases,
                      prefill_fp8=getattr(layer, "moet_prefill_fp8", False))


def zero_weight_fillers(keep: torch.Tensor, topk_weights: torch.Tensor, ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs `keep` is False for (a cache miss, another rank's expert, one computed elsewhere) as weight 0
    on a valid expert, which contributes exactly zero: slot j's filler names expert j mod `experts`, so a
    token's fillers name different experts and none serves more than twice its tokens (the decode kernels'
    MAX_ROWS)."""
    filler = torch.arange(ids.shape[-1], device=ids.device).remainder(experts).expand_as(ids)
    return torch.where(keep, topk_weights, 0.0), torch.where(keep, ids, filler.to(ids.dtype))


def routed_moe(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: "StackedWeight | StackedWeights",
    w2: "StackedWeight | StackedWeights",
    activation: str,
    fp4: "torch.Tensor | Fp4Slots | None" = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    prefill_fp8: bool = False,
) -> torch.Tensor:
    """Weighted sum over the k routed experts of each token.

    On CPU an id < 0 (not on this rank, a device-cache miss) contributes zero; on CUDA ids must be ≥ 0
    (apply_moe maps them).

    On CUDA the layer holds the kernels' one layout and `fp4` the FP4 pool's slots (experts with a slot
    read their FP4 copy, in the same launches); vLLM already wraps `apply` in its own opaque op
    (graph-capturable kernels). On CPU `fp4` is the mask of experts at FP4 and the custom op keeps
    Dynamo out of the loop. Per-expert biases (gpt-oss: `w13_bias` [E, 2I] gate then up, `w2_bias`
    [E, H]) are served on CPU only; the plugin refuses them on a GPU at start-up. `prefill_fp8`
    (VLLM_MOE_W2_PREFILL_FP8, GPU only): a prefill the Gluon kernel serves takes its FP8 form.
    """
    if x.is_cuda:  # the GPU backends' layout (moet.kernels.oracle.convert_to_moe_kernel_format)
        table, fp4_13, fp4_2 = (None, None, None) if fp4 is None else (fp4.table, fp4.w13, fp4.w2)
        return _routed_moe_gpu(
            x, topk_weights, topk_ids,
            w13.words, w13.scales, w13.row_scale, w2.words, w2.scales, w2.row_scale,
            table, fp4_13, fp4_2, str(w13.scale_kind), activation, prefill_fp8,
        )
    # Traced (torch.compile), the op is one opaque node; in eager mode (moet's CPU default) the function is
    # called straight: the op's Python dispatch cost ~20 µs a layer on two cores, ~3% of the embedded model's
    # decode step.
    op = _routed_moe if torch.compiler.is_compiling() else _cpu_routed_moe
    return op(
        x, topk_weights, topk_ids,
        w13.codes, w13.scales, w13.row_scale, w13.fp4, w13.refine,
        w2.codes, w2.scales, w2.row_scale, w2.fp4, w2.refine,
        fp4, str(w13.scale_kind), activation, w13_bias, w2_bias,
    )
