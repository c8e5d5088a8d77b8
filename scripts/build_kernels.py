"""Ahead-of-time build of moet's MoE kernels to cubins for sm_90a and sm_120a, with a MANIFEST.

Needs no GPU. The Triton kernels: triton.compile(ASTSource, target=GPUTarget) runs Triton's full
pipeline and ptxas. The CUDA C++ decode kernels (moet/kernels/src/moe_decode.cu): nvcc -cubin, one cubin per
target holding every specialisation (moet.kernels.cuda loads it). For each kernel the MANIFEST
records registers, shared memory, stack (spills) and the matrix instructions found in the SASS by
cuobjdump (Triton moe_gemm: HGMMA expected on sm_90a, HMMA on sm_120a; the block-scaled mx_gemm
(moet.kernels.blackwell): QMMA on sm_120a, and on sm_90a, where Triton decomposes tl.dot_scaled into a
bf16 upcast, HMMA; CUDA decode: HMMA, mma.sync, on both, and the instructions of their K loops per chunk).
sm_120a cubins are built and disassembled here but cannot be run anywhere in this project.

    python scripts/build_kernels.py [--out moet/kernels/cubins] [--targets 90,120] [--quick] [--cuda-only]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from moet.kernels.moe import SM90_BLOCK_SHARED  # noqa: E402  (moet from this checkout)

DECODE_TOKENS = (1, 4, 16, 64)
TOP_K = 8  # the decode variants' P_P2 = next_pow2(T·k); top-6 models round to the same value
MATRIX_OPS = ("HGMMA", "HMMA", "QMMA", "OMMA", "IMMA")
EXPECTED = {90: "HGMMA", 120: "HMMA"}
# The shared memory a block may take on each target (the CUDA C++ Programming Guide's table per compute capability;
# sm_90's is the host's figure where no device says): the Triton tiles the host picks there
# (moet.kernels.moe.default_configs' block_shared) must fit it.
BLOCK_SHARED = {90: SM90_BLOCK_SHARED, 120: 99 << 10}
MX_EXPECTED = {90: "HMMA", 120: "QMMA"}  # QMMA.SF.16832.F32.E4M3.E4M3.E8 on sm_120a


@dataclass(frozen=True)
class Variant:
    """One specialisation of moe_gemm_kernel: the constexprs plus warps and stages."""

    slots: bool
    stage: int
    route: int
    scale_b: int
    blocks: int
    bm: int
    p_p2: int
    split: int
    num_warps: int
    num_stages: int

    @property
    def name(self) -> str:
        tiers = "mixed" if self.slots else "base"
        route = "decode" if self.route == 0 else "prefill"
        return (f"moe_gemm_{tiers}_w{self.stage}_{route}_b{self.scale_b}_r{self.blocks}m{self.bm}"
                f"_p{self.p_p2}_s{self.split}_w{self.num_warps}x{self.num_stages}")

    def kernel(self):
        from moet.kernels.gemm import moe_gemm_kernel

        return moe_gemm_kernel

    def signature(self) -> dict[str, str]:
        sig = {name: "*i32" for name in self.kernel().arg_names if name.endswith("_ptr")}
        sig.update(x_ptr="*bf16", out_ptr="*fp32" if self.stage == 2 or self.split > 1 else "*bf16",
                   scales_ptr="*u8", row_scale_ptr="*fp32", topk_w_ptr="*fp32",
                   T="i32", N_OUT="i32", K="i32", TOPK="i32")
        return sig

    def constexprs(self) -> dict[str, int]:
        from moet.kernels.moe import ROWS_FIRST_FROM_BM

        # with a slot table: decode branches per program (TIERS 2); prefill launches per tier, this the FP4 one
        tiers = 0 if not self.slots else 2 if self.route == 0 else 1
        return dict(STAGE=self.stage, ROUTE=self.route, SCALE_B=self.scale_b, HAS_SLOTS=self.slots, TIERS=tiers,
                    BLOCKS=self.blocks, BM=self.bm, TOPK_P2=TOP_K, P_P2=self.p_p2, SPLIT=self.split,
                    ROWS_FIRST=self.route == 1 and self.bm >= ROWS_FIRST_FROM_BM)

    @staticmethod
    def expected(arch: int) -> str:
        return EXPECTED.get(arch, "?")


@dataclass(frozen=True)
class MxVariant:
    """One specialisation of moet.kernels.blackwell.mx_gemm_kernel (block-scaled MMA, UE8M0/32 only)."""

    slots: bool
    stage: int
    terms: int
    blocks: int
    bm: int
    num_warps: int
    num_stages: int

    @property
    def name(self) -> str:
        tiers = "mixed" if self.slots else "base"
        return (f"mx_gemm_{tiers}_w{self.stage}_b32_t{self.terms}_r{self.blocks}m{self.bm}"
                f"_w{self.num_warps}x{self.num_stages}")

    def kernel(self):
        from moet.kernels.blackwell import mx_gemm_kernel

        return mx_gemm_kernel

    def signature(self) -> dict[str, str]:
        sig = {name: "*i32" for name in self.kernel().arg_names if name.endswith("_ptr")}
        sig.update(xq_ptr="*u8", xs_ptr="*u8", out_ptr="*bf16" if self.stage == 13 else "*fp32", scales_ptr="*u8",
                   row_scale_ptr="*fp32", topk_w_ptr="*fp32", T="i32", N_OUT="i32", K="i32", TOPK="i32")
        return sig

    def constexprs(self) -> dict[str, int]:
        return dict(STAGE=self.stage, HAS_SLOTS=self.slots, TERMS=self.terms, BLOCKS=self.blocks, BM=self.bm)

    @staticmethod
    def expected(arch: int) -> str:
        return MX_EXPECTED.get(arch, "?")


def variants(quick: bool, block_shared: int = BLOCK_SHARED[90]) -> list[Variant]:
    """The specialisations moet.kernels.moe launches for the benchmarked geometries on a GPU whose blocks may take
    `block_shared` bytes of shared memory."""
    from moet.kernels.moe import default_configs, triton_next_pow2

    out = []
    for slots in (False, True):
        for scale_b in (16, 32):
            for tokens in DECODE_TOKENS + (2048, 8192):
                c13, c2 = default_configs(tokens, 4096, 2048, block_shared=block_shared)
                route = 0 if tokens <= 64 else 1
                p_p2 = triton_next_pow2(tokens * TOP_K) if route == 0 else 1
                for stage, c in ((13, c13), (2, c2)):
                    out.append(Variant(slots, stage, route, scale_b, c.blocks, c.bm, p_p2, c.split, c.num_warps, c.num_stages))
    out = list(dict.fromkeys(out))  # token counts that pick the same tile build it once
    return out[:1] + [v for v in out if v.route == 1][:1] if quick else out


def mx_variants(quick: bool) -> list[MxVariant]:
    """The specialisations moet.kernels.blackwell launches: its decode and prefill tiles, both stages, ± slot
    table, one or two e4m3 activation terms."""
    from moet.kernels.blackwell import DECODE_CONFIG, PREFILL_CONFIG

    out = [MxVariant(slots, stage, terms, c.blocks, c.bm, c.num_warps, c.num_stages)
           for terms in (2, 1) for slots in (False, True) for c in (DECODE_CONFIG, PREFILL_CONFIG) for stage in (13, 2)]
    return out[:1] if quick else out


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def jit_alignment(arg_names: list[str]) -> dict:
    """What the JIT assumes for moet's launches: 16-byte aligned buffers, K and N multiples of 16 (of 128, in fact)."""
    return {(i,): [["tt.divisibility", 16]] for i, name in enumerate(arg_names) if name.endswith("_ptr") or name in ("K", "N_OUT")}


def disassemble(cubin: Path) -> tuple[str, str]:
    """(cuobjdump's resource usage, its SASS) of a cubin."""
    usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    sass = subprocess.run([_tool("cuobjdump"), "--dump-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    return usage, sass


def kernel_bodies(sass: str) -> dict[str, str]:
    """Each kernel's SASS in a cuobjdump dump of a cubin holding several, by name."""
    return dict(re.findall(r"Function : (\S+)\n(.*?)(?=\n\s+Function : |\Z)", sass, re.S))


def _inner_mma_loops(body: str) -> list[list[str]]:
    """The instructions of each innermost loop of a kernel's SASS that holds matrix instructions: a backward branch
    and the instructions from its target up to it, holding no other such loop."""
    ins = [(int(a, 16), text.strip()) for a, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]+);", body)]
    at = {a: i for i, (a, _) in enumerate(ins)}
    loops = []
    for i, (a, text) in enumerate(ins):
        branch = re.match(r"(?:@!?U?P\w+\s+)?BRA(?:\.\w+)*\s+(?:`\()?\S*?0x([0-9a-f]+)", text)
        if branch and int(branch[1], 16) < a and int(branch[1], 16) in at:
            first = at[int(branch[1], 16)]
            if any(t.startswith("HMMA") for _, t in ins[first : i + 1]):
                loops.append((first, i))
    inner = [l for l in loops if not any(o != l and l[0] <= o[0] and o[1] <= l[1] for o in loops)]
    return [[t for _, t in ins[first : last + 1]] for first, last in inner]


def mma_loops(body: str) -> list[tuple[int, int]]:
    """(instructions, HMMA) of each innermost loop of a kernel's SASS that holds matrix instructions."""
    return [(len(loop), sum(t.startswith("HMMA") for t in loop)) for loop in _inner_mma_loops(body)]


def loop_spills(body: str) -> int:
    """Local-memory loads and stores (LDL/STL) inside a kernel's innermost matrix loops: a spill there costs every
    chunk; one outside (a value kept across the gather) costs once a pass."""
    return sum(bool(re.match(r"(?:@!?U?P\w+\s+)?(?:LDL|STL)\b", t)) for loop in _inner_mma_loops(body) for t in loop)


def chunk_instructions(name: str, body: str) -> tuple[float, float] | None:
    """Instructions a warp issues per 128-k chunk of a 16-row block (8 HMMA: 2,048 weights) in the K loop of decode
    kernel `name`'s 2-bit base body and of its FP4 body: the innermost loop holding the 8·RING·BLOCKS HMMA of each
    body's tuning (moe_decode_b<scale block>_w<stage>_<tuning>). None where ptxas laid a body's loop out otherwise
    (several overlapping backward branches: most sm_120a kernels)."""
    from moet.kernels.cuda import tuning_halves

    loops = mma_loops(body)
    per_chunk = []
    for ring, blocks, _, _ in tuning_halves(name.split("_", 4)[4]):
        matches = [count for count, hmma in loops if hmma == 8 * ring * blocks]
        if len(matches) != 1:
            return None
        per_chunk.append(matches[0] / ring / blocks)
    return per_chunk[0], per_chunk[1]


def build_one(v: Variant | MxVariant, arch: int, out_dir: Path) -> dict:
    """Compile one variant for sm_{arch}a; write its cubin and metadata; return its MANIFEST row."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cx = v.constexprs()
    sig = v.signature() | {k: "constexpr" for k in cx}
    kernel = triton.compile(
        ASTSource(v.kernel(), sig, cx, jit_alignment(v.kernel().arg_names)),
        target=GPUTarget("cuda", arch, 32),
        options=dict(num_warps=v.num_warps, num_stages=v.num_stages),
    )
    target_dir = out_dir / f"sm_{arch}a"
    target_dir.mkdir(parents=True, exist_ok=True)
    cubin = target_dir / f"{v.name}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    usage, sass = disassemble(cubin)
    ops = {op: len(re.findall(rf"\b{op}\.", sass)) for op in MATRIX_OPS}
    row = dict(
        kernel=v.name,
        target=f"sm_{arch}a",
        **asdict(v),
        regs=int(re.search(r"REG:(\d+)", usage).group(1)),
        stack=int(re.search(r"STACK:(\d+)", usage).group(1)),
        shared=int(kernel.metadata.shared),
        spill_ldl_stl=len(re.findall(r"\b(?:LDL|STL)\b", sass)),
        mma={k: n for k, n in ops.items() if n},
        expected_mma=v.expected(arch),
        mma_ok=ops.get(v.expected(arch), 0) > 0,
        triton_name=kernel.metadata.name,
    )
    (target_dir / f"{v.name}.json").write_text(json.dumps(row, indent=1) + "\n")
    return row


def _build(args: tuple) -> dict:
    return build_one(*args)


def build_cuda(arch: int, out_dir: Path) -> list[dict]:
    """nvcc moet/kernels/src/moe_decode.cu → sm_{arch}a/moe_decode.cubin; one MANIFEST row per entry point."""
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not Path(nvcc).exists():
        raise SystemExit("scripts/build_kernels.py: nvcc not found (install the CUDA toolkit or put nvcc on PATH)")
    target_dir = out_dir / f"sm_{arch}a"
    target_dir.mkdir(parents=True, exist_ok=True)
    cubin = target_dir / "moe_decode.cubin"
    partial = cubin.with_suffix(".cubin.partial")
    subprocess.run(
        [nvcc, "-cubin", "-O3", "-std=c++17", f"-gencode=arch=compute_{arch}a,code=sm_{arch}a",
         "-o", str(partial), str(ROOT / "moet" / "kernels" / "src" / "moe_decode.cu")],
        check=True,
    )
    partial.replace(cubin)
    usage, sass = disassemble(cubin)
    bodies = kernel_bodies(sass)
    rows = []
    for name, regs, stack, shared in re.findall(r"Function (\S+):\s+REG:(\d+) STACK:(\d+) SHARED:(\d+)", usage):
        body = bodies.get(name, "")
        ops = {op: len(re.findall(rf"\b{op}\.", body)) for op in MATRIX_OPS}
        gemm = name.startswith("moe_decode")  # moe_combine_bf16 adds rows, moe_pass_grid sorts pairs
        rows.append(dict(
            kernel=name, target=f"sm_{arch}a", regs=int(regs), stack=int(stack), shared=int(shared),
            spill_ldl_stl=len(re.findall(r"\b(?:LDL|STL)\b", body)), loop_spills=loop_spills(body) if gemm else 0,
            mma={k: n for k, n in ops.items() if n},
            expected_mma="HMMA" if gemm else "-", mma_ok=ops["HMMA"] > 0 if gemm else not any(ops.values()),
            chunk_instructions=chunk_instructions(name, body) if gemm else None,
        ))
    return rows


def _no_spill(row: dict) -> bool:
    """A decode kernel spills nothing inside its K loops; any other kernel has no stack."""
    return row["loop_spills"] == 0 if row["kernel"].startswith("moe_decode") else row["stack"] == 0


def write_manifest(rows: list[dict], path: Path) -> None:
    import triton

    lines = [
        "# moet kernels MANIFEST (written by scripts/build_kernels.py; do not edit)",
        f"# Triton {triton.__version__}; cubins under moet/kernels/cubins/sm_<arch>a/. sm_120a is built and its SASS",
        "# checked here, but no sm_120 GPU exists in this project: those cubins have never been run.",
        "# moe_gemm_* (Triton, bf16 operands): HGMMA on sm_90a, HMMA on sm_120a.",
        "# mx_gemm_* (Triton, moet/kernels/blackwell.py: tl.dot_scaled e4m3 x e4m3, UE8M0/32 scales applied by the MMA):",
        "# QMMA (QMMA.SF.16832.F32.E4M3.E4M3.E8) on sm_120a; on sm_90a Triton decomposes dot_scaled into a bf16 upcast (HMMA).",
        "# moe_decode_* (CUDA C++, moet/kernels/src/moe_decode.cu, one cubin per target) use mma.sync: HMMA on both targets;",
        "# each holds the 2-bit base and the FP4 body (<base tuning>_<FP4 tuning>[_o<blocks per SM>]), chosen per expert at",
        "# run time; moe_combine_bf16 and moe_pass_grid (same cubin: the combine, the many-token grid) have no matrix",
        "# instructions.",
        "# per-chunk (moe_decode_* only): instructions a warp issues in the K loop per 128-k chunk of a 16-row block",
        "# (8 HMMA, 2,048 weights), 2-bit base/FP4 body; \"-\" where ptxas laid a loop out with several overlapping",
        "# branches (most sm_120a kernels). At a fast memory's read speed the decode is issue-bound (docs/KERNELS.md).",
        "# ok: the expected matrix instructions and no stack (moe_decode_*: no LDL/STL inside the K loops; a value spilled",
        "# across the gather costs once a pass).",
        "# columns: kernel target regs stack(B) shared(B) LDL/STL matrix-ops expected ok per-chunk",
    ]
    for r in sorted(rows, key=lambda r: (r["target"], r["kernel"])):
        mma = ",".join(f"{k}x{n}" for k, n in r["mma"].items()) or "-"
        chunk = r.get("chunk_instructions")
        lines.append(f"{r['kernel']} {r['target']} {r['regs']} {r['stack']} {r['shared']} {r['spill_ldl_stl']} "
                     f"{mma} {r['expected_mma']} {'OK' if r['mma_ok'] and _no_spill(r) else 'CHECK'} "
                     + (f"{chunk[0]:.1f}/{chunk[1]:.1f}" if chunk else "-"))
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "moet" / "kernels" / "cubins")
    parser.add_argument("--manifest", type=Path, default=ROOT / "moet" / "kernels" / "MANIFEST")
    parser.add_argument("--targets", default="90,120")
    parser.add_argument("--quick", action="store_true", help="one decode and one prefill variant per target")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--cuda-only", action="store_true", help="only the CUDA decode kernels (nvcc); no MANIFEST")
    args = parser.parse_args(argv)
    rows = [row for arch in args.targets.split(",") for row in build_cuda(int(arch), args.out)]
    if args.cuda_only:
        print(f"built the CUDA decode cubins ({len(rows)} kernels) under {args.out}")
        return 0
    jobs = [(v, int(arch), args.out) for arch in args.targets.split(",")
            for v in variants(args.quick, BLOCK_SHARED[int(arch)]) + mx_variants(args.quick)]
    with ProcessPoolExecutor(args.jobs) as pool:
        rows += list(pool.map(_build, jobs))
    write_manifest(rows, args.manifest)
    bad = [r["kernel"] + " " + r["target"] for r in rows if not r["mma_ok"]]
    big = [r["kernel"] + " " + r["target"] for r in rows if r["shared"] > BLOCK_SHARED[int(r["target"][3:-1])]]
    print(f"built {len(rows)} cubins; MANIFEST at {args.manifest}" + (f"; missing MMA: {bad}" if bad else "")
          + (f"; more shared memory than a block of the target may take: {big}" if big else ""))
    return 1 if bad or big else 0


if __name__ == "__main__":
    sys.exit(main())
