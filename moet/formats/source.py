"""What `moet.formats` yields for each routed-expert matrix: the source bytes, untouched."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from moet.errors import CheckpointError
from moet.quant.scales import ScaleKind

Projection = Literal["gate", "up", "down"]
SourceKind = Literal["nvfp4", "mxfp4", "fp8_block", "float"]


@dataclass(frozen=True)
class ExpertKey:
    layer: int
    expert: int
    proj: Projection


@dataclass
class SourceWeight:
    """One routed expert's projection [N, K] as stored in the checkpoint.

    data:    nvfp4/mxfp4 → uint8 packed e2m1 [N, K/2] (low nibble = even k);
             fp8_block → float8_e4m3fn [N, K]; float → bf16/fp16/fp32 [N, K].
    scales:  nvfp4 → uint8 e4m3 bits [N, K/16]; mxfp4 → uint8 UE8M0 [N, K/32];
             fp8_block → float32 weight_scale_inv [ceil(N/128), ceil(K/128)]; float → None.
    scale_2: nvfp4's float32 weight_scale_2, else None.
    zero_policy: set for slices of a fused tensor, whose policy is decided on the whole tensor.
    """

    name: str  # HF per-expert name, e.g. model.layers.0.mlp.experts.3.down_proj.weight
    key: ExpertKey
    kind: SourceKind
    data: torch.Tensor
    scales: torch.Tensor | None
    scale_2: float | None
    file: str
    zero_policy: tuple[str, int] | None = None

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.data.shape
        return (n, k * 2) if self.kind in ("nvfp4", "mxfp4") else (n, k)

    def source_nbytes(self) -> int:
        total = self.data.numel() * self.data.element_size()
        if self.scales is not None:
            total += self.scales.numel() * self.scales.element_size()
        return total


def shard_for_rank(src: SourceWeight, rank: int, size: int) -> SourceWeight:
    """Rank `rank`'s slice of `size` under tensor parallelism: gate/up rows (column parallel), down
    columns (row parallel), as vLLM shards FusedMoE weights."""
    if size == 1:
        return src
    dim = 1 if src.key.proj == "down" else 0
    n, k = src.shape
    full = (n, k)[dim]
    if full % size:
        raise CheckpointError(f"{src.name}: dimension {full} does not split over {size} ranks")
    per_rank = full // size
    if dim == 1 and src.kind in ("nvfp4", "mxfp4"):
        block = ScaleKind.of_source(src.kind).block
        if per_rank % block:
            raise CheckpointError(f"{src.name}: {per_rank} columns per rank is not a multiple of the {block}-wide scale blocks")
        data = src.data.narrow(1, rank * per_rank // 2, per_rank // 2)
        scales = src.scales.narrow(1, rank * per_rank // block, per_rank // block)
    else:
        data = src.data.narrow(dim, rank * per_rank, per_rank)
        scales = None if src.scales is None else src.scales.narrow(dim, rank * per_rank, per_rank)
    return SourceWeight(src.name, src.key, src.kind, data.contiguous(), scales, src.scale_2, src.file, src.zero_policy)
