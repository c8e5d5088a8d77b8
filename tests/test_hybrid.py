"""Hybrid GPU + CPU experts (moet.vllm.hybrid), checked on CPU: the split of a layer's misses, and a layer
whose cache misses are computed from the host store equal to the fully resident layer (float32), with
nothing left for the replay driver; the knob's placement rule."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moet.errors import ConfigError
from moet.kernels.cpu import moe_forward
from moet.kernels.oracle import select_moe_backend
from moet.knobs import Knobs
from moet.quant.stacked import StackedWeight
from moet.store import ExpertCache, PinnedStore
from moet.store.layout import RowLayout
from moet.testing.random_stacked import random_stored
from moet.vllm.hybrid import HybridExperts, split_misses

EXPERTS, HIDDEN, INTER, TOKENS, TOP_K = 16, 128, 64, 6, 4


def test_split_sends_the_cpu_its_share_of_the_rates() -> None:
    assert split_misses([3, 1, 7], "cpu", 1.0, 100.0) == ([3, 1, 7], [])
    assert split_misses(list(range(8)), "both", 1.0, 3.0) == ([0, 1], [2, 3, 4, 5, 6, 7])  # 8 · 1/(1+3) = 2
    assert split_misses(list(range(8)), "both", 3.0, 1.0) == ([0, 1, 2, 3, 4, 5], [6, 7])
    assert split_misses([5], "both", 1.0, 1.0)[0] + split_misses([5], "both", 1.0, 1.0)[1] == [5]
    with pytest.raises(ValueError, match="replay"):
        split_misses([1], "replay", 1.0, 1.0)


def _layer_and_cache(slots: int):
    s13 = random_stored(EXPERTS, 2 * INTER, HIDDEN, "mx32", seed=1, refine=False)
    s2 = random_stored(EXPERTS, HIDDEN, INTER, "mx32", seed=2, refine=False)
    layout = RowLayout.for_moe(HIDDEN, INTER, "mx32")
    store = PinnedStore.from_weights(layout, [[[s13.expert(e), s2.expert(e)] for e in range(EXPERTS)]])
    cache = ExpertCache(store, slots=slots)
    views = cache.storage.views
    w13, w2 = (StackedWeight(v["codes"], v["scales"], v["row_scale"], "mx32") for v in views)
    layer = SimpleNamespace(expert_map=None, moet_ordinal=0, moet_fp4=None, moet_w13=w13, moet_w2=w2,
                            activation=SimpleNamespace(value="silu"))
    return s13, s2, cache, layer


@pytest.mark.parametrize("mode", ["cpu", "both"])
def test_misses_computed_on_the_host_equal_the_resident_layer(mode: str) -> None:
    """Half the experts in the cache: every step's misses are computed from the store's rows (and, with both,
    partly fetched); the output equals the resident layer's, and no miss is left for a replay."""
    s13, s2, cache, layer = _layer_and_cache(slots=EXPERTS // 2)
    cache.begin_step()
    cache.fetch([(0, e) for e in range(0, EXPERTS, 2)])  # the warm half
    hybrid = HybridExperts(cache, mode)
    layer.moet_cache = SimpleNamespace(cache=cache, hybrid=hybrid)
    from moet.vllm.moe_op import apply_moe

    gen = torch.Generator().manual_seed(5)
    for step in range(4):
        cache.begin_step()
        x = torch.randn(TOKENS, HIDDEN, generator=gen)
        weights = torch.softmax(torch.randn(TOKENS, TOP_K, generator=gen), -1)
        ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(TOKENS)])
        ids[0, 1] = -1  # not on this rank: contributes nothing on either side
        got = apply_moe(layer, x, weights, ids)
        want = moe_forward(x, weights, ids, s13, s2, backend=select_moe_backend(x.device, TOKENS))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        assert cache.pending() == [], step
    c = hybrid.counts
    assert c.cpu_experts > 0 and c.cpu_pairs >= c.cpu_experts and c.layers_with_misses == 4
    assert (c.fetched_experts > 0) == (mode == "both")
    assert set(hybrid.kpis()) >= {"cpu_gb_s", "fetch_gb_s", "cpu_experts", "fetched_experts"}


def test_the_knob_runs_only_beside_a_gpu_cache() -> None:
    knobs = Knobs(w2=True, store_dir="/p", base_cache_gb=1.0, cache_miss="cpu")
    knobs.check_placement("cuda")
    with pytest.raises(ConfigError, match="VLLM_MOE_W2_CACHE_MISS=cpu on cpu"):
        knobs.check_placement("cpu")
    with pytest.raises(ValueError, match="VLLM_MOE_W2_CACHE_MISS=both does nothing without VLLM_MOE_W2_BASE_CACHE_GB"):
        Knobs(w2=True, cache_miss="both").check_effective()
