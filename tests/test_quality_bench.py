"""`moet bench quality` end to end on a tiny checkpoint: every section runs and is recorded; the
full static pool reproduces the source logits bit for bit."""

from __future__ import annotations

import argparse
import json

import numpy as np

from moet.bench import quality


def test_bench_quality_tiny(checkpoint, tmp_path, single_thread):
    path = checkpoint("qwen3_moe", "nvfp4-experts")
    rng = np.random.default_rng(0)
    np.save(tmp_path / "heldout.npy", rng.integers(0, 64, 4000, dtype=np.uint16))
    np.save(tmp_path / "train.npy", rng.integers(0, 64, 4000, dtype=np.uint16))
    parser = argparse.ArgumentParser()
    quality.add_arguments(parser)
    args = parser.parse_args(
        [
            "--model", str(path), "--heldout", str(tmp_path / "heldout.npy"), "--calibration", str(tmp_path / "train.npy"),
            "--master", str(tmp_path / "none"), "--windows", "2", "--seq-len", "16", "--prefill", "4",
            "--pool-fractions", "0.5,1.0", "--depths", "1", "--taus", "0.6", "--budgets", "0.25",
            "--recovery-budgets", "0.25,1.0", "--prompts", "2", "--prompt-len", "4", "--new-tokens", "4",
            "--speed-steps", "4", "--out-dir", str(tmp_path / "out"),
        ]
    )  # fmt: skip
    quality.run(args)
    (result,) = (tmp_path / "out").glob("quality-*.json")
    assert result.with_suffix(".png").stat().st_size > 10_000
    data = json.loads(result.read_text())
    v = data["variants"]
    assert set(v) == {"source", "base_sym", "base_asym", "base_fp8act1", "base_fp8act2", "base_fp8token", "base_fp8prefill", "pool_0.5", "pool_1",
                      "gate_0.6", "gate_budget:0.25"}
    for fp8 in ("base_fp8act1", "base_fp8act2", "base_fp8token", "base_fp8prefill"):  # the 2-bit weights read, activations rounded (test_quality checks the numbers)
        assert v[fp8]["expert_bytes_per_token"] == v["base_sym"]["expert_bytes_per_token"] and v[fp8]["kl_per_token"] >= 0
    # the per-row weight rounding takes effect (before 2026-12-06 the switch wrote the exact weights back over it)
    assert v["base_fp8token"]["perplexity"] != v["base_fp8prefill"]["perplexity"]
    assert v["source"]["kl_per_token"] == 0 and v["source"]["top1_agreement"] == 1
    assert v["pool_1"]["logits_equal_source"] and v["pool_1"]["kl_per_token"] == 0 and v["pool_1"]["fp4_share_of_routed"] == 1
    assert not v["pool_0.5"]["logits_equal_source"]
    assert v["base_sym"]["kl_per_token"] > 0 and v["base_sym"]["expert_bytes_per_token"] < v["source"]["expert_bytes_per_token"]
    assert 0 <= v["gate_0.6"]["fire_rate"] <= 1 and v["gate_0.6"]["gate"]["gate_steps"] > 0
    assert data["fp4_equals_source"] and set(data["depth"]) == {"1", "2"}
    assert data["scored_tokens"] == 2 * 13
    assert "not available" in data["bf16_master"]
    curve = data["recovery_curve"]
    assert [(p["pool_slots"], p["budget"]) for p in curve] == [(4, 0.25), (4, 1.0), (8, 0.25), (8, 1.0)]
    assert curve[1]["fire_rate"] == 1.0
    assert set(data["ideal_gate_coverage_teacher_forced"]) == {"0.25", "1"}
    assert data["ideal_gate_coverage_teacher_forced"]["1"] == 1.0
