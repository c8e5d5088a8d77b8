"""The device expert cache in the GPU kernels' layout (moet.kernels.cache_slots) and the FP4 pool over it.

On CPU: the slots a fetch fills hold exactly the kernels' layout of the experts that own them (against
the resident layer laid out by moet.kernels.layout.gpu_layer), the pool's table per cache slot names
each owner's FP4 slot, and the Triton kernels (interpreter) reading cache slots and that table equal
float64 with exactly the pool's experts at FP4. On a GPU (skipped on CI): a two-layer stack through the
plugin's apply body with the cache and its replay equals the resident stack bit for bit, eagerly and
captured in a CUDA graph, with and without the FP4 pool.
"""

from __future__ import annotations

import textwrap
from types import SimpleNamespace

import pytest
import torch

from moet.kernels.cache_slots import KernelSlots
from moet.kernels.layout import gpu_layer
from moet.store import ExpertCache, PinnedStore, ReplayDriver
from moet.store.layout import RowLayout
from moet.testing.random_stacked import random_stored
from moet.tier.pool import FP4Pool
from moet.tier.slots import DeviceSlots
from tests.interpreted import run_interpreted

LAYERS, EXPERTS, HIDDEN, INTER = 2, 16, 128, 128


def stacks(scale_kind: str = "mx32") -> list[tuple]:
    return [(random_stored(EXPERTS, 2 * INTER, HIDDEN, scale_kind, seed=2 * layer, refine=False),
             random_stored(EXPERTS, HIDDEN, INTER, scale_kind, seed=2 * layer + 1, refine=False))
            for layer in range(LAYERS)]


def pinned_store(layers: list[tuple], scale_kind: str = "mx32", pin: bool = False) -> PinnedStore:
    layout = RowLayout.for_moe(HIDDEN, INTER, scale_kind)
    weights = [[[s13.expert(e), s2.expert(e)] for e in range(EXPERTS)] for s13, s2 in layers]
    return PinnedStore.from_weights(layout, weights, pin=pin)


@pytest.mark.parametrize("scale_kind", ["mx32", "nv16"])
def test_kernel_slots_hold_the_layout_of_the_experts_they_own(scale_kind: str) -> None:
    """Fetches (in staging batches, with evictions) leave every slot equal, field by field, to the
    resident layer's kernel layout of the (layer, expert) the cache says owns it."""
    layers = stacks(scale_kind)
    resident = [gpu_layer(s13, s2, torch.device("cpu"), fp4=False)[:2] for s13, s2 in layers]
    cache = ExpertCache(pinned_store(layers, scale_kind), slots=20, storage=KernelSlots)
    assert isinstance(cache.storage, KernelSlots) and cache.storage.staging.shape[0] == 16
    for keys in ([(0, e) for e in range(EXPERTS)] + [(1, 0)],  # 17 rows: two staging batches
                 [(0, 3), (1, 7)], [(1, e) for e in range(EXPERTS)]):  # the last evicts layer 0's experts
        cache.begin_step()
        cache.fetch(keys)
        owners = cache.owner_index.tolist()
        for slot, key in enumerate(cache.owner):
            if key is None:
                assert owners[slot] == LAYERS * EXPERTS
                continue
            layer, expert = key
            assert owners[slot] == layer * EXPERTS + expert
            assert int(cache.slot_of[layer, expert]) == slot
            for got, want in zip((cache.storage.w13, cache.storage.w2), resident[layer]):
                for name in ("words", "scales", "row_scale"):
                    assert torch.equal(getattr(got, name)[slot], getattr(want, name)[expert]), (key, name)
    assert cache.storage.nbytes == sum(s.base_nbytes() for s in (cache.storage.w13, cache.storage.w2))
    assert cache.storage.w13.shape == (20, 2 * INTER, HIDDEN) and cache.storage.w2.shape == (20, HIDDEN, INTER)


def test_the_pool_table_per_cache_slot_names_each_owners_fp4_slot() -> None:
    """DeviceSlots.cache_slots: entry s = the FP4 slot of the expert cache slot s holds (−1: at the base, or empty)."""
    pool = FP4Pool(LAYERS, EXPERTS, 4)
    slots = DeviceSlots(4, LAYERS, EXPERTS, (1,), (1,), torch.device("cpu"))
    for layer in range(LAYERS):
        slots.set_host(layer, torch.zeros(EXPERTS, 1, dtype=torch.int32), torch.zeros(EXPERTS, 1, dtype=torch.int32))
    wanted = torch.zeros(LAYERS, EXPERTS, dtype=torch.bool)
    wanted[0, 2] = wanted[1, 5] = wanted[1, 6] = True
    pool.request(wanted)
    slots.apply(pool.commit(rebalance=False), pool.slot_table)
    owners = torch.tensor([1 * EXPERTS + 5, LAYERS * EXPERTS, 0 * EXPERTS + 2, 0 * EXPERTS + 3, 1 * EXPERTS + 6])
    table, _, _ = slots.cache_slots(owners)
    want = [int(pool.slot_table[1, 5]), -1, int(pool.slot_table[0, 2]), -1, int(pool.slot_table[1, 6])]
    assert table.tolist() == want and min(want[0], want[2], want[4]) >= 0
    before = table.data_ptr()
    assert slots.cache_slots(owners)[0].data_ptr() == before  # one fixed buffer: what a captured graph reads


_CACHE_DRIVES_KERNELS = textwrap.dedent(
    """
    import torch
    from moet.kernels.cache_slots import KernelSlots
    from moet.kernels.glue import select_experts
    from moet.kernels.layout import Fp4Slots, fp4_host_words
    from moet.kernels.moe import GemmConfig, fused_moe_2bit
    from moet.store import ExpertCache
    from moet.testing.reference import moe_reference
    from moet.tier.pool import FP4Pool
    from moet.tier.slots import DeviceSlots
    from tests.test_gpu_cache import EXPERTS, LAYERS, pinned_store, stacks

    layers = stacks()
    cache = ExpertCache(pinned_store(layers), slots=10, storage=KernelSlots)
    fp4 = DeviceSlots(3, LAYERS, EXPERTS, *[tuple(h.shape[1:]) for h in fp4_host_words(*layers[0], torch.device("cpu"))],
                      torch.device("cpu"))
    for layer, (s13, s2) in enumerate(layers):
        fp4.set_host(layer, *fp4_host_words(s13, s2, torch.device("cpu")))
    pool = FP4Pool(LAYERS, EXPERTS, 3)
    configs = (GemmConfig(1, 16, 4, 1), GemmConfig(1, 16, 4, 1))
    x = torch.randn(4, 128).to(torch.bfloat16)
    for layer, promote in ((1, [1, 6]), (0, [6, 0, 5])):
        weights, ids = select_experts(torch.randn(4, EXPERTS), 2)
        mask = torch.zeros(LAYERS, EXPERTS, dtype=torch.bool)
        mask[layer, promote] = True
        pool.request(mask)
        fp4.apply(pool.commit(rebalance=False), pool.slot_table)
        cache.begin_step()
        cache.fetch([(layer, e) for e in ids.unique().tolist()])
        slot_ids = cache.lookup(layer, ids).to(torch.int32)
        table = Fp4Slots(*fp4.cache_slots(cache.owner_index))
        out = fused_moe_2bit(x, weights, slot_ids, cache.storage.w13, cache.storage.w2, slots=table, configs=configs, backend=configs[0].backend)
        ref = moe_reference(x, weights, ids, *layers[layer], fp4_experts=pool.use_fp4[layer])
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, (layer, err)
        assert bool((slot_ids != ids).any())  # the kernels read cache slots, not expert ids
    print("cache drives kernels ok")
    """
)


def test_cache_slots_and_pool_drive_the_kernels_interpreted() -> None:
    """The Triton kernels (CPU interpreter) over cache slots ids and the per-slot FP4 table: float64 with
    exactly the pool's experts at FP4."""
    run_interpreted(_CACHE_DRIVES_KERNELS, "cache drives kernels ok")


# ---- on a GPU ---------------------------------------------------------------------------------------------


def _cubin_loads() -> bool:
    if not torch.cuda.is_available():
        return False
    from moet.kernels import cuda

    return cuda.available()


needs_cubin = pytest.mark.skipif(not _cubin_loads(), reason="needs a CUDA GPU and the decode cubin (CI has none)")


def _layer(ordinal: int, w13, w2, cache=None, fp4=None) -> SimpleNamespace:
    """What MoetMoEMethod.apply reads from a vLLM FusedMoE layer (moet.vllm.moe_op.apply_moe)."""
    return SimpleNamespace(expert_map=None, moet_cache=None if cache is None else SimpleNamespace(cache=cache),
                           moet_fp4=fp4, moet_ordinal=ordinal, moet_w13=w13, moet_w2=w2,
                           activation=SimpleNamespace(value="silu"))


def _stack_forward(layers: list, x: torch.Tensor, routers: list[torch.Tensor]) -> torch.Tensor:
    """Two MoE layers with a residual: layer 1's routing depends on layer 0's output (a miss there cascades)."""
    from moet.kernels.glue import select_experts
    from moet.vllm.moe_op import apply_moe

    h = x
    for layer, router in zip(layers, routers):
        weights, ids = select_experts(h.float() @ router, 2)
        h = (h.float() + apply_moe(layer, h, weights, ids).float()).to(torch.bfloat16)
    return h


class _FixedFp4:
    """Every expert at FP4 from a pool of all of them (the per-slot table under the cache)."""

    def __init__(self, slots: DeviceSlots) -> None:
        self.slots = slots

    def route(self, layer: int, ids: torch.Tensor, owners: torch.Tensor | None = None):
        from moet.kernels.layout import Fp4Slots

        return Fp4Slots(*(self.slots.layer_slots(layer) if owners is None else self.slots.cache_slots(owners)))


@needs_cubin
@pytest.mark.parametrize("tokens, cache_slots", [(1, 8), (4, 16), (64, 2 * EXPERTS)])
@pytest.mark.parametrize("with_pool", [False, True])
def test_cache_replay_equals_resident_on_gpu(tokens: int, cache_slots: int, with_pool: bool) -> None:
    """Graph replays and eager passes through the cache (at 1 and 4 tokens a quarter / half of the experts
    fit: evictions between steps) give the resident stack's output bit for bit once no expert misses; with
    a pool holding every expert, both at FP4. 64 tokens: the Triton kernels over cache slots."""
    from moet.kernels.layout import fp4_host_words

    device = torch.device("cuda")
    layers = stacks()
    fp4 = None
    if with_pool:
        host = [fp4_host_words(s13, s2, device) for s13, s2 in layers]
        slots = DeviceSlots(LAYERS * EXPERTS, LAYERS, EXPERTS, tuple(host[0][0].shape[1:]), tuple(host[0][1].shape[1:]), device)
        pool = FP4Pool(LAYERS, EXPERTS, LAYERS * EXPERTS)
        for layer, (h13, h2) in enumerate(host):
            slots.set_host(layer, h13, h2)
        pool.request(torch.ones(LAYERS, EXPERTS, dtype=torch.bool))
        slots.apply(pool.commit(rebalance=False), pool.slot_table)
        fp4 = _FixedFp4(slots)
    resident = [_layer(i, *gpu_layer(s13, s2, device, fp4=False)[:2], fp4=fp4) for i, (s13, s2) in enumerate(layers)]
    cache = ExpertCache(pinned_store(layers, pin=True), slots=cache_slots, device=device, storage=KernelSlots)
    cached = [_layer(i, cache.storage.w13, cache.storage.w2, cache=cache, fp4=fp4) for i in range(LAYERS)]
    driver = ReplayDriver(cache, fp_max=2 * LAYERS)
    gen = torch.Generator(device=device).manual_seed(tokens)
    routers = [torch.randn(HIDDEN, EXPERTS, device=device, generator=gen) for _ in range(LAYERS)]
    x = torch.zeros(tokens, HIDDEN, dtype=torch.bfloat16, device=device)
    out = torch.zeros_like(x)

    def step() -> torch.Tensor:
        out.copy_(_stack_forward(cached, x, routers))
        return out

    for _ in range(2):  # warm-up outside capture (Triton compiles, workspaces)
        x.copy_(torch.randn(tokens, HIDDEN, device=device, generator=gen))
        driver.run(step)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for i in range(8):
        x.copy_(torch.randn(tokens, HIDDEN, device=device, generator=gen))
        want = _stack_forward(resident, x, routers)
        first, second = (lambda: (graph.replay(), out)[1], step)[:: 1 if i % 2 else -1]  # either one meets the misses
        got = [driver.run(first).clone(), driver.run(second).clone()]
        assert all(torch.equal(g, want) for g in got), i
    k = driver.kpis()
    assert k["replayed_steps"] > 0 and k["degraded_steps"] == 0
    if cache_slots < LAYERS * EXPERTS:
        assert cache.fetches > 8  # evictions: later steps fetched again


@needs_cubin
@pytest.mark.parametrize("tokens", [1, 4, 64])
def test_decode_kernels_serve_a_token_naming_an_expert_twice(tokens: int) -> None:
    """Fillers (zero-weight pairs for misses) often name an expert the token also routes to: the CUDA decode
    kernels serve every pair, so the output is the float64 sum over all of them."""
    from moet.kernels.moe import fused_moe_2bit
    from moet.kernels.oracle import select_moe_backend
    from moet.testing.reference import moe_reference

    s13, s2 = stacks()[0]
    w13, w2 = gpu_layer(s13, s2, torch.device("cuda"), fp4=False)[:2]
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, 3, (tokens, 6), device="cuda", generator=gen, dtype=torch.int32)  # repeats in every row
    weights = torch.rand(tokens, 6, device="cuda", generator=gen)
    weights[:, ::2] = 0.0  # half of them fillers
    out = fused_moe_2bit(x, weights, ids, w13, w2, backend=select_moe_backend(x.device, tokens))
    ref = moe_reference(x.cpu(), weights.cpu(), ids.cpu(), s13, s2)  # the stacks live on the host
    assert float((out.cpu().double() - ref).norm() / ref.norm()) < 1e-2


@needs_cubin
@pytest.mark.parametrize("mode", ["cpu", "both"])
def test_hybrid_misses_on_the_host_match_the_resident_layer_on_gpu(mode: str) -> None:
    """VLLM_MOE_W2_CACHE_MISS=cpu/both on a GPU: half the experts cached, misses computed by the CPU kernel
    (and, with both, partly fetched): within the bf16 band of the resident layer, nothing left to replay."""
    from moet.kernels.glue import select_experts
    from moet.vllm.hybrid import HybridExperts
    from moet.vllm.moe_op import apply_moe

    device = torch.device("cuda")
    s13, s2 = stacks()[0]
    resident = _layer(0, *gpu_layer(s13, s2, device, fp4=False)[:2])
    cache = ExpertCache(pinned_store(stacks()[:1], pin=True), slots=EXPERTS // 2, device=device, storage=KernelSlots)
    cache.begin_step()
    cache.fetch([(0, e) for e in range(0, EXPERTS, 2)])
    hybrid = HybridExperts(cache, mode)
    layer = _layer(0, cache.storage.w13, cache.storage.w2, cache=cache)
    layer.moet_cache.hybrid = hybrid
    gen = torch.Generator(device=device).manual_seed(9)
    for tokens in (1, 4, 16):
        cache.begin_step()
        x = torch.randn(tokens, HIDDEN, device=device, generator=gen).to(torch.bfloat16)
        weights, ids = select_experts(torch.randn(tokens, EXPERTS, device=device, generator=gen), 4)
        want, got = apply_moe(resident, x, weights, ids).float(), apply_moe(layer, x, weights, ids).float()
        assert float((got - want).norm() / want.norm()) < 2e-2, tokens
        assert cache.pending() == []
    assert hybrid.counts.cpu_experts > 0
