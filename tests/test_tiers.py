"""`moet bench tiers --preset quick` runs end to end and records what the full run reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moet.cli import main

pytestmark = pytest.mark.usefixtures("single_thread")


def test_tiers_bench_quick_run_records_json_and_plot(tmp_path: Path) -> None:
    assert main(["bench", "tiers", "--preset", "quick", "--out", str(tmp_path), "--workdir", str(tmp_path), "--no-trace"]) == 0
    (record,) = tmp_path.glob("tiers-*.json")
    assert record.with_suffix(".png").stat().st_size > 0
    data = json.loads(record.read_text())
    boot = data["boot"]
    assert boot["disk_seq_read_gbps"] > 0 and boot["pack_boot_secs"] > 0 and boot["requant_boot_secs"] > 0
    full_cache = data["decode"]["cache"][-1]
    assert full_cache["cache_share"] == 1.0 and 0 <= full_cache["zero_miss_fraction"] <= 1
    assert {"host_hit_rate", "protected_share"} <= set(data["decode"]["arena"][-1])
    assert all(row["peak_mib"] >= row["baseline_mib"] for row in data["rss"])


def test_trace_sweep_replays_a_fixed_routing_through_the_cache() -> None:
    import torch

    from moet.bench.tiers import trace_sweep

    gen = torch.Generator().manual_seed(0)
    routing = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(3 * 40)]).view(40, 3, 2)
    routing[:4] = torch.arange(8).view(4, 1, 2)  # every expert is seen before the measured quarter begins
    result = trace_sweep({"model": "synthetic", "experts": 8, "hidden": 64, "inter": 32, "routing": routing}, [0.5, 1.0])
    half, full = result["cache"]
    assert full["zero_miss_fraction"] == 1.0 and full["replay_rate"] == 0.0 and full["fetch_kib_per_step"] == 0.0
    assert half["replay_rate"] > 0 and half["zero_miss_fraction"] + half["replay_rate"] == 1.0
    assert 0 < half["hit_rate"] < 1
