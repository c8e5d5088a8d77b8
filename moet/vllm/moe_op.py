"""The routed-expert forward as one `torch.library` op, so vLLM's Dynamo tracing sees a single node.

The op takes the stacked tensors directly; CPU runs moet.kernels.cpu, CUDA the Triton kernels.
"""

from __future__ import annotations

import torch

from typing import TYPE_CHECKING

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
    w2_codes: torch.Tensor,
    w2_scales: torch.Tensor,
    w2_row_scale: torch.Tensor,
    scale_kind: str,
    activation: str,
) -> torch.Tensor:
    from moet.kernels.cpu import moe_forward

    w13 = StackedWeight(w13_codes, w13_scales, w13_row_scale, scale_kind)
    w2 = StackedWeight(w2_codes, w2_scales, w2_row_scale, scale_kind)
    return moe_forward(x, topk_weights, topk_ids, w13, w2, activation)


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
) -> torch.Tensor:
    """Weighted sum over the k routed experts of each token, computed from the 2-bit base.

    On CUDA the layer holds the kernels' layout and vLLM already wraps `apply` in its own opaque
    op (graph-capturable Triton kernels); on CPU the custom op keeps Dynamo out of the loop.
    """
    if x.is_cuda:
        from moet.kernels import fused_moe_w2

        return fused_moe_w2(x, topk_weights, topk_ids, w13, w2, activation)
    return _routed_moe(
        x, topk_weights, topk_ids,
        w13.codes, w13.scales, w13.row_scale,
        w2.codes, w2.scales, w2.row_scale,
        w13.scale_kind, activation,
    )
