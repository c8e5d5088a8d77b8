"""Host stores over a pack: all pinned, pack only (buffered and O_DIRECT), arena with hot-set protection and heat file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moet.store import ArenaStore, PackStore, PinnedStore, build_pack, open_pack, open_store
from moet.store.arena import SegmentedLRU
from moet.testing.synthetic_moe import make_model

pytestmark = pytest.mark.usefixtures("single_thread")

LAYERS, EXPERTS = 3, 8


@pytest.fixture
def model():
    return make_model(LAYERS, EXPERTS, 64, 32, 2, tier="planes", seed=31)


@pytest.fixture
def pack(tmp_path: Path, model):
    p = build_pack(tmp_path, 0, "ckpt", model.layout, EXPERTS, LAYERS, lambda layer: model.weights[layer])
    yield p
    p.close()


def all_keys() -> list[tuple[int, int]]:
    return [(layer, expert) for layer in range(LAYERS) for expert in range(EXPERTS)]


def gathered(store, keys, decode: bool = True) -> torch.Tensor:
    """Copies of the rows of `keys`, asked in batches the store can take."""
    batch = store.capacity or len(keys)
    return torch.cat([torch.stack(store.rows(keys[at : at + batch], decode)) for at in range(0, len(keys), batch)])


def test_every_backend_hands_out_the_same_base_bytes(pack, model) -> None:
    reference = PinnedStore.from_weights(model.layout, model.weights)
    keys = all_keys()[::-1]  # reversed: no two requests are adjacent in the file
    want = gathered(reference, keys)
    assert reference.span == pack.layout.base_span < pack.stride  # the FP4 planes stay on disk
    stores = [PinnedStore.from_pack(pack), PinnedStore.from_pack(pack, direct=True), PackStore(pack), PackStore(pack, direct=True),
              ArenaStore(pack, 5 * pack.layout.base_span), ArenaStore(pack, 5 * pack.layout.base_span, direct=True)]
    assert stores[3].reader.direct  # ext4 takes O_DIRECT
    for store in stores:
        assert torch.equal(gathered(store, keys), want), type(store).__name__
        assert torch.equal(gathered(store, sorted(keys)), gathered(reference, sorted(keys)))
        store.close()


def test_arena_hits_are_zero_copy_views(pack) -> None:
    store = ArenaStore(pack, 4 * pack.layout.base_span)
    row = store.row(1, 3)
    start, end = store.buffer.data_ptr(), store.buffer.data_ptr() + store.buffer.numel()
    assert start <= row.data_ptr() < end
    assert store.row(1, 3).data_ptr() == row.data_ptr() and store.stats.hits == 1


def test_prefill_scan_cannot_evict_the_decode_hot_set(pack) -> None:
    store = ArenaStore(pack, 10 * pack.layout.base_span)
    hot = [(0, 1), (1, 5), (2, 2), (2, 7)]
    for _ in range(2):
        gathered(store, hot, decode=True)
    keys = all_keys()
    for start in range(0, len(keys), 3):  # a prefill streams every expert through the arena
        gathered(store, keys[start : start + 3], decode=False)
    misses = store.stats.misses
    gathered(store, hot, decode=True)
    assert store.stats.misses == misses  # the hot set is still resident
    assert set(hot) <= set(store.lru.hot())


def test_heat_file_preheats_the_hot_set_after_reboot(tmp_path: Path, pack, model) -> None:
    store = ArenaStore(pack, 8 * pack.layout.base_span)
    hot = [(0, 0), (1, 4), (2, 6)]
    gathered(store, hot, decode=True)
    gathered(store, [(0, 5), (1, 1)], decode=False)
    store.save_heat()
    store.close()
    pack.close()

    rebooted = open_pack(tmp_path, 0, "ckpt")
    fresh = open_store(rebooted, ram_gb=8 * rebooted.layout.base_span / 2**30)
    assert isinstance(fresh, ArenaStore)
    assert set(fresh.lru.hot()) == set(hot)  # preheated, not merely remembered
    reads = fresh.stats.misses
    assert torch.equal(gathered(fresh, hot), gathered(PinnedStore.from_weights(model.layout, model.weights), hot))
    assert fresh.stats.misses == reads
    rebooted.close()


def test_foreign_heat_file_is_ignored(tmp_path: Path, pack, model) -> None:
    store = ArenaStore(pack, 8 * pack.layout.base_span)
    gathered(store, [(0, 0)], decode=True)
    store.save_heat()
    other = build_pack(tmp_path / "other", 0, "another-ckpt", model.layout, EXPERTS, LAYERS, lambda layer: model.weights[layer])
    (tmp_path / "other" / "rank0.heat.json").write_bytes(store.heat_path.read_bytes())
    assert ArenaStore(other, 8 * other.layout.base_span).preheat() == 0


def test_open_store_picks_the_backend(pack) -> None:
    assert isinstance(open_store(pack, None), PinnedStore)
    assert isinstance(open_store(pack, 1.0), PinnedStore)  # the whole base fits in 1 GiB
    assert isinstance(open_store(pack, 3 * pack.layout.base_span / 2**30), ArenaStore)


def test_segmented_lru_demotes_into_probation_and_spares_pinned_keys() -> None:
    lru = SegmentedLRU(4, protected_share=0.5)
    for key in [(0, 0), (0, 1), (0, 2)]:
        lru.insert(key, decode=True)
    assert lru.hot() == [(0, 2), (0, 1)]  # (0, 0) was demoted when the protected segment overflowed
    slot, evicted = lru.insert((0, 3), pinned=frozenset({(0, 0)}))
    assert evicted is None and (0, 0) in lru
    _, evicted = lru.insert((0, 4), pinned=frozenset({(0, 0), (0, 4)}))
    assert evicted == (0, 3)
