"""Pack files: row layout round trips, sidecar resume/rebuild rules, integrity, directory errors, checkpoint writer."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from moet.errors import ConfigError, MoetError
from moet.quant.codebook import QuantizedWeight, base_from_fp4, fp4_nibbles, pack_nibbles
from moet.store import PackWriter, RowLayout, build_pack, open_pack
from moet.store.layout import PAGE
from moet.store.pack import pack_path, sidecar_path
from moet.testing.synthetic_moe import make_model

pytestmark = pytest.mark.usefixtures("single_thread")

FIELDS = ("codes", "scales", "row_scale", "fp4", "refine")


def assert_same(a: QuantizedWeight, b: QuantizedWeight) -> None:
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert torch.equal(x, y), name
    assert (a.zero_policy, a.zero_sign, a.scale_kind) == (b.zero_policy, b.zero_sign, b.scale_kind)
    assert torch.equal(a.zero_flips, b.zero_flips)


def parity_weight(n: int, k: int, seed: int) -> QuantizedWeight:
    """Mostly +0 zeros with a few −0: the parity policy with non-empty flips."""
    gen = torch.Generator().manual_seed(seed)
    nibbles = torch.randint(1, 16, (n, k), generator=gen, dtype=torch.uint8)
    nibbles[nibbles == 8] = 9
    zeros = torch.rand(n, k, generator=gen) < 0.4
    nibbles[zeros] = 0
    nibbles.view(-1)[torch.nonzero(zeros.flatten()).flatten()[::40]] = 8  # 2.5% of zeros are −0
    scales = torch.randint(120, 124, (n, k // 32), generator=gen, dtype=torch.uint8)
    return base_from_fp4(pack_nibbles(nibbles), scales, "mx32", torch.ones(n), "refine")


@pytest.mark.parametrize("tier", ["none", "planes", "refine"])
@pytest.mark.parametrize("kind", ["mx32", "nv16"])
def test_pack_round_trips_every_field(tmp_path: Path, tier: str, kind: str) -> None:
    model = make_model(2, 4, 64, 32, 2, scale_kind=kind, tier=tier, seed=1)
    pack = build_pack(tmp_path, 0, "ckpt", model.layout, 4, 2, lambda layer: model.weights[layer])
    assert pack.stride % PAGE == 0 and pack.layout.base_span <= pack.stride
    assert pack.layout.abi().startswith("moet-quant/")
    for layer in range(2):
        for expert in range(4):
            for got, want in zip(pack.read_weights(layer, expert), model.weights[layer][expert]):
                assert_same(got, want)
    assert pack.verify() == []


def test_refinement_zero_flips_survive_the_pack(tmp_path: Path) -> None:
    layout = RowLayout((("w13", 16, 64), ("w2", 8, 32)), "mx32", "refine")
    rows = [[[parity_weight(16, 64, 10 * l + e), parity_weight(8, 32, 10 * l + e + 5)] for e in range(3)] for l in range(2)]
    assert rows[0][0][0].zero_policy == "parity" and rows[0][0][0].zero_flips.numel() > 0
    pack = build_pack(tmp_path, 0, "ckpt", layout, 3, 2, lambda layer: rows[layer])
    for layer in range(2):
        for expert in range(3):
            for got, want in zip(pack.read_weights(layer, expert), rows[layer][expert]):
                assert_same(got, want)
                assert torch.equal(fp4_nibbles(got), fp4_nibbles(want))


def test_partial_pack_resumes_and_mismatches_rebuild(tmp_path: Path) -> None:
    model = make_model(4, 4, 64, 32, 2, seed=2)
    writer = PackWriter(tmp_path, 0, "A", model.layout, 4, 4)
    writer.write_layer(2, model.weights[2])
    writer.write_layer(0, model.weights[0])
    writer.close()
    assert open_pack(tmp_path, 0, "A") is None  # incomplete packs never load
    assert json.loads(sidecar_path(tmp_path, 0).read_text())["layers_written"] == [0, 2]

    writer = PackWriter(tmp_path, 0, "A", model.layout, 4, 4)
    assert writer.pending == [1, 3]
    for layer in writer.pending:
        writer.write_layer(layer, model.weights[layer])
    pack = writer.finish()
    assert pack.verify() == []
    assert open_pack(tmp_path, 0, "A", model.layout, 4, 4) is not None

    assert open_pack(tmp_path, 0, "B") is None  # another checkpoint
    other_tier = RowLayout.for_moe(64, 32, "mx32", "planes")
    assert open_pack(tmp_path, 0, "A", other_tier) is None  # another quantizer ABI / layout
    assert PackWriter(tmp_path, 0, "B", model.layout, 4, 4).pending == [0, 1, 2, 3]
    assert open_pack(tmp_path, 0, "A") is None  # the rebuild started: the old pack no longer vouched for


def test_truncated_pack_file_rebuilds(tmp_path: Path) -> None:
    model = make_model(2, 4, 64, 32, 2, seed=3)
    build_pack(tmp_path, 0, "A", model.layout, 4, 2, lambda layer: model.weights[layer]).close()
    os.truncate(pack_path(tmp_path, 0), 0)
    assert open_pack(tmp_path, 0, "A") is None
    assert PackWriter(tmp_path, 0, "A", model.layout, 4, 2).pending == [0, 1]


def test_sidecar_abi_change_rebuilds(tmp_path: Path) -> None:
    model = make_model(2, 4, 64, 32, 2, seed=3)
    build_pack(tmp_path, 0, "A", model.layout, 4, 2, lambda layer: model.weights[layer]).close()
    side = json.loads(sidecar_path(tmp_path, 0).read_text())
    side["abi"] = side["abi"].replace("moet-quant/1", "moet-quant/0")
    sidecar_path(tmp_path, 0).write_text(json.dumps(side))
    assert open_pack(tmp_path, 0, "A") is None
    sidecar_path(tmp_path, 0).write_text("{not json")
    assert open_pack(tmp_path, 0, "A") is None


def test_verify_finds_corrupted_layer(tmp_path: Path) -> None:
    model = make_model(3, 4, 64, 32, 2, seed=4)
    pack = build_pack(tmp_path, 0, "A", model.layout, 4, 3, lambda layer: model.weights[layer])
    with open(pack_path(tmp_path, 0), "r+b") as f:
        f.seek(pack.offset(1, 2) + 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert pack.verify() == [1]


def test_unwritten_row_is_rejected(tmp_path: Path) -> None:
    model = make_model(2, 4, 64, 32, 2, seed=5)
    writer = PackWriter(tmp_path, 0, "A", model.layout, 4, 2)
    writer.write_layer(0, model.weights[0])
    writer.close()
    from moet.store.pack import Pack, Sidecar

    raw = Pack(pack_path(tmp_path, 0), Sidecar.load(sidecar_path(tmp_path, 0)))
    with pytest.raises(ValueError, match="not a written pack row"):
        raw.read_weights(1, 0)


@pytest.fixture
def small_fs(tmp_path: Path):
    """A 1 MiB tmpfs (needs mount rights; skipped elsewhere)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_directory_is_a_one_line_error(small_fs: Path) -> None:
    layout = RowLayout.for_moe(256, 128, "mx32")  # 2×64 rows of 28 KiB > 1 MiB
    with pytest.raises(MoetError, match=r"store directory .*mnt.* is full .*VLLM_MOE_W2_STORE_DIR") as err:
        build_pack(small_fs, 0, "A", layout, 64, 2, lambda layer: pytest.fail("nothing is quantized for a full disk"))
    assert "\n" not in str(err.value)


def test_read_only_directory_is_a_config_error(small_fs: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    model = make_model(1, 2, 64, 32, 2, seed=7)
    with pytest.raises(ConfigError, match=r"store directory .*mnt.* is not writable .*VLLM_MOE_W2_STORE_DIR"):
        build_pack(small_fs / "packs", 0, "A", model.layout, 2, 1, lambda layer: model.weights[layer])


def test_checkpoint_writer_keeps_the_fp4_tier_and_is_reused(tmp_path: Path, checkpoint) -> None:
    from moet.formats.experts import iter_routed_experts
    from moet.quant.requant import requantize
    from moet.store.build import write_pack_from_checkpoint

    ckpt = checkpoint("qwen3_moe", "nvfp4-experts")
    pack = write_pack_from_checkpoint(ckpt, tmp_path, tier="refine")
    sources = list(iter_routed_experts(ckpt))
    for src in sources:
        if src.key.proj == "gate":
            continue
        got = pack.read_weights(src.key.layer - sources[0].key.layer, src.key.expert)
        want = requantize(src, "refine")
        if src.key.proj == "down":
            assert_same(got[1], want)
        else:
            n = want.codes.shape[0]
            assert torch.equal(fp4_nibbles(got[0])[n:], fp4_nibbles(want))
            assert torch.equal(got[0].codes[n:], want.codes)
    stamp = sidecar_path(tmp_path, 0).stat().st_mtime_ns
    again = write_pack_from_checkpoint(ckpt, tmp_path, tier="refine")
    assert sidecar_path(tmp_path, 0).stat().st_mtime_ns == stamp and again.verify() == []


def test_fusing_halves_under_different_zero_policies_keeps_every_nibble() -> None:
    from moet.store.build import fuse_rows

    gate = parity_weight(16, 64, 1)  # parity policy, a few −0 flips
    gen = torch.Generator().manual_seed(2)
    up = base_from_fp4(torch.randint(0, 256, (16, 32), generator=gen, dtype=torch.uint8),
                       torch.randint(120, 124, (16, 2), generator=gen, dtype=torch.uint8), "mx32", torch.ones(16), "refine")
    assert (gate.zero_policy, up.zero_policy) == ("parity", "sign")
    fused = fuse_rows([gate, up])
    assert torch.equal(fp4_nibbles(fused), torch.cat([fp4_nibbles(gate), fp4_nibbles(up)]))
    assert torch.equal(fused.codes, torch.cat([gate.codes, up.codes]))
    same = fuse_rows([gate, parity_weight(16, 64, 3)])
    assert torch.equal(fp4_nibbles(same), torch.cat([fp4_nibbles(gate), fp4_nibbles(parity_weight(16, 64, 3))]))
