"""The codebook sweep: optimal level sets against brute force, per-tensor figures by hand, `moet inspect` as a subprocess."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import torch

from moet.quant.codebook import base_from_fp4, pack_nibbles
from moet.quant.sweep import best_asymmetric_levels, lloyd_levels, quantize_to_levels, sweep_tensor

GRID = sorted({s * m for m in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0) for s in (-1.0, 1.0)})


def _cost(values: list[float], levels: tuple[float, ...]) -> float:
    return sum(min((v - level) ** 2 for level in levels) for v in values)


def _sample(counts: dict[float, int]) -> list[float]:
    return [v for v, c in counts.items() for _ in range(c)]


SKEWED = _sample({0.0: 60, 0.5: 30, -0.5: 25, 1.0: 12, -1.5: 9, 3.0: 6, 6.0: 3, -4.0: 1})


def test_best_asymmetric_levels_is_the_best_grid_subset() -> None:
    got = best_asymmetric_levels(torch.tensor(SKEWED))
    assert all(level in GRID for level in got.tolist())
    best = min(_cost(SKEWED, subset) for subset in itertools.combinations(GRID, 4))
    assert abs(_cost(SKEWED, tuple(got.tolist())) - best) < 1e-9
    exact = _sample({-4.0: 5, -1.0: 5, 1.0: 5, 4.0: 5})
    assert best_asymmetric_levels(torch.tensor(exact)).tolist() == [-4.0, -1.0, 1.0, 4.0]


def test_lloyd_levels_are_globally_optimal_and_unbiased() -> None:
    values = torch.tensor(SKEWED, dtype=torch.float64)
    levels = lloyd_levels(values)
    support = sorted(set(SKEWED))
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(support)), 3):  # every partition into 4 intervals
        bounds = (0, *cuts, len(support))
        cells = [[v for v in SKEWED if support[a] <= v <= support[b - 1]] for a, b in zip(bounds, bounds[1:])]
        best = min(best, sum(_cost(cell, (sum(cell) / len(cell),)) for cell in cells))
    assert abs(_cost(SKEWED, tuple(levels.tolist())) - best) < 1e-9
    assert abs(float((quantize_to_levels(values, levels) - values).mean())) < 1e-12  # centroids: no mean error


def test_quantize_to_levels_ties_go_down() -> None:
    levels = torch.tensor([-1.0, 1.0, 3.0])
    assert quantize_to_levels(torch.tensor([0.0, 2.0, 2.1, -5.0]), levels).tolist() == [-1.0, 1.0, 3.0, -1.0]


def test_sweep_tensor_figures_by_hand() -> None:
    # every weight is e2m1 2.0 × block scale 0.5: the symmetric base says 1.0 (error −1 × 0.5 per weight),
    # the best grid subset contains 2.0 exactly.
    nibbles = torch.full((2, 32), 0x4, dtype=torch.uint8)
    qw = base_from_fp4(pack_nibbles(nibbles), torch.full((2, 1), 126, dtype=torch.uint8), "mx32", torch.ones(2), tier="planes")
    result = sweep_tensor("t", qw)
    assert result.bias_sym == -0.5 and result.rel_rms_sym == 0.5
    assert result.bias_asym == 0.0 and result.rel_rms_asym == 0.0 and 2.0 in result.levels_asym
    zeros = base_from_fp4(pack_nibbles(torch.zeros(1, 32, dtype=torch.uint8)), torch.full((1, 1), 127, dtype=torch.uint8), "mx32", torch.ones(1), tier="planes")
    assert sweep_tensor("z", zeros) is None


def test_inspect_json_subprocess(checkpoint) -> None:
    path = checkpoint("deepseek_v3", "nvfp4-experts")
    result = subprocess.run([sys.executable, "-m", "moet.cli", "inspect", str(path), "--json"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    tensors, summary = report["tensors"], report["summary"]
    assert len(tensors) == 24 and summary["tensors"] == 24
    abs_sym = sum(abs(t["bias_sym"]) for t in tensors) / 24
    abs_asym = sum(abs(t["bias_asym"]) for t in tensors) / 24
    best = sum(abs(t["bias_sym"]) <= abs(t["bias_asym"]) for t in tensors) / 24
    penalty = sum(t["rel_rms_sym"] for t in tensors) / sum(t["rel_rms_asym"] for t in tensors) - 1
    assert abs(summary["mean_abs_bias_sym"] - abs_sym) < 1e-12 and abs(summary["symmetric_best_share"] - best) < 1e-12
    expected_pass = abs_sym < 0.005 and abs_asym >= 5 * abs_sym and best > 0.9 and penalty < 0.05
    assert summary["pass"] is expected_pass
    text = subprocess.run([sys.executable, "-m", "moet.cli", "inspect", str(path)], capture_output=True, text=True, timeout=300)
    assert text.returncode == 0 and text.stdout.strip().endswith("verdict: PASS" if expected_pass else "verdict: FAIL")
