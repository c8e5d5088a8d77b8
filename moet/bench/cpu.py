"""One MoE layer on the CPU: the C++ 2-bit kernel vs the PyTorch 2-bit path vs vLLM's own bf16 CPU MoE.

What a serving step costs per MoE layer, so that `moet bench serve` figures can be read: decode
token counts (1, 4, 16) and a prefill chunk, on the embedded model's geometry and on the large
synthetic one `moet bench serve --synthetic` serves. Each timing cycles through `--layers`
layers of fresh weights (so the large geometry reads its experts from memory, not cache) and keeps
the median of `--repeats` rounds; outputs are checked against the float64 reference first.
The bf16 reference is vLLM's CPU MoE op on prepacked weights (what VLLM_MOE_W2=0 runs: AMX tiles where
the CPU has them, else its vector path), or a per-expert PyTorch loop where vLLM's op is missing.
The kernel is timed on bf16 activations (the served dtype: its bf16 paths where the CPU has
AVX512-BF16) and checked against float64 in float32 and in bf16.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from moet.bench.serve import SYNTHETIC

# (hidden, expert width, experts, top-k, scale kind): the embedded model; the synthetic serve model
# (its NVFP4 export keeps e4m3/16 scales, as the embedded model's).
GEOMETRIES = {"default": (256, 256, 16, 4, "nv16"), "large": (*SYNTHETIC[:4], "nv16")}
TOKENS = (1, 4, 16, 512)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--geometries", default=",".join(GEOMETRIES), help="comma-separated subset of %(default)s")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--layers", type=int, default=4, help="layers cycled through per timing")
    parser.add_argument("--repeats", type=int, default=9, help="rounds over the layers per timing (median kept)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out-dir", type=Path, default=None, help="results directory (default bench/results)")


def _bf16_op() -> tuple[str, Callable[..., Any]]:
    """vLLM's CPU MoE op over prepacked bf16 weights if importable, else a per-expert PyTorch loop."""
    import torch

    from moet.testing.reference import bf16_moe_loop, host_routes

    try:
        from vllm._custom_ops import cpu_fused_moe, cpu_prepack_moe_weight

        isa = "amx" if torch.cpu._is_amx_tile_supported() else "vec"
        if isa == "amx":
            torch.cpu._init_amx()

        def prepare(w13: Any, w2: Any) -> tuple[Any, Any]:
            return cpu_prepack_moe_weight(w13, isa), cpu_prepack_moe_weight(w2, isa)

        def run(x: Any, weights: Any, ids: Any, w: tuple[Any, Any]) -> Any:
            out = torch.empty_like(x)
            cpu_fused_moe(out, x, w[0], w[1], None, None, weights, ids, "silu", isa)
            return out

        return f"vllm cpu_fused_moe ({isa})", (prepare, run)
    except (ImportError, AttributeError, RuntimeError):
        return "torch loop", (lambda w13, w2: (w13, w2), lambda x, weights, ids, w: bf16_moe_loop(x, host_routes(weights, ids), *w))


def _median_ms(fn: Callable[[int], Any], layers: int, repeats: int) -> float:
    for i in range(layers):
        fn(i)
    rounds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(layers):
            fn(i)
        rounds.append((time.perf_counter() - start) / layers * 1e3)
    return statistics.median(rounds)


def run(args: argparse.Namespace) -> int:
    import torch

    from moet.bench._record import write_results
    from moet.kernels import cpu_build
    from moet.kernels.cpu import kernel_forward, torch_forward
    from moet.testing.reference import moe_reference
    from moet.testing.random_stacked import random_stored

    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_build.load():
        raise SystemExit("moet bench cpu: the CPU MoE kernel is not built (python -m moet.kernels.cpu_build)")
    bf16_name, (prepare, bf16_run) = _bf16_op()
    results: dict[str, Any] = {
        "threads": torch.get_num_threads(), "isa": torch.ops.moet_cpu.isa("auto"), "bf16": bf16_name, "rows": [],
    }
    print(f"moet bench cpu: {results['threads']} threads, kernel {results['isa']}, bf16 = {bf16_name}")
    gen = torch.Generator().manual_seed(0)
    for name in args.geometries.split(","):
        hidden, inter, experts, k, kind = GEOMETRIES[name]
        layers = [
            (random_stored(experts, 2 * inter, hidden, kind, seed=2 * i, refine=False),
             random_stored(experts, hidden, inter, kind, seed=2 * i + 1, refine=False))
            for i in range(args.layers)
        ]
        for w13, w2 in layers:
            w13.fp4 = w2.fp4 = None
        dense = [prepare(w13.dequantize_base(torch.arange(experts)).bfloat16(), w2.dequantize_base(torch.arange(experts)).bfloat16())
                 for w13, w2 in layers]
        for tokens in map(int, args.tokens.split(",")):
            x = torch.randn(tokens, hidden, generator=gen).bfloat16()
            ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)]).to(torch.int32)
            weights = torch.rand(tokens, k, generator=gen).softmax(-1)
            w13, w2 = layers[0]
            want = moe_reference(x, weights, ids, w13, w2)
            got = kernel_forward(x.float(), weights, ids, w13, w2)  # float32 out: the check is not bf16's rounding
            error = float(torch.linalg.norm(got.double() - want) / torch.linalg.norm(want))
            got = kernel_forward(x, weights, ids, w13, w2)  # the timed bf16 path (bf16 out)
            error_bf16 = float(torch.linalg.norm(got.double() - want) / torch.linalg.norm(want))
            timings = {
                "kernel": _median_ms(lambda i: kernel_forward(x, weights, ids, *layers[i]), args.layers, args.repeats),
                "torch": _median_ms(lambda i: torch_forward(x, weights, ids, *layers[i]), args.layers, args.repeats),
                "bf16": _median_ms(lambda i: bf16_run(x, weights, ids, dense[i]), args.layers, args.repeats),
            }
            active = int(torch.unique(ids).numel())
            bytes_2bit = active * sum(w.base_nbytes() // experts for w in layers[0])
            row = {
                "load_average": round(os.getloadavg()[0], 2),  # the cores are shared: a loaded row reads slow
                "geometry": name, "hidden": hidden, "inter": inter, "experts": experts, "top_k": k, "scale_kind": kind,
                "tokens": tokens, "active_experts": active, "kernel_rel_error": error, "kernel_bf16_rel_error": error_bf16,
                **{f"{v}_ms": round(ms, 4) for v, ms in timings.items()},
                "kernel_vs_bf16": round(timings["bf16"] / timings["kernel"], 2),
                "kernel_vs_torch": round(timings["torch"] / timings["kernel"], 2),
                "kernel_gb_per_s": round(bytes_2bit / timings["kernel"] / 1e6, 2),
                "bf16_gb_per_s": round(active * 3 * hidden * inter * 2 / timings["bf16"] / 1e6, 2),
            }
            results["rows"].append(row)
            print(f"{name:>8} T={tokens:<4} kernel {row['kernel_ms']:.3f} ms ({row['kernel_gb_per_s']} GB/s)  "
                  f"torch {row['torch_ms']:.3f}  bf16 {row['bf16_ms']:.3f} ({row['bf16_gb_per_s']} GB/s)  "
                  f"kernel {row['kernel_vs_bf16']}x bf16, {row['kernel_vs_torch']}x torch  err {error:.1e} (bf16 {error_bf16:.1e})  "
                  f"load {row['load_average']}", flush=True)
    write_results("cpu", results, args.out_dir)
    return 0
