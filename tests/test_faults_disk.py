"""The pack directory's disk fills up: `moet quantize --store` on a small tmpfs mounted by the test.

Whether the disk is too small from the start or fills while a layer is written, the command must
stop with one clear line, leave no pack that would load as valid, and succeed once there is room.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from moet.store.build import checkpoint_identity
from moet.store.pack import Pack, Sidecar, open_pack, pack_path, sidecar_path
from tests.servers import ROOT

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs: needs root")
PAGE = 4096


def quantize(model: Path, store: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moet.cli", "quantize", str(model), "--store", str(store)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs mount point; the test sets its size with `resize`."""
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k", "moet-test", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def resize(mount: Path, nbytes: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={nbytes // 1024}k", str(mount)], check=True)


@pytest.fixture(scope="module")
def model_and_reference(checkpoint, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny checkpoint and its pack written where there is room."""
    model = checkpoint("qwen3_moe", "nvfp4")
    reference = tmp_path_factory.mktemp("reference") / "store"
    assert quantize(model, reference).returncode == 0
    return model, reference


@pytest.mark.parametrize("when", ["before", "during"])
def test_full_disk_is_one_line_no_corrupt_pack_and_recovers(model_and_reference: tuple[Path, Path], small_disk: Path, when: str) -> None:
    model, reference = model_and_reference
    rows_end = Sidecar.load(sidecar_path(reference, 0)).rows_end
    # "before": not even the rows fit. "during": the rows' reservation fits, then the layer's
    # refinement flips or the sidecar commit that follows it find the disk full.
    resize(small_disk, rows_end // 2 if when == "before" else rows_end + 2 * PAGE)
    store = small_disk / "store"

    failed = quantize(model, store)
    assert failed.returncode == 1
    errors = [line for line in failed.stderr.splitlines() if line.startswith("moet: error:")]
    assert len(errors) == 1 and "Traceback" not in failed.stderr, failed.stderr
    assert f"store directory {store} is full" in errors[0] and "VLLM_MOE_W2_STORE_DIR" in errors[0]
    identity = checkpoint_identity(model)
    assert open_pack(store, 0, identity) is None, "a pack that does not fit loads as valid"
    if when == "during":
        assert pack_path(store, 0).stat().st_size >= rows_end, "the disk filled before the write began"
    side = Sidecar.load(sidecar_path(store, 0))
    if side is not None:  # whatever the sidecar vouches for is intact
        with Pack(pack_path(store, 0), side) as partial:
            assert partial.verify() == []
    assert not [p.name for p in store.iterdir() if p.name.endswith(".tmp")], "temporary files left behind"

    resize(small_disk, 16 * rows_end)
    again = quantize(model, store)
    assert again.returncode == 0, again.stderr
    pack = open_pack(store, 0, identity)
    assert pack is not None
    with pack, open_pack(reference, 0, identity) as want:
        assert pack.verify() == []
        for layer in range(pack.layers):
            for expert in range(pack.experts):
                assert pack.read_row(layer, expert).equal(want.read_row(layer, expert))
