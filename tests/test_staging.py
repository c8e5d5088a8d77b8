"""Bounded staging: the loader's read path drops each layer's checkpoint pages from the page cache.

Page-cache residency is read with util-linux `fincore` (the kernel's own count, independent of the
bench's mincore probe, which is itself checked against it), on real files written here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from moet.bench.requant import generate
from moet.bench.staging import resident_bytes
from moet.bench.tiers import drop_page_cache
from moet.formats.experts import RoutedExperts

pytestmark = pytest.mark.skipif(shutil.which("fincore") is None, reason="needs util-linux fincore")


def readahead_bytes(path: Path) -> int:
    """The kernel's readahead window for the disk holding `path` (pages it may cache beyond what was read)."""
    dev = os.stat(path).st_dev
    node = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    for queue in (node / "queue", node / ".." / "queue"):  # a disk, or a partition's disk
        if (queue / "read_ahead_kb").is_file():
            return int((queue / "read_ahead_kb").read_text()) * 1024
    return 16 << 20  # no block device behind it (overlay, tmpfs): a generous window


def fincore_bytes(paths: list[Path]) -> int:
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, paths)],
                         check=True, capture_output=True, text=True).stdout
    return sum(int(line) for line in out.split())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path], int]:
    """6 layers of 16 experts, 2 layers per shard; returns (dir, shards, source bytes of one layer)."""
    root = tmp_path_factory.mktemp("staging") / "nvfp4"
    layers = generate(root, 0.021, hidden=512, width=256, experts=16, layers_per_shard=2)
    assert layers == 6
    # per projection: packed e2m1 N×K/2 bytes + e4m3 scales N×K/16 + weight_scale_2 (4); input_scale is not read
    per_matrix = 256 * 512 // 2 + 256 * 512 // 16 + 4
    return root, sorted(root.glob("*.safetensors")), 16 * 3 * per_matrix


def evict(paths: list[Path]) -> None:
    for path in paths:
        drop_page_cache(path)


def _load(root: Path, shards: list[Path], drop: bool | None) -> list[int]:
    """Stream every routed expert from a cold cache; the shards' resident bytes at each layer boundary and at the end."""
    evict(shards)
    assert fincore_bytes(shards) == 0
    seen, current = [], None
    with RoutedExperts(root, drop_pages=drop) as stream:
        for src in stream:
            if src.key.layer != current and current is not None:
                seen.append(fincore_bytes(shards))
            current = src.key.layer
    seen.append(fincore_bytes(shards))
    return seen


def test_mincore_probe_matches_fincore(checkpoint: tuple[Path, list[Path], int]) -> None:
    root, shards, _ = checkpoint
    evict(shards)
    with open(shards[0], "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)  # no readahead: exactly the pages read
        os.pread(f.fileno(), 3 << 20, 1 << 20)
    assert resident_bytes(shards[0]) == fincore_bytes(shards[:1]) == 3 << 20


def test_dropping_keeps_about_one_layer_cached(checkpoint: tuple[Path, list[Path], int]) -> None:
    root, shards, layer_bytes = checkpoint
    seen = _load(root, shards, drop=True)
    assert len(seen) == 6
    # at a boundary: the next layer's first tensor and the kernel's readahead beyond it; never a growing cache
    assert max(seen) <= layer_bytes + readahead_bytes(shards[0]), seen
    assert seen[-1] <= layer_bytes // 4, seen


def test_keeping_pages_caches_the_whole_checkpoint(checkpoint: tuple[Path, list[Path], int]) -> None:
    root, shards, layer_bytes = checkpoint
    seen = _load(root, shards, drop=False)
    assert seen[-1] >= 6 * layer_bytes * 0.99, seen
    assert seen == sorted(seen)


def test_knob_turns_dropping_off(checkpoint: tuple[Path, list[Path], int], monkeypatch: pytest.MonkeyPatch) -> None:
    root, shards, layer_bytes = checkpoint
    monkeypatch.setenv("VLLM_MOE_W2_DROP_SOURCE_PAGES", "0")
    assert _load(root, shards, drop=None)[-1] >= 6 * layer_bytes * 0.99
    monkeypatch.delenv("VLLM_MOE_W2_DROP_SOURCE_PAGES")
    assert _load(root, shards, drop=None)[-1] <= layer_bytes // 4
