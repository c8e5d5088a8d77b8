"""One MoE layer at DeepSeek-V4-Flash shape, for Nsight Compute (a device-visit tool).

    ncu --clock-control none --set full -k regex:moe_decode --launch-count 2 \
        python3 scripts/profile_decode.py --tier base --tokens 1 --tuning r8b1k1x0_r2b2k2x1

(scripts/profile_decode.sh runs it with the pipe and stall metrics of docs/KERNELS.md.) A CUDA decode tuning, or
"oracle": the kernels and tiles the oracle picks for the token count (past 512 tokens on an H100 or H200, the Gluon
prefill kernel; profile_decode.sh matches it too).

16 experts by default (their bytes dwarf nothing but ncu flushes the caches between its passes anyway); a prefill
takes --experts 256 for the pairs per expert of the real layer.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    import torch

    from moet.kernels.glue import select_experts
    from moet.kernels.layout import Fp4Slots, StackedWeights, mma_fp4_words
    from moet.kernels.moe import cuda_config, fused_moe_2bit
    from moet.kernels.oracle import select_moe_backend
    from moet.testing.random_stacked import random_stored

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tier", default="base", choices=("base", "fp4"))
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--tuning", default="r8b1k1x0_r2b2k2x1", help='a CUDA decode tuning, or "oracle" (the picked kernels)')
    parser.add_argument("--scale-kind", default="mx32", choices=("mx32", "nv16"))
    parser.add_argument("--experts", type=int, default=16)
    args = parser.parse_args()
    hidden, inter, experts, top_k = 4096, 2048, args.experts, 6
    s13 = random_stored(experts, 2 * inter, hidden, args.scale_kind, "cuda", seed=1, refine=False)
    s2 = random_stored(experts, hidden, inter, args.scale_kind, "cuda", seed=2, refine=False)
    w13 = StackedWeights.from_stacked(s13, torch.device("cuda"), gate_up=True)
    w2 = StackedWeights.from_stacked(s2, torch.device("cuda"), gate_up=False)
    slots = None
    if args.tier == "fp4":
        slots = Fp4Slots.every_expert(mma_fp4_words(s13.fp4, True), mma_fp4_words(s2.fp4, False))
    x = torch.randn(args.tokens, hidden, device="cuda").to(torch.bfloat16)
    weights, ids = select_experts(torch.randn(args.tokens, experts, device="cuda"), top_k)
    if args.tuning == "oracle":
        configs, backend = None, select_moe_backend(x.device, args.tokens)
    else:
        configs = (cuda_config(args.tuning), cuda_config(args.tuning))
        backend = configs[0].backend
    out = fused_moe_2bit(x, weights, ids, w13, w2, slots=slots, configs=configs, backend=backend)
    torch.cuda.synchronize()
    print(f"profiled {args.tier} T={args.tokens} {args.tuning}: |out| = {out.float().norm().item():.3e}")


if __name__ == "__main__":
    main()
