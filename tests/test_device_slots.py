"""The FP4 pool's slots as the GPU holds them (moet.tier.slots), run on a CPU device: the commit protocol
keeps every slot equal to the host copy of the expert the table names; the auto sizing arithmetic; the
routing record that adds no host sync; and the pool driving the Triton kernels (Triton's interpreter)."""

from __future__ import annotations

import random
import textwrap

import pytest
import torch

from moet.knobs import Knobs
from moet.tier.pool import GIB, FP4Pool
from moet.tier.slots import DeviceSlots
from moet.vllm.gate_runtime import AUTO_RESERVE_BYTES, Fp4Runtime, auto_pool_bytes
from tests.interpreted import run_interpreted

LAYERS, EXPERTS, SLOTS = 3, 8, 5


def _host_copies(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(-2**31, 2**31 - 1, (EXPERTS, 2, 1, 32, 8), generator=gen, dtype=torch.int64).to(torch.int32),
         torch.randint(-2**31, 2**31 - 1, (EXPERTS, 1, 2, 32, 8), generator=gen, dtype=torch.int64).to(torch.int32))
        for _ in range(LAYERS)
    ]


@pytest.mark.parametrize("seed", [0, 1])
def test_commit_protocol_keeps_slots_equal_to_the_table(seed):
    """Random gate requests and rebalancing commits: after each apply, the device table is the pool's and
    every slot it names holds exactly that expert's host copy (both projections)."""
    rng = random.Random(seed)
    host = _host_copies(seed)
    pool = FP4Pool(LAYERS, EXPERTS, SLOTS)
    slots = DeviceSlots(SLOTS, LAYERS, EXPERTS, tuple(host[0][0].shape[1:]), tuple(host[0][1].shape[1:]), torch.device("cpu"))
    for layer, (w13, w2) in enumerate(host):
        slots.set_host(layer, w13, w2)
    copied = 0
    for _ in range(60):
        pool.record(torch.rand(LAYERS, EXPERTS) * (torch.rand(LAYERS, EXPERTS) < 0.3))
        if rng.random() < 0.5:
            wanted = torch.rand(LAYERS, EXPERTS) < 0.1
            pool.request(wanted, limit=rng.randint(1, 3))
        else:
            pool.propose()
        changes = pool.commit(rebalance=True)
        slots.apply(changes, pool.slot_table)
        copied += len(changes.promoted)
        assert torch.equal(slots.table, pool.slot_table)
        for layer, expert, slot in pool.resident():
            assert torch.equal(slots.w13[slot], host[layer][0][expert])
            assert torch.equal(slots.w2[slot], host[layer][1][expert])
    assert copied > SLOTS  # slots were reused after evictions, not only filled once
    assert slots.copied_bytes == copied * (host[0][0][0].numel() + host[0][1][0].numel()) * 4


def test_auto_sizing_takes_only_what_the_kv_cache_left():
    """auto = memory free after vLLM allocated its KV cache − reserve; never negative."""
    assert AUTO_RESERVE_BYTES == GIB
    assert auto_pool_bytes(free_bytes=14 * GIB) == 13 * GIB
    assert auto_pool_bytes(free_bytes=GIB // 2) == 0
    assert auto_pool_bytes(free_bytes=10 * GIB, reserve_bytes=4 * GIB) == 6 * GIB


def test_auto_is_refused_on_cpu():
    knobs = Knobs(w2=True, delta_gb="auto")
    with pytest.raises(Exception, match="auto"):
        Fp4Runtime(knobs, LAYERS, EXPERTS, 1000, torch.device("cpu"))


def test_route_records_misses_apart_from_experts():
    """route() marks routed experts with device ops only; a miss (−1) lands in the extra column, not expert 0."""
    runtime = Fp4Runtime(Knobs(w2=True, delta_gb=1.0), LAYERS, EXPERTS, GIB // 4, torch.device("cpu"))
    runtime.begin_pass()
    mask = runtime.route(1, torch.tensor([[3, -1], [5, 3]]))
    assert mask.shape == (EXPERTS,) and mask.dtype == torch.bool
    assert runtime.routed[1, :EXPERTS].nonzero().flatten().tolist() == [3, 5]
    assert bool(runtime.routed[1, EXPERTS]) and not runtime.routed[0].any() and not runtime.routed[2].any()


_POOL_DRIVES_KERNELS = textwrap.dedent(
    """
    import torch
    from moet.kernels.glue import select_experts
    from moet.kernels.layout import Fp4Slots, StackedWeights, mma_fp4_words
    from moet.kernels.moe import GemmConfig, fused_moe_2bit
    from moet.testing.reference import moe_reference
    from moet.testing.random_stacked import random_stored
    from moet.tier.pool import FP4Pool
    from moet.tier.slots import DeviceSlots

    hidden, inter, experts, top_k, tokens = 128, 128, 8, 2, 4
    s13 = random_stored(experts, 2 * inter, hidden, "mx32", seed=3)
    s2 = random_stored(experts, hidden, inter, "mx32", seed=4)
    w13 = StackedWeights.from_stacked(s13, torch.device("cpu"), gate_up=True)
    w2 = StackedWeights.from_stacked(s2, torch.device("cpu"), gate_up=False)
    h13, h2 = mma_fp4_words(s13.fp4, True), mma_fp4_words(s2.fp4, False)
    pool = FP4Pool(1, experts, 3)
    slots = DeviceSlots(3, 1, experts, tuple(h13.shape[1:]), tuple(h2.shape[1:]), torch.device("cpu"))
    slots.set_host(0, h13, h2)
    configs = (GemmConfig(1, 16, 4, 1), GemmConfig(1, 16, 4, 1))
    x = torch.randn(tokens, hidden).to(torch.bfloat16)
    weights, ids = select_experts(torch.randn(tokens, experts), top_k)
    for wanted in ([1, 6, 2], [6, 0, 5], [7]):  # the second and third evict and reuse slots
        mask = torch.zeros(1, experts, dtype=torch.bool)
        mask[0, wanted] = True
        pool.request(mask)
        slots.apply(pool.commit(rebalance=False), pool.slot_table)
        out = fused_moe_2bit(x, weights, ids, w13, w2, slots=Fp4Slots(*slots.layer_slots(0)), configs=configs, backend=configs[0].backend)
        ref = moe_reference(x, weights, ids, s13, s2, fp4_experts=pool.use_fp4[0])
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, (wanted, err)
    print("pool drives kernels ok")
    """
)


def test_pool_commits_drive_the_kernels_interpreted():
    """Promotions and evictions committed and applied, then the Triton kernels (CPU interpreter) read the
    slots the table names: equal to float64 with exactly the pool's experts at FP4."""
    run_interpreted(_POOL_DRIVES_KERNELS, "pool drives kernels ok")
