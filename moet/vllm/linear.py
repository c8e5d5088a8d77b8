"""Dense NVFP4 / FP8-block linears dequantized once at load, for vLLM builds without their kernels.

vLLM's CPU build has no NVFP4 or FP8-block linear kernel, and real NVFP4 checkpoints quantize
attention and dense MLPs too. Those layers (everything but the routed experts) are loaded in their
source format through vLLM's own parameter classes (so tensor-parallel sharding and fused q/k/v
shards work as usual), then expanded exactly to the model dtype and run as a plain matmul.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from vllm.model_executor.layers.linear import LinearMethodBase, register_weight_loader_v2_supported_method
from vllm.model_executor.parameter import BlockQuantScaleParameter, ModelWeightParameter, PerTensorScaleParameter

from moet.errors import CheckpointError
from moet.quant.requant import FP8_BLOCK, dequantize_fp8_block
from moet.quant.scales import ScaleKind, apply_scales
from moet.quant.stacked import BYTE_TO_FP4X2

NVFP4_GROUP = ScaleKind.NV16.block


def _blocks(size: int) -> int:
    return -(-size // FP8_BLOCK)


@register_weight_loader_v2_supported_method
class DequantLinearMethod(LinearMethodBase):
    """Loads an NVFP4 or FP8-block linear as stored, keeps only its dequantized weight."""

    def __init__(self, kind: str) -> None:
        if kind not in ("nvfp4", "fp8_block"):
            raise CheckpointError(f"dense {kind} linears are not supported; set VLLM_MOE_W2=0 for stock vLLM")
        self.kind = kind

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra: Any,
    ) -> None:
        loader = extra["weight_loader"]
        out = sum(output_partition_sizes)
        layer.moet_partitions = list(output_partition_sizes)
        layer.moet_dtype = params_dtype

        def matrix(shape: tuple[int, ...], dtype: torch.dtype) -> ModelWeightParameter:
            return ModelWeightParameter(data=torch.empty(shape, dtype=dtype), input_dim=1, output_dim=0, weight_loader=loader)

        def per_shard() -> PerTensorScaleParameter:
            return PerTensorScaleParameter(
                data=torch.full((len(output_partition_sizes),), float("nan"), dtype=torch.float32), weight_loader=loader
            )

        if self.kind == "nvfp4":
            if input_size_per_partition % NVFP4_GROUP:
                raise CheckpointError(f"{input_size_per_partition} input features are not a multiple of {NVFP4_GROUP}")
            layer.register_parameter("weight", matrix((out, input_size_per_partition // 2), torch.uint8))
            layer.register_parameter("weight_scale", matrix((out, input_size_per_partition // NVFP4_GROUP), torch.float8_e4m3fn))
            layer.register_parameter("weight_scale_2", per_shard())
            layer.register_parameter("input_scale", per_shard())
        else:
            layer.register_parameter("weight", matrix((out, input_size_per_partition), torch.float8_e4m3fn))
            layer.weight_block_size = [FP8_BLOCK, FP8_BLOCK]
            blocks = (sum(_blocks(p) for p in output_partition_sizes), _blocks(input_size_per_partition))
            scale = BlockQuantScaleParameter(data=torch.empty(blocks, dtype=torch.float32), input_dim=1, output_dim=0, weight_loader=loader)
            layer.register_parameter("weight_scale_inv", scale)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if self.kind == "nvfp4":
            weight = self._nvfp4_weight(layer)
            del layer.weight_scale, layer.weight_scale_2, layer.input_scale
        else:
            weight = self._fp8_weight(layer)
            del layer.weight_scale_inv
        if not bool(torch.isfinite(weight).all()):
            raise CheckpointError(f"{getattr(layer, 'prefix', 'a linear layer')}: NaN or Inf after dequantization; the checkpoint is corrupt")
        layer.weight = torch.nn.Parameter(weight.to(layer.moet_dtype), requires_grad=False)

    def _nvfp4_weight(self, layer: torch.nn.Module) -> torch.Tensor:
        """e2m1 × e4m3 block scale × per-shard weight_scale_2, float32 (exact for these products)."""
        scale_2 = layer.weight_scale_2.data
        if bool(torch.isnan(scale_2).any()):
            raise CheckpointError(
                f"{getattr(layer, 'prefix', 'a linear layer')}: weight_scale_2 missing from the checkpoint; re-export it"
            )
        values = BYTE_TO_FP4X2[layer.weight.data.long()].flatten(-2)
        rows = torch.repeat_interleave(scale_2, torch.tensor(layer.moet_partitions))
        return apply_scales(values, layer.weight_scale.data.view(torch.uint8), ScaleKind.NV16, rows, inplace=True)

    def _fp8_weight(self, layer: torch.nn.Module) -> torch.Tensor:
        """Each fused shard (q, k, v, …) has its own grid of 128×128 scale blocks."""
        rows = layer.weight.data.split(layer.moet_partitions)
        scales = layer.weight_scale_inv.data.split([_blocks(p) for p in layer.moet_partitions])
        return torch.cat([dequantize_fp8_block(w, s) for w, s in zip(rows, scales)])

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)
