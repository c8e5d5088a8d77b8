"""SIGKILL a real process while it writes a pack, many times: every restart sees a valid pack and identical outputs.

The kills land by construction, not by timing: the forked writer counts its durable-write syscalls
(pwrite, write, fdatasync, fsync, replace, ftruncate, fallocate) and, at the one chosen for this
kill, does half of it (a torn write) and then tells the parent through a pipe and waits there;
the parent SIGKILLs it at that point. The points are spread over the whole write.
"""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from moet.store import ExpertCache, PinnedStore, ReplayDriver, build_pack, open_pack
from moet.store.pack import Pack, Sidecar, pack_path, sidecar_path
from moet.testing.synthetic_moe import SyntheticMoE, cached, forward, make_model, resident

pytestmark = pytest.mark.usefixtures("single_thread")

KILLS = 24
LAYERS, EXPERTS = 4, 8
DURABLE_CALLS = ("pwrite", "write", "fdatasync", "fsync", "replace", "ftruncate", "posix_fallocate")


def stop_at_call(stop_at: int, tell: int) -> None:
    """In the child: count durable-write syscalls; at number `stop_at`, tear it, tell the parent, wait to be killed."""
    seen = [0]

    def wrap(name: str):
        real = getattr(os, name)

        def call(*args):
            seen[0] += 1
            if seen[0] == stop_at:
                if name in ("pwrite", "write"):  # a torn write: half of the bytes reach the file
                    real(args[0], memoryview(args[1])[: max(1, len(args[1]) // 2)], *args[2:])
                os.write(tell, b"k")
                signal.pause()
            return real(*args)

        return call

    for name in DURABLE_CALLS:
        setattr(os, name, wrap(name))


def fork_child(work: Callable[[int], None]) -> tuple[int, int]:
    """Fork a process that runs work(fd) and exits 0 (1 if it raised); return its pid and the pipe's read end."""
    read, tell = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read)
            torch.set_num_threads(1)
            work(tell)
            code = 0
        finally:
            os._exit(code)
    os.close(tell)
    return pid, read


def build(store: Path, identity: str, model: SyntheticMoE) -> None:
    """The pack build exactly as the server runs it."""
    build_pack(store, 0, identity, model.layout, EXPERTS, LAYERS, lambda layer: model.weights[layer]).close()


def write_in_child(store: Path, identity: str, model: SyntheticMoE, stop_at: int) -> tuple[int, int]:
    """A forked writer that stops at durable call `stop_at`: one byte on the pipe = stopped mid-write,
    end of file = it finished (or failed) on its own."""

    def work(tell: int) -> None:
        stop_at_call(stop_at, tell)
        build(store, identity, model)

    return fork_child(work)


def count_durable_calls(store: Path, identity: str, model: SyntheticMoE) -> int:
    """Durable-write syscalls of one whole fresh build, counted in a child that never stops."""

    def work(tell: int) -> None:
        seen = [0]
        for name in DURABLE_CALLS:
            real = getattr(os, name)
            setattr(os, name, lambda *a, _real=real: (seen.__setitem__(0, seen[0] + 1), _real(*a))[1])
        build(store, identity, model)
        os.write(tell, str(seen[0]).encode())

    pid, read = fork_child(work)
    with os.fdopen(read, "rb") as pipe:
        count = int(pipe.read() or b"0")
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    return count


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
    build(store, identity, model)
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

    calls = count_durable_calls(tmp_path / "counting", "A", models["A"])
    assert calls > KILLS, f"a build makes only {calls} durable calls"
    rng = random.Random(20261202)
    # spread over the whole build: the first kill points cover the sidecar/truncate start, the rest the layers
    points = sorted(rng.sample(range(1, calls + 1), KILLS))
    rng.shuffle(points)

    store = tmp_path / "store"
    mid_write = 0
    for i, stop_at in enumerate(points):
        identity = "AB"[i % 2]  # each writer finds the other checkpoint's pack: rebuild, then the restart resumes
        pid, read = write_in_child(store, identity, models[identity], stop_at)
        with os.fdopen(read, "rb") as pipe:
            stopped = pipe.read(1) == b"k"
        if stopped:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        mid_write += stopped and os.WIFSIGNALED(status)
        assert_never_garbage(store, models)
        assert torch.equal(served_output(store, identity, models[identity], x), want[identity])
    assert mid_write == KILLS, f"only {mid_write} of {KILLS} writers were killed mid-write"
