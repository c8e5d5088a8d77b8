"""SIGKILL a real process while it writes a pack, many times: every restart sees a valid pack and identical outputs."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from moet.store import ExpertCache, PinnedStore, ReplayDriver, build_pack, open_pack
from moet.store.pack import Pack, Sidecar, pack_path, sidecar_path
from moet.store.synthetic import SyntheticMoE, cached, forward, make_model, resident

pytestmark = pytest.mark.usefixtures("single_thread")

KILLS = 24
LAYERS, EXPERTS = 4, 8


def write_in_child(store: Path, identity: str, model: SyntheticMoE) -> int:
    """Fork a process that builds the pack (the writer runs exactly as in the server) and return its pid."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            torch.set_num_threads(1)
            build_pack(store, 0, identity, model.layout, EXPERTS, LAYERS, lambda layer: model.weights[layer]).close()
            code = 0
        finally:
            os._exit(code)
    return pid


def assert_never_garbage(store: Path, models: dict[str, SyntheticMoE]) -> None:
    """Whatever the sidecar vouches for is intact and belongs to its checkpoint."""
    side = Sidecar.load(sidecar_path(store, 0))
    if side is None:
        return
    partial = Pack(pack_path(store, 0), side)
    try:
        assert partial.verify() == []
        model = models[side.identity]
        for layer in side.layers_written:
            for expert in range(EXPERTS):
                got = partial.read_weights(layer, expert)
                assert all(torch.equal(g.codes, w.codes) for g, w in zip(got, model.weights[layer][expert]))
    finally:
        partial.close()


def served_output(store: Path, identity: str, model: SyntheticMoE, x: torch.Tensor) -> torch.Tensor:
    """Restart: finish (or reuse) the pack, boot from it, run the replayed forward."""
    build_pack(store, 0, identity, model.layout, EXPERTS, LAYERS, lambda layer: model.weights[layer]).close()
    pack = open_pack(store, 0, identity, model.layout, EXPERTS, LAYERS)
    assert pack is not None and pack.verify() == []
    cache = ExpertCache(PinnedStore.from_pack(pack), slots=LAYERS * EXPERTS)
    cache.fetch([(layer, expert) for layer in range(LAYERS) for expert in range(EXPERTS)])
    driver = ReplayDriver(cache, fp_max=1)
    out = driver.run(lambda: forward(model, x, cached(cache)))
    assert driver.counts.zero_miss_steps == 1
    pack.close()
    return out


def test_sigkill_while_writing_always_leaves_a_valid_pack(tmp_path: Path) -> None:
    models = {"A": make_model(LAYERS, EXPERTS, 64, 32, 2, seed=21), "B": make_model(LAYERS, EXPERTS, 64, 32, 2, seed=22)}
    x = torch.randn(2, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    want = {name: forward(m, x, resident(m)) for name, m in models.items()}

    timing = tmp_path / "timing"
    start = time.perf_counter()
    os.waitpid(write_in_child(timing, "A", models["A"]), 0)
    full = time.perf_counter() - start

    rng = random.Random(20261202)
    store = tmp_path / "store"
    mid_write = 0
    for i in range(KILLS):
        identity = "AB"[i % 2]  # each writer finds the other checkpoint's pack: rebuild, then the restart resumes
        pid = write_in_child(store, identity, models[identity])
        time.sleep(rng.uniform(0, full))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        mid_write += os.WIFSIGNALED(status)
        assert_never_garbage(store, models)
        assert torch.equal(served_output(store, identity, models[identity], x), want[identity])
    assert mid_write >= KILLS // 2, f"only {mid_write} of {KILLS} kills landed while the pack was written"
