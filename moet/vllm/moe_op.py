"""The routed-expert forward as one `torch.library` op, so vLLM's Dynamo tracing sees a single node.

The op takes the stacked tensors directly; CPU runs moet.kernels.cpu, CUDA the Triton kernels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from moet.quant.stacked import StackedWeight

if TYPE_CHECKING:
    from moet.kernels import StackedWeights


@torch.library.custom_op("moet::routed_moe", mutates_args=())
def _routed_moe(
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
) -> torch.Tensor:
    from moet.kernels.cpu import moe_forward

    w13 = StackedWeight(w13_codes, w13_scales, w13_row_scale, scale_kind, w13_fp4, w13_refine)
    w2 = StackedWeight(w2_codes, w2_scales, w2_row_scale, scale_kind, w2_fp4, w2_refine)
    return moe_forward(x, topk_weights, topk_ids, w13, w2, activation, use_fp4)


@_routed_moe.register_fake
def _(x: torch.Tensor, *args: object) -> torch.Tensor:
    return torch.empty_like(x)


def routed_moe(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: "StackedWeight | StackedWeights",
    w2: "StackedWeight | StackedWeights",
    activation: str,
    use_fp4: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weighted sum over the k routed experts of each token; experts with `use_fp4[e]` use the FP4 tier.

    On CUDA the layer holds the kernels' layout and vLLM already wraps `apply` in its own opaque
    op (graph-capturable Triton kernels; the FP4 pool is CPU-only so far); on CPU the custom op
    keeps Dynamo out of the loop.
    """
    if x.is_cuda:
        from moet.kernels import fused_moe_w2

        return fused_moe_w2(x, topk_weights, topk_ids, w13, w2, activation)
    return _routed_moe(
        x, topk_weights, topk_ids,
        w13.codes, w13.scales, w13.row_scale, w13.fp4, w13.refine,
        w2.codes, w2.scales, w2.row_scale, w2.fp4, w2.refine,
        use_fp4, w13.scale_kind, activation,
    )
