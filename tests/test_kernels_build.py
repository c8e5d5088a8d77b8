"""The ahead-of-time kernel build runs on a machine without a GPU and yields the intended SASS."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

BUILD = Path(__file__).resolve().parent.parent / "scripts" / "build_kernels.py"


def _build_module():
    spec = importlib.util.spec_from_file_location("moet_kernels_build", BUILD)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("arch,mma", [(90, "HGMMA"), (120, "HMMA")])
def test_aot_build_emits_tensor_core_sass(tmp_path, arch, mma):
    build = _build_module()
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except ImportError:
        pytest.skip("this Triton has no ahead-of-time target API")
    variant = build.variants(quick=True)[0]
    row = build.build_one(variant, arch, tmp_path)
    assert (tmp_path / f"sm_{arch}a" / f"{variant.name}.cubin").stat().st_size > 0
    assert row["mma"].get(mma, 0) > 0, row
    assert row["stack"] == 0 and row["spill_ldl_stl"] == 0, row
    manifest = tmp_path / "MANIFEST"
    build.write_manifest([row], manifest)
    assert "cannot" in manifest.read_text() or "never been run" in manifest.read_text()


@pytest.mark.skipif(not __import__("shutil").which("nvcc"), reason="the CUDA decode kernels need nvcc to build")
def test_cuda_decode_build_has_every_kernel_the_host_launches(tmp_path):
    """nvcc builds moet/kernels/src/moe_decode.cu for sm_90a; every entry point moet.kernels.cuda can name exists,
    uses mma.sync (HMMA), and the default tunings do not spill."""
    from moet.kernels import cuda

    build = _build_module()
    rows = {row["kernel"]: row for row in build.build_cuda(90, tmp_path)}
    assert (tmp_path / "sm_90a" / cuda.CUBIN).stat().st_size > 0
    for scale_block in (16, 32):
        for stage in (13, 2):
            for tokens in (1, 64):
                for tuning in cuda.TUNINGS:
                    name = cuda.kernel_name(scale_block, stage, tokens, tuning)
                    assert name in rows, name
                    assert rows[name]["mma"].get("HMMA", 0) > 0, rows[name]
                default = rows[cuda.kernel_name(scale_block, stage, tokens, cuda.DEFAULT_TUNING)]
                if tokens <= 8:  # one n-tile: the decode shapes the targets name
                    assert default["stack"] == 0, default


def test_block_scaled_build_uses_qmma_on_sm120(tmp_path):
    """moet.kernels.blackwell's specialisations built for sm_120a hold the block-scaled FP8 MMA (QMMA.SF …
    E4M3.E4M3 with UE8M0 scales) and do not spill; a mixed-tier one holds both bodies' MMAs. sm_120a: built,
    never run (no such GPU here)."""
    build = _build_module()
    rows = {v: build.build_one(v, 120, tmp_path) for v in build.mx_variants(quick=False)}
    for v, row in rows.items():
        assert row["mma"].get("QMMA", 0) > 0 and "HMMA" not in row["mma"], row
        assert row["stack"] == 0 and row["spill_ldl_stl"] == 0 and row["mma_ok"], row
        if v.slots:
            base = rows[build.MxVariant(False, v.stage, v.blocks, v.bm, v.num_warps, v.num_stages)]
            assert row["mma"]["QMMA"] == 2 * base["mma"]["QMMA"], (row, base)
    sass = (tmp_path / "sm_120a").glob("mx_gemm_*.cubin")
    dump = subprocess.run([build._tool("cuobjdump"), "--dump-sass", str(next(sass))], capture_output=True, text=True, check=True)
    assert "QMMA.SF.16832.F32.E4M3.E4M3.E8" in dump.stdout


def test_block_scaled_build_on_sm90_is_decomposed(tmp_path):
    """Hopper has no block-scaled MMA: Triton decomposes tl.dot_scaled into a bf16 upcast and mma.sync (HMMA)."""
    build = _build_module()
    row = build.build_one(build.mx_variants(quick=True)[0], 90, tmp_path)
    assert row["mma"].get("HMMA", 0) > 0 and "QMMA" not in row["mma"] and row["mma_ok"], row
