"""The FP4 pool: sizing, a randomized stress test against a plain-Python mirror, the manager thread,
and the forward driven by the slot table (bit-exact FP4 when every expert is promoted)."""

from __future__ import annotations

import random

import pytest
import torch

from moet.kernels.cpu import moe_forward
from moet.kernels.oracle import select_moe_backend
from moet.testing.random_stacked import random_stored
from moet.quant.codebook import QuantizedWeight, dequantize_base, dequantize_fp4
from moet.quant.stacked import StackedWeight
from moet.tier.pool import GIB, FP4Pool, PoolManager, pool_slots


def test_pool_slots_from_gib_and_auto():
    assert pool_slots(1.0, GIB // 8, max_slots=100) == 8
    assert pool_slots(0, 1000, max_slots=100) == 0
    assert pool_slots(64, 1000, max_slots=100) == 100  # never more than every expert
    assert pool_slots("auto", 1000, max_slots=100, free_bytes=GIB + 25_500, reserve_bytes=GIB) == 25
    assert pool_slots("auto", 1000, max_slots=100, free_bytes=GIB // 2, reserve_bytes=GIB) == 0
    with pytest.raises(ValueError):
        pool_slots("auto", 1000, max_slots=100)


class Mirror:
    """The pool's rules restated over Python dicts and floats, one obvious step at a time."""

    def __init__(self, n: int, slots: int, decay: float, hysteresis: float) -> None:
        self.heat = [0.0] * n
        self.slots, self.decay, self.hysteresis = slots, decay, hysteresis
        self.planned: dict[int, int] = {}  # slot → expert
        self.committed: dict[int, int] = {}
        self.proposal: list[tuple[int, int]] = []

    def owner_of(self) -> dict[int, int]:
        return {e: s for s, e in self.planned.items()}

    def record(self, counts: list[float]) -> None:
        self.heat = [h * self.decay + c for h, c in zip(self.heat, counts)]

    def free_slot(self) -> int | None:
        free = [s for s in range(self.slots) if s not in self.planned]
        return min(free) if free else None

    def request(self, wanted: set[int], protect: set[int], limit: int | None) -> int:
        keep = wanted | protect
        resident = self.owner_of()
        todo = sorted((e for e in wanted if e not in resident), key=lambda e: (-self.heat[e], e))
        done = 0
        for e in todo:
            if limit is not None and done >= limit:
                break
            slot = self.free_slot()
            if slot is None:
                evictable = [r for r in self.planned.values() if r not in keep]
                if not evictable:
                    break
                victim = min(evictable, key=lambda r: (self.heat[r], r))
                # the victim is the coldest of everything that could have been evicted
                assert all(self.heat[victim] <= self.heat[r] for r in evictable)
                slot = self.owner_of()[victim]
            self.planned[slot] = e
            done += 1
        return done

    def propose(self) -> None:
        resident = self.owner_of()
        newcomers = sorted((e for e in range(len(self.heat)) if e not in resident and self.heat[e] > 0), key=lambda e: (-self.heat[e], e))
        victims = sorted(resident, key=lambda e: (self.heat[e], e))
        free = self.slots - len(resident)
        self.proposal = []
        for e in newcomers:
            if free > 0:
                self.proposal.append((e, -1))
                free -= 1
            elif victims and self.heat[e] > self.heat[victims[0]] * (1 + self.hysteresis):
                self.proposal.append((e, victims.pop(0)))
            else:
                break

    def commit(self, rebalance: bool) -> tuple[set, set]:
        if rebalance:
            for e, victim in self.proposal:
                resident = self.owner_of()
                if e in resident:
                    continue
                if victim < 0:
                    slot = self.free_slot()
                    if slot is not None:
                        self.planned[slot] = e
                elif victim in resident:
                    self.planned[resident[victim]] = e
            self.proposal = []
        promoted = {(e, s) for s, e in self.planned.items() if self.committed.get(s) != e}
        evicted = {(e, s) for s, e in self.committed.items() if self.planned.get(s) != e}
        self.committed = dict(self.planned)
        return promoted, evicted


def _check_coherent(pool: FP4Pool, mirror: Mirror, experts: int) -> None:
    table = pool.slot_table.flatten().tolist()
    held = [s for s in table if s >= 0]
    assert len(held) == len(set(held)), "a slot is held by two experts"
    assert all(0 <= s < pool.slots for s in held)
    assert {e: s for e, s in enumerate(table) if s >= 0} == {e: s for s, e in mirror.committed.items()}
    assert torch.equal(pool.use_fp4, pool.slot_table >= 0)
    assert pool.counters()["pool_resident"] == len(held)


@pytest.mark.parametrize("seed", [0, 1])
def test_stress_promotion_eviction_against_mirror(seed):
    rng = random.Random(seed)
    layers, experts, slots = 3, 8, 7
    n = layers * experts
    pool = FP4Pool(layers, experts, slots, decay=0.9, hysteresis=0.25)
    mirror = Mirror(n, slots, 0.9, 0.25)
    table_storage = pool.slot_table.data_ptr()
    for _ in range(3000):
        counts = [float(rng.choice((0, 0, 0, 1, 2, 5))) for _ in range(n)]
        pool.record(torch.tensor(counts).view(layers, experts))
        mirror.record(counts)
        op = rng.random()
        if op < 0.45:
            wanted = {e for e in range(n) if rng.random() < 0.15}
            protect = {e for e in range(n) if rng.random() < 0.2}
            limit = rng.choice((None, 1, 3))
            mask = lambda ids: torch.tensor([e in ids for e in range(n)]).view(layers, experts)  # noqa: E731
            got = pool.request(mask(wanted), mask(protect), limit)
            assert got == mirror.request(wanted, protect, limit)
            assert pool.planned_mask().flatten().tolist() == [e in mirror.owner_of() for e in range(n)]
        elif op < 0.6:
            pool.propose()
            mirror.propose()
        rebalance = rng.random() < 0.7
        changes = pool.commit(rebalance=rebalance)
        promoted, evicted = mirror.commit(rebalance)
        assert {(l * experts + e, s) for l, e, s in changes.promoted} == promoted
        assert {(l * experts + e, s) for l, e, s in changes.evicted} == evicted
        _check_coherent(pool, mirror, experts)
    assert pool.slot_table.data_ptr() == table_storage, "the table must change in place (CUDA graphs read it)"
    assert pool.promotions > 100 and pool.evictions > 100


def test_nothing_changes_before_commit():
    pool = FP4Pool(2, 4, 3)
    pool.record(torch.ones(2, 4))
    pool.request(torch.ones(2, 4, dtype=torch.bool))
    pool.propose()
    assert (pool.slot_table == -1).all() and not pool.use_fp4.any()
    changes = pool.commit()
    assert len(changes.promoted) == 3 and not changes.evicted
    assert int(pool.use_fp4.sum()) == 3


def test_rebalance_keeps_hot_set_and_hysteresis():
    pool = FP4Pool(1, 6, 2, decay=1.0, hysteresis=0.5)
    pool.record(torch.tensor([[10.0, 9.0, 1.0, 0, 0, 0]]))
    pool.propose()
    pool.commit()
    assert pool.use_fp4[0].tolist() == [True, True, False, False, False, False]
    pool.record(torch.tensor([[0, 0, 12.0, 0, 0, 0]]))  # heat 13 vs coldest resident 9: below 1.5x
    pool.propose()
    assert not pool.commit()
    pool.record(torch.tensor([[0, 0, 2.0, 0, 0, 0]]))  # 15 > 13.5
    pool.propose()
    changes = pool.commit()
    assert [(e, s) for _, e, s in changes.promoted] == [(2, 1)] and [(e, s) for _, e, s in changes.evicted] == [(1, 1)]


def test_manager_thread_proposes_commit_publishes():
    pool = FP4Pool(2, 8, 4, decay=1.0)
    pool.record(torch.arange(16, dtype=torch.float64).view(2, 8))
    manager = PoolManager(pool, interval_s=0.001).start()
    try:
        for _ in range(1000):
            if pool._proposal:
                break
            manager._stop.wait(0.002)
    finally:
        manager.stop()
    assert not pool.use_fp4.any()
    pool.commit()
    assert pool.use_fp4.flatten().nonzero().flatten().tolist() == [12, 13, 14, 15]


def _reference_forward(x, weights, ids, w13s, w2s):
    """Expert by expert in ascending order, tokens in order, k slots summed in order."""
    tokens, k = ids.shape
    inter = w13s[0].shape[0] // 2
    products = torch.zeros(tokens * k, x.shape[1])
    flat = ids.reshape(-1)
    for e in sorted(set(flat.tolist())):
        slots = torch.nonzero(flat == e).flatten()
        gate_up = x[slots // k] @ w13s[e].T
        products[slots] = (torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]) @ w2s[e].T
    return (products.view(tokens, k, -1) * weights.unsqueeze(-1)).sum(1)


def _per_expert(stored, fp4_mask):
    """float32 [N, K] per expert through the float64 codebook (an independent decode)."""
    out = []
    for e in range(stored.codes.shape[0]):
        qw = QuantizedWeight(stored.codes[e], stored.scales[e], stored.scale_kind, stored.row_scale[e], "sign", fp4=stored.fp4[e])
        out.append((dequantize_fp4(qw) if fp4_mask[e] else dequantize_base(qw)).to(torch.float32))
    return out


@pytest.mark.parametrize("slots", [8, 3])
def test_forward_reads_the_pool(slots):
    """The pool's use_fp4 row drives moe_forward; with every expert promoted it is the FP4 forward, bit for bit."""
    experts, hidden, inter, tokens, k = 8, 64, 32, 24, 2
    s13 = random_stored(experts, 2 * inter, hidden, "nv16", seed=1)
    s2 = random_stored(experts, hidden, inter, "nv16", seed=2)
    as_stacked = lambda s: StackedWeight(s.codes, s.scales, s.row_scale, s.scale_kind, refine=s.refine)  # noqa: E731
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, k, generator=gen), -1)
    pool = FP4Pool(1, experts, slots)
    pool.record(torch.bincount(ids.flatten(), minlength=experts).view(1, experts))
    pool.request(torch.ones(1, experts, dtype=torch.bool))
    pool.commit()
    mask = pool.use_fp4[0]
    assert int(mask.sum()) == slots
    got = moe_forward(x, weights, ids, as_stacked(s13), as_stacked(s2), use_fp4=mask,
                      backend=select_moe_backend(x.device, tokens, mask))
    want = _reference_forward(x, weights, ids, _per_expert(s13, mask), _per_expert(s2, mask))
    assert torch.equal(got, want)
