"""The ahead-of-time kernel build runs on a machine without a GPU and yields the intended SASS."""

from __future__ import annotations

import importlib.util
import re
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


def test_prefill_tiles_fit_the_shared_memory_of_each_target(tmp_path):
    """The Triton prefill tiles the host picks (2,048 and 8,192 tokens) compile to no more shared memory than a block
    may take on their target: on sm_90a (227 KiB) the 128-pair tile past PREFILL_WIDE_FROM tokens, on sm_120a (99 KiB)
    the 64-pair one, because the 128-pair tile compiled for sm_120a asks more than 99 KiB (Triton would refuse its
    launch there) and at most PREFILL_WIDE_SHARED anywhere."""
    from dataclasses import replace

    from moet.kernels.moe import PREFILL_WIDE_SHARED

    build = _build_module()
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except ImportError:
        pytest.skip("this Triton has no ahead-of-time target API")
    for arch, widest in ((90, 128), (120, 64)):
        tiles = {v for v in build.variants(False, build.BLOCK_SHARED[arch]) if v.route == 1 and v.scale_b == 32 and v.stage == 13}
        assert max(v.bm for v in tiles) == widest, arch
        for v in tiles:
            assert build.build_one(v, arch, tmp_path)["shared"] <= build.BLOCK_SHARED[arch], (arch, v.name)
    for slots in (False, True):
        wide = replace(next(v for v in tiles if v.slots == slots), bm=128)
        shared = build.build_one(wide, 120, tmp_path)["shared"]
        assert shared <= PREFILL_WIDE_SHARED and (shared > build.BLOCK_SHARED[120]) == (not slots), (wide.name, shared)


def test_host_constants_match_the_kernel_source():
    """moet.kernels.cuda mirrors constants of moe_decode.cu (WARPS sizes its launches, PASS_ROWS its staged bytes,
    MAX_EXPERTS the pass grid's limit), each as the source defines it, and the pass grid pads with glue.PAD; a layer
    with more experts than the pass grid counts gets an error naming the limit, before any launch."""
    import torch

    from moet.kernels import cuda
    from moet.kernels.glue import PAD

    source = (BUILD.parent.parent / "moet" / "kernels" / "src" / "moe_decode.cu").read_text()
    for name in ("WARPS", "PASS_ROWS", "MAX_EXPERTS"):
        defined = re.search(rf"constexpr int {name} = (\d+);", source)
        assert defined and int(defined[1]) == getattr(cuda, name), name
    assert "constexpr int PAD = 1 << 30;" in source and PAD == 1 << 30  # moe_pass_grid pads as align does
    with pytest.raises(ValueError, match="at most 1024 experts a layer, not 1025"):
        cuda.pass_grid(torch.zeros(1, 2, dtype=torch.int32), 1025)


needs_nvcc = pytest.mark.skipif(not __import__("shutil").which("nvcc"), reason="the CUDA decode kernels need nvcc to build")


@pytest.fixture(scope="module")
def sm90_decode(tmp_path_factory):
    """(the build's output folder, its MANIFEST rows by kernel) of moe_decode.cu for sm_90a, built once."""
    out = tmp_path_factory.mktemp("cubins")
    return out, {row["kernel"]: row for row in _build_module().build_cuda(90, out)}


@needs_nvcc
def test_cuda_decode_build_has_every_kernel_the_host_launches(sm90_decode):
    """nvcc builds moet/kernels/src/moe_decode.cu for sm_90a; every entry point moet.kernels.cuda can name exists,
    the GEMMs use mma.sync (HMMA), the tunings the host picks spill nothing inside their K loops (at most a word or two
    kept across the gather: the six-blocks-per-SM pick keeps one at 80 registers), and the combine and pass-grid
    kernels do not spill."""
    from moet.kernels import cuda

    out, rows = sm90_decode
    assert (out / "sm_90a" / cuda.CUBIN).stat().st_size > 0
    for scale_block in (16, 32):
        for stage in (13, 2):
            for tuning in cuda.TUNINGS:
                name = cuda.kernel_name(scale_block, stage, tuning)
                assert name in rows, name
                assert rows[name]["mma"].get("HMMA", 0) > 0, rows[name]
            picks = (cuda.DEFAULT_TUNING, cuda.WIDE_TUNING, cuda.STAGED_TUNING, cuda.STREAMED_TUNING)
            for tuning in picks:  # every tuning the host picks
                row = rows[cuda.kernel_name(scale_block, stage, tuning)]
                assert row["loop_spills"] == 0 and row["stack"] <= 16, row
    for helper in ("moe_combine_bf16", "moe_pass_grid"):  # no matrix instructions, no stack
        assert rows[helper]["mma_ok"] and rows[helper]["stack"] == 0, rows[helper]


def test_block_scaled_build_uses_qmma_on_sm120(tmp_path):
    """moet.kernels.blackwell's specialisations built for sm_120a hold the block-scaled FP8 MMA (QMMA.SF …
    E4M3.E4M3 with UE8M0 scales) and do not spill; a mixed-tier one holds both bodies' MMAs. sm_120a: built,
    never run (no such GPU here)."""
    build = _build_module()
    rows = {v: build.build_one(v, 120, tmp_path) for v in build.mx_variants(quick=False) if v.terms == 2}
    for v, row in rows.items():
        assert row["mma"].get("QMMA", 0) > 0 and "HMMA" not in row["mma"], row
        assert row["stack"] == 0 and row["spill_ldl_stl"] == 0 and row["mma_ok"], row
        if v.slots:
            base = rows[build.MxVariant(False, v.stage, v.terms, v.blocks, v.bm, v.num_warps, v.num_stages)]
            assert row["mma"]["QMMA"] == 2 * base["mma"]["QMMA"], (row, base)
    sass = (tmp_path / "sm_120a").glob("mx_gemm_*.cubin")
    assert "QMMA.SF.16832.F32.E4M3.E4M3.E8" in build.disassemble(next(sass))[1]


def test_block_scaled_build_on_sm90_is_decomposed(tmp_path):
    """Hopper has no block-scaled MMA: Triton decomposes tl.dot_scaled into a bf16 upcast and mma.sync (HMMA)."""
    build = _build_module()
    row = build.build_one(build.mx_variants(quick=True)[0], 90, tmp_path)
    assert row["mma"].get("HMMA", 0) > 0 and "QMMA" not in row["mma"] and row["mma_ok"], row


@pytest.mark.parametrize("lhs,rhs,mma", [
    ("e4m3", "e4m3", "QMMA.SF.16832.F32.E4M3.E4M3.E8"),
    ("e2m1", "e2m1", "OMMA.SF.16864.F32.E2M1.E2M1.E8"),
    ("e4m3", "e2m1", "HMMA.16816.F32.BF16"),
])
def test_dot_scaled_lowering_on_sm120(tmp_path, lhs, rhs, mma):
    """What Triton makes of tl.dot_scaled (UE8M0/32 scales) on sm_120a: equal formats reach the block-scaled MMA,
    mixed e4m3 × e2m1 falls back to bf16 HMMA. Why moet.kernels.blackwell widens its weights to e4m3; when
    the mixed case turns into QMMA, e2m1 weights (half the operand bytes) become the better choice."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    @triton.jit
    def probe(a_ptr, b_ptr, sa_ptr, sb_ptr, out_ptr, A: tl.constexpr, B: tl.constexpr, PA: tl.constexpr, PB: tl.constexpr):
        m = tl.arange(0, 64)
        a = tl.load(a_ptr + m[:, None] * (128 // PA) + tl.arange(0, 128 // PA)[None, :])
        b = tl.load(b_ptr + tl.arange(0, 128 // PB)[:, None] * 64 + m[None, :])
        sa = tl.load(sa_ptr + m[:, None] * 4 + tl.arange(0, 4)[None, :])
        sb = tl.load(sb_ptr + m[:, None] * 4 + tl.arange(0, 4)[None, :])
        tl.store(out_ptr + m[:, None] * 64 + m[None, :], tl.dot_scaled(a, sa, A, b, sb, B))

    ty = {"e4m3": "*fp8e4nv", "e2m1": "*u8"}
    cx = dict(A=lhs, B=rhs, PA=2 if lhs == "e2m1" else 1, PB=2 if rhs == "e2m1" else 1)
    sig = dict(a_ptr=ty[lhs], b_ptr=ty[rhs], sa_ptr="*u8", sb_ptr="*u8", out_ptr="*fp32") | {k: "constexpr" for k in cx}
    kernel = triton.compile(ASTSource(probe, sig, cx), target=GPUTarget("cuda", 120, 32), options=dict(num_warps=4))
    cubin = tmp_path / "probe.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    build = _build_module()
    sass = build.disassemble(cubin)[1]
    assert mma in sass and set(re.findall(r"\b([HQO]MMA)\.", sass)) == {mma.split(".")[0]}


@pytest.mark.skipif(not __import__("shutil").which("nvcc"), reason="the read-pattern tool needs nvcc to build")
def test_read_pattern_tool_builds_every_kernel_with_its_work(tmp_path):
    """scripts/read_pattern.cu builds for sm_90a with every kernel scripts/read_pattern.py launches; the ring
    kernels with WORK keep (nearly) their 120 IMADs per chunk in SASS, where a plain C++ multiply-add chain was folded
    into one per word (2026-12-06), and the ones without keep few."""
    spec = importlib.util.spec_from_file_location("read_pattern", BUILD.parent / "read_pattern.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    cubin = tmp_path / "read_pattern.cubin"
    tool.build(cubin)
    build = _build_module()
    bodies = build.kernel_bodies(build.disassemble(cubin)[1])
    assert set(tool.KERNELS) <= set(bodies), sorted(bodies)
    for name in tool.KERNELS:
        ring, work = map(int, re.fullmatch(r"read_ring_r(\d+)_w(\d+)", name).groups())
        imads = len(re.findall(r"\bIMAD\b(?!\.(?:MOV|WIDE|SHL|HI|X|IADD|U32))", bodies[name]))
        assert (imads >= 0.9 * work * ring) if work else (imads < 64), (name, imads)


def test_loop_spills_counts_local_memory_inside_the_matrix_loops_only():
    """Hand-written SASS in cuobjdump's form: a loop (0x10-0x40, closed by a predicated backward branch) holding an
    HMMA and one LDL, a spill store before it and a reload after it, and a loop without matrix instructions holding an
    STL: one local access counts, inside the one matrix loop of four instructions."""
    build = _build_module()
    sass = "\n".join(f"        /*{a:04x}*/                   {text} ;" for a, text in [
        (0x00, "STL [R1], R2"), (0x10, "LDG.E.128 R8, desc[UR4][R2.64]"), (0x20, "HMMA.16816.F32.BF16 R4, R8, R12, R4"),
        (0x30, "LDL R3, [R1]"), (0x40, "@P0 BRA 0x10"), (0x50, "LDL R8, [R1]"), (0x60, "STL [R1+0x4], R8"),
        (0x70, "@!P1 BRA 0x60"), (0x80, "EXIT")])
    assert build.mma_loops(sass) == [(4, 1)]
    assert build.loop_spills(sass) == 1
    assert build.loop_spills(sass.replace("LDL R3, [R1]", "IADD3 R3, R3, 0x1, RZ")) == 0


@needs_nvcc
def test_cuda_decode_k_loops_as_the_source_unrolls_them(sm90_decode):
    """Each sm_90a decode kernel's SASS holds, per body, one innermost K loop with the 8·RING·BLOCKS HMMA its tuning
    unrolls (the 2-bit base's and the FP4 body's; scripts/build_kernels.chunk_instructions). With UE8M0 scales a base
    pair is a mask and one IMAD (pair 7 of a word one LOP3 more), so a chunk's 32 pairs and 8 HMMA take 76
    instructions; the host's picks add at most 28 for loads, the scale pair, addresses and the loop (99.6-102.8 with
    nvcc 13.0), and their FP4 loops stay within 176 a chunk (twice the bytes)."""
    from moet.kernels import cuda

    rows = sm90_decode[1]
    for name, row in rows.items():
        if name.startswith("moe_decode"):
            assert row["chunk_instructions"] is not None, name
    for tuning in (cuda.DEFAULT_TUNING, cuda.WIDE_TUNING, cuda.STAGED_TUNING, cuda.STREAMED_TUNING):
        for stage in (13, 2):
            base, fp4 = rows[cuda.kernel_name(32, stage, tuning)]["chunk_instructions"]
            assert 76 < base <= 104 and fp4 <= 176, (tuning, stage, base, fp4)
