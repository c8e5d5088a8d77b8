"""The codebook sweep: is the symmetric set {−4,−1,+1,+4} safe for a new model?

Per routed-expert tensor, with w the FP4 tier's values (the source for FP4 checkpoints, the
reference-rule FP4 for FP8/BF16 ones) and u the same values in e2m1 units (before block/row scales):

- symmetric:  q = the 2-bit base (codes {−4,−1,+1,+4} × scales, zero policy applied);
- asymmetric: q = nearest of the tensor's best 4 levels drawn from the signed e2m1 grid
  (best_asymmetric_levels: least squared error in e2m1 units over all 1365 four-value subsets of
  the 15 grid values; the symmetric set is one of them) × scales;
- bias = mean(q − w) / rms(w)   (signed, relative to the tensor's RMS);
- rel_rms = ‖q − w‖ / ‖w‖.
The unconstrained L2 optimum (lloyd_levels) is reported as `rel_rms_lloyd` only: its levels are
cell means, so its error has zero mean in e2m1 units by construction and its bias says nothing.

Verdict (all four must hold; tensors with ‖w‖ = 0 are skipped):
1. mean over tensors of |bias_sym| < 0.005;
2. mean |bias_asym| ≥ 5 × mean |bias_sym|;
3. |bias_sym| ≤ |bias_asym| on more than 90% of tensors ("symmetric best");
4. L2 penalty = mean(rel_rms_sym) / mean(rel_rms_asym) − 1 < 0.05.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from moet.quant.codebook import E2M1_MAGNITUDES, QuantizedWeight, decode_fp4, dequantize_base
from moet.quant.scales import apply_scales

MAX_ABS_BIAS = 0.005
MIN_BIAS_RATIO = 5.0
MIN_SYMMETRIC_BEST = 0.90
MAX_L2_PENALTY = 0.05
LEVELS = 4
E2M1_GRID = torch.tensor(sorted({s * m for m in E2M1_MAGNITUDES for s in (-1.0, 1.0)}), dtype=torch.float64)
SUBSETS = torch.combinations(torch.arange(E2M1_GRID.numel()), LEVELS)  # [1365, 4], ascending


def best_asymmetric_levels(values: torch.Tensor) -> torch.Tensor:
    """The 4 signed e2m1 grid values (ascending, float64) that quantize `values` (e2m1 units) with least squared error.

    Ties between subsets go to the lexicographically first (by grid index). A 16-entry
    nibble → level table built from the result makes the matching 2-bit ablation codebook.
    """
    grid = E2M1_GRID
    support, counts = torch.unique(values.to(torch.float64).flatten(), return_counts=True)
    d2 = (support[:, None, None] - grid[SUBSETS]) ** 2  # [values, subsets, 4]
    cost = (d2.amin(-1) * counts.to(torch.float64).unsqueeze(-1)).sum(0)
    return grid[SUBSETS[int(cost.argmin())]]


def lloyd_levels(values: torch.Tensor, n_levels: int = LEVELS) -> torch.Tensor:
    """The unconstrained L2-optimal `n_levels` reconstruction levels for `values` (float64, ascending).

    Exact, not Lloyd-Max's local optimum: an optimal scalar quantizer's cells are intervals of the
    sorted support, so a dynamic program over the (few: ≤ 15 for e2m1) distinct values finds the
    global optimum; each level is its cell's mean. With fewer distinct values than levels, the
    missing levels repeat the largest value.
    """
    support, counts = torch.unique(values.to(torch.float64).flatten(), return_counts=True)
    m = support.numel()
    if m <= n_levels:
        return torch.cat([support, support[-1:].repeat(n_levels - m)]) if m else torch.zeros(n_levels, dtype=torch.float64)
    weights = counts.to(torch.float64)
    s0 = torch.cat([torch.zeros(1, dtype=torch.float64), weights.cumsum(0)]).tolist()
    s1 = torch.cat([torch.zeros(1, dtype=torch.float64), (weights * support).cumsum(0)]).tolist()
    s2 = torch.cat([torch.zeros(1, dtype=torch.float64), (weights * support * support).cumsum(0)]).tolist()

    def cost(i: int, j: int) -> float:  # squared error of one cell holding support[i:j]
        return s2[j] - s2[i] - (s1[j] - s1[i]) ** 2 / (s0[j] - s0[i])

    inf = float("inf")
    best = [[inf] * (m + 1) for _ in range(n_levels + 1)]
    cut = [[0] * (m + 1) for _ in range(n_levels + 1)]
    best[0][0] = 0.0
    for level in range(1, n_levels + 1):
        for j in range(level, m + 1):
            for i in range(level - 1, j):
                c = best[level - 1][i] + cost(i, j)
                if c < best[level][j]:
                    best[level][j], cut[level][j] = c, i
    levels, j = [], m
    for level in range(n_levels, 0, -1):
        i = cut[level][j]
        levels.append((s1[j] - s1[i]) / (s0[j] - s0[i]))
        j = i
    return torch.tensor(levels[::-1], dtype=torch.float64)


def quantize_to_levels(values: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Each value replaced by its nearest level (ascending `levels`; a tie goes to the lower level)."""
    levels = levels.to(torch.float64)
    distance = (values.to(torch.float64).unsqueeze(-1) - levels).abs()
    return levels[distance.argmin(-1)]


@dataclass
class TensorSweep:
    name: str
    bias_sym: float
    bias_asym: float
    rel_rms_sym: float
    rel_rms_asym: float
    rel_rms_lloyd: float
    levels_asym: list[float]


def sweep_tensor(name: str, qw: QuantizedWeight) -> TensorSweep | None:
    """Bias and relative RMS of both codebooks for one tensor with an FP4 tier (planes); None if all zero."""
    if qw.fp4 is None:
        raise ValueError(f"{name}: the sweep needs the FP4 planes (requantize with Tier.PLANES)")
    u = decode_fp4(qw.fp4)
    w = apply_scales(u, qw.scales, qw.scale_kind, qw.row_scale)
    norm = float(w.norm())
    if norm == 0.0:
        return None
    rms = norm / w.numel() ** 0.5
    levels = best_asymmetric_levels(u)
    results = []
    for q in (
        dequantize_base(qw),
        apply_scales(quantize_to_levels(u, levels), qw.scales, qw.scale_kind, qw.row_scale),
        apply_scales(quantize_to_levels(u, lloyd_levels(u)), qw.scales, qw.scale_kind, qw.row_scale),
    ):
        err = q - w
        results.append((float(err.mean()) / rms, float(err.norm()) / norm))
    (bias_sym, rms_sym), (bias_asym, rms_asym), (_, rms_lloyd) = results
    return TensorSweep(name, bias_sym, bias_asym, rms_sym, rms_asym, rms_lloyd, levels.tolist())


@dataclass
class SweepReport:
    tensors: list[TensorSweep] = field(default_factory=list)
    skipped: int = 0

    def summary(self) -> dict[str, Any]:
        n = len(self.tensors)
        if n == 0:
            return {"tensors": 0, "skipped": self.skipped, "pass": False}
        abs_sym = sum(abs(t.bias_sym) for t in self.tensors) / n
        abs_asym = sum(abs(t.bias_asym) for t in self.tensors) / n
        best = sum(abs(t.bias_sym) <= abs(t.bias_asym) for t in self.tensors) / n
        penalty = sum(t.rel_rms_sym for t in self.tensors) / sum(t.rel_rms_asym for t in self.tensors) - 1
        ratio = abs_asym / abs_sym if abs_sym > 0 else float("inf")
        checks = {
            f"mean |bias_sym| < {MAX_ABS_BIAS}": abs_sym < MAX_ABS_BIAS,
            f"mean |bias_asym| >= {MIN_BIAS_RATIO:g} x mean |bias_sym|": ratio >= MIN_BIAS_RATIO,
            f"symmetric best on > {MIN_SYMMETRIC_BEST:.0%} of tensors": best > MIN_SYMMETRIC_BEST,
            f"L2 penalty < {MAX_L2_PENALTY:.0%}": penalty < MAX_L2_PENALTY,
        }
        return {
            "tensors": n,
            "skipped": self.skipped,
            "mean_abs_bias_sym": abs_sym,
            "mean_abs_bias_asym": abs_asym,
            "bias_ratio": ratio,
            "symmetric_best_share": best,
            "mean_rel_rms_sym": sum(t.rel_rms_sym for t in self.tensors) / n,
            "mean_rel_rms_asym": sum(t.rel_rms_asym for t in self.tensors) / n,
            "mean_rel_rms_lloyd": sum(t.rel_rms_lloyd for t in self.tensors) / n,
            "l2_penalty": penalty,
            "checks": checks,
            "pass": all(checks.values()),
        }

    def to_json(self) -> dict[str, Any]:
        return {"summary": self.summary(), "tensors": [asdict(t) for t in self.tensors]}

