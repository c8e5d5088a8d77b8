"""Expert-weight variants for the quality benchmark beyond moet.eval.perplexity's source/fp4/base.

- `asymmetric_weights`: the ablation codebook — per tensor, the L2-best 4 levels of the signed
  e2m1 grid (moet.quant.sweep.best_asymmetric_levels, the set `moet inspect` reports), applied to
  the FP4 tier's values with its scales. It is the codebook whose signed bias the symmetric base
  was designed to avoid.
- `first_layers`: a variant in the first N layers and the source elsewhere, to see whether an
  error grows with the depth it has to travel (the sign-bias argument is about compounding).
- `weight_bias`: the mean signed error of a variant's weights, per tensor relative to its RMS.
- `mx_activation_experts`: the routed experts read their inputs as the block-scaled sm_120a path
  (moet.kernels.blackwell) feeds them to its FP8 MMA — e4m3 with a power-of-two scale per 32 k, one or
  two terms — so that the quality bench can price that path's activation rounding on a real model.
- `token_fp8_experts`: the scheme an FP8 wgmma on sm_90 allows (Hopper has no block-scaled MMA, so scales can
  only sit outside the K sum): each input row in e4m3 with one float32 scale per token, each weight row in e4m3
  with one power-of-two scale, the row's largest weight at ≤ 448. The 2-bit base stays exact there while its
  row's block scales span at most 16 binades.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from moet.eval.perplexity import ExpertWeights
from moet.formats.experts import iter_routed_experts
from moet.kernels.mx import mx_values, quantize_activations
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


def mx_activation_experts(model: torch.nn.Module, terms: int) -> None:
    """Make every routed-experts module of `model` (fused gate_up_proj [E, 2I, H] / down_proj [E, H, I])
    compute as the block-scaled path does: each projection's input quantized to `terms` e4m3 terms per 32 k
    (moet.kernels.mx.quantize_activations, the kernel's rule), the SiLU·up activations rounded to bf16 before
    theirs, products summed in the model's dtype. The weights stay as loaded: the 2-bit base and the FP4 tier
    are exact in that path's e4m3 weight operands (UE8M0/32 scales)."""
    for block in model.model.layers:
        block.mlp.experts.forward = partial(_quantized_experts_forward, block.mlp.experts, partial(mx_quantized, terms=terms))


def token_fp8_experts(model: torch.nn.Module, round_weights: bool = True) -> None:
    """Make every routed-experts module of `model` compute as an sm_90 FP8 wgmma would with per-token
    activation scales (fp8_rows) and power-of-two weight-row scales (fp8_rows(…, power_of_two=True)).
    `round_weights=False`: the inputs only, as moet.kernels.hopper's FP8 prefill computes where its weight operand
    (each 2-bit weight times its block scale over the row's power of two, the row scale applied after the sum) is
    exact, as on the embedded model (docs/QUALITY.md); rounding the dequantized rows instead also rounds their
    NVFP4 row scale's mantissa."""
    for block in model.model.layers:
        experts = block.mlp.experts
        if round_weights:
            for weight in (experts.gate_up_proj, experts.down_proj):
                weight.data = fp8_rows(weight.data, power_of_two=True)
        experts.forward = partial(_quantized_experts_forward, experts, fp8_rows)


def fp8_rows(x: torch.Tensor, power_of_two: bool = False) -> torch.Tensor:
    """x [..., K] rounded to e4m3 (nearest even) with one scale per row, in x's dtype: amax / 448 in float32 (an
    activation row), or the smallest power of two ≥ that (a weight row: e4m3 values times it are exact
    products). An all-zero row stays zero."""
    x32 = x.to(torch.float32)
    scale = x32.abs().amax(-1, keepdim=True) / 448.0
    if power_of_two:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return ((x32 / scale).to(torch.float8_e4m3fn).to(torch.float32) * scale).to(x.dtype)


def mx_quantized(x: torch.Tensor, terms: int) -> torch.Tensor:
    """x [..., K] as the block-scaled MMA reads it (the sum of its e4m3 terms), in x's dtype."""
    data, scales = quantize_activations(x, terms)
    return sum(mx_values(d, s) for d, s in zip(data, scales)).to(x.dtype)


def _quantized_experts_forward(
    experts: torch.nn.Module, quantized, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' routed-experts forward with each projection's input passed through `quantized` (the SiLU·up
    activations rounded to bf16 first, as the kernels write them)."""
    out = torch.zeros_like(hidden_states)
    x = quantized(hidden_states)
    for e in torch.unique(top_k_index).tolist():
        if e >= experts.gate_up_proj.shape[0]:  # transformers' padding index
            continue
        token, slot = torch.where(top_k_index == e)
        gate, up = F.linear(x[token], experts.gate_up_proj[e]).chunk(2, dim=-1)
        h = quantized((experts.act_fn(gate) * up).to(torch.bfloat16).to(x.dtype))
        out.index_add_(0, token, F.linear(h, experts.down_proj[e]) * top_k_weights[token, slot, None])
    return out
