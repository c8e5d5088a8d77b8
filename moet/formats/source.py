"""What `moet.formats` yields for each routed-expert matrix: the source bytes, untouched."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

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
