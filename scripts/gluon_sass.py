"""Compile moet.kernels.hopper's Gluon prefill kernel for sm_90a without a GPU and print what ptxas made of it.

Needs Triton 3.6 (the H200's; Gluon's API moves between releases), e.g. `pip install --target /tmp/t36
triton==3.6.0` and PYTHONPATH=/tmp/t36. Per variant: registers, stack, shared memory, and counts of the SASS
instructions that matter for the kernel (HGMMA, barriers, shared-memory traffic, spills); the SASS goes to --out.

    PYTHONPATH=/tmp/t36 python scripts/gluon_sass.py 13,32,0,0,128,4,8 2,16,1,1,64,4,8
    (STAGE, SCALE_B, HAS_SLOTS, TIER, BM, STAGES, WARPS; TIER 1, the FP4 experts, needs HAS_SLOTS)
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from build_kernels import disassemble, jit_alignment  # scripts/ is on sys.path; it puts the repository there

OPS = ("HGMMA", "WARPGROUP.DEPBAR", "BAR.SYNC", "STS", "LDS", "LDGSTS", "SHF.R.W", "LOP3", "IMAD", "LEA", "HMUL2", "LDL", "STL")
POINTERS = {"x_ptr": "*bf16", "words_ptr": "*i32", "scales_ptr": "*u8", "row_scale_ptr": "*fp32", "slots_ptr": "*i32",
            "topk_w_ptr": "*fp32"}


def _word(op: str) -> str:
    return r"\b" + re.escape(op) + r"\b"


def build(stage: int, scale_b: int, slots: int, tier: int, bm: int, stages: int, warps: int, out: Path) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from moet.kernels.hopper import moe_prefill_sm90_kernel as kernel

    sig = {}
    for name in kernel.arg_names:
        if name == "out_ptr":
            sig[name] = "*bf16" if stage == 13 else "*fp32"
        elif name.endswith("_ptr"):
            sig[name] = POINTERS.get(name, "*i32")
        elif name in ("T", "N_OUT", "K", "TOPK"):
            sig[name] = "i32"
        else:
            sig[name] = "constexpr"
    cx = dict(STAGE=stage, SCALE_B=scale_b, HAS_SLOTS=bool(slots), TIER=tier, BM=bm, STAGES=stages, WARPS=warps)
    compiled = triton.compile(GluonASTSource(kernel, sig, cx, jit_alignment(kernel.arg_names)), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=warps))
    name = f"s{stage}_b{scale_b}_slots{slots}_t{tier}_m{bm}_st{stages}_w{warps}"
    cubin = out / f"{name}.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    usage, sass = disassemble(cubin)
    cubin.with_suffix(".sass").write_text(sass)
    counts = " ".join(f"{op}={len(re.findall(_word(op), sass))}" for op in OPS)
    resources = re.search(r"REG:\d+ STACK:\d+", usage).group(0)
    return f"{name}: {resources} shared={compiled.metadata.shared} {counts}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variants", nargs="+", help="STAGE,SCALE_B,HAS_SLOTS,TIER,BM,STAGES,WARPS")
    parser.add_argument("--out", type=Path, default=Path("/tmp/gluon-sass"), help="cubins and SASS (default %(default)s)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for v in args.variants:
        print(build(*(int(x) for x in v.split(",")), args.out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
