"""Expert-weight variants for the quality benchmark beyond moet.eval.perplexity's source/fp4/base.

- `asymmetric_weights`: the ablation codebook — per tensor, the L2-best 4 levels of the signed
  e2m1 grid (moet.quant.sweep.best_asymmetric_levels, the set `moet inspect` reports), applied to
  the FP4 tier's values with its scales. It is the codebook whose signed bias the symmetric base
  was designed to avoid.
- `first_layers`: a variant in the first N layers and the source elsewhere, to see whether an
  error grows with the depth it has to travel (the sign-bias argument is about compounding).
- `weight_bias`: the mean signed error of a variant's weights, per tensor relative to its RMS.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moet.eval.perplexity import ExpertWeights
from moet.formats.experts import iter_routed_experts
from moet.formats.source import ExpertKey
from moet.quant.codebook import Tier, decode_fp4
from moet.quant.scales import apply_scales
from moet.quant.requant import requantize
from moet.quant.sweep import best_asymmetric_levels, quantize_to_levels



def asymmetric_weights(model_dir: str | Path) -> dict[ExpertKey, torch.Tensor]:
    """float32 [N, K] per routed-expert matrix: the FP4 tier snapped to the tensor's best asymmetric 4 levels."""
    out: dict[ExpertKey, torch.Tensor] = {}
    for src in iter_routed_experts(model_dir):
        qw = requantize(src, Tier.PLANES)
        u = decode_fp4(qw.fp4)
        out[src.key] = apply_scales(quantize_to_levels(u, best_asymmetric_levels(u)), qw.scales, qw.scale_kind, qw.row_scale).to(torch.float32)
    return out


def first_layers(variant: ExpertWeights, source: ExpertWeights, n_layers: int) -> dict[ExpertKey, torch.Tensor]:
    """`variant` in layers < n_layers, `source` in the rest."""
    return {key: (variant[key] if key.layer < n_layers else source[key]) for key in source}


def weight_bias(variant: ExpertWeights, source: ExpertWeights) -> dict[str, float]:
    """Over tensors: mean of mean(q − w)/rms(w) (signed) and of its absolute value; float64."""
    signed = []
    for key, w in source.items():
        w64 = w.double()
        rms = float(w64.pow(2).mean().sqrt())
        if rms > 0:
            signed.append(float((variant[key].double() - w64).mean()) / rms)
    values = torch.tensor(signed, dtype=torch.float64)
    return {"mean_signed_bias": float(values.mean()), "mean_abs_bias": float(values.abs().mean())}
