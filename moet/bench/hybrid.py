"""One MoE layer with half of its experts cold on the GPU: fetch-and-replay vs computing the misses on the CPU vs both.

A DeepSeek-V4-Flash-geometry layer (random weights in real shapes, uniform random routing: the worst
case for any cache), its 2-bit base in a pinned host store, a device expert cache (kernels' layout)
holding half of the experts. Per step (fresh activations and routing) and token count:

* `replay`: the plugin's default, graph-safe path: a pass with the misses zeroed, a fetch of them over
  PCIe (converted on the GPU), a second pass (moet.store.ReplayDriver);
* `cpu`: the misses computed on the host from the store's rows while the GPU computes the resident
  experts (moet.vllm.hybrid, VLLM_MOE_W2_CACHE_MISS=cpu); the cache keeps its warm half;
* `both`: the misses split between the two by their measured rates (VLLM_MOE_W2_CACHE_MISS=both);
* `resident`: every expert in VRAM (the floor).

Each records ms per step and the output's relative error against the resident layer; the resident
layer's own error against float64 gives the bf16 band. Needs a CUDA GPU and the decode cubin.

    moet bench hybrid --tokens 1,4,16 --steps 20
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", default="1,4,16", help="tokens per step")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per mode and token count")
    parser.add_argument("--warmup", type=int, default=4, help="untimed steps first")
    parser.add_argument("--cold", type=float, default=0.5, help="share of the layer's experts not in the cache")
    parser.add_argument("--modes", default="resident,replay,cpu,both", help="subset of %(default)s")
    parser.add_argument("--out-dir", type=Path, default=None, help="results directory (default bench/results)")


def run(args: argparse.Namespace) -> int:
    import torch

    from moet.bench._record import write_results
    from moet.bench.e2e import FRONTIER, host_store
    from moet.kernels import cpu_build, cuda
    from moet.kernels.layout import gpu_layer
    from moet.testing.random_stacked import random_stored

    if not (torch.cuda.is_available() and cuda.available()):
        print("moet bench hybrid: needs a CUDA GPU and the decode cubin (python scripts/build_kernels.py)")
        return 2
    g = FRONTIER["deepseek-v4-flash"]
    e, h, i, k = g["experts"], g["hidden"], g["inter"], g["top_k"]
    s13 = random_stored(e, 2 * i, h, "mx32", "cuda", seed=11, chunk=8, refine=False)
    s2 = random_stored(e, h, i, "mx32", "cuda", seed=12, chunk=8, refine=False)
    store = host_store([(s13, s2)])
    resident = _layer(*gpu_layer(s13, s2, torch.device("cuda"), fp4=False)[:2])
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(), "geometry": "deepseek-v4-flash, one layer", "experts": e, "top_k": k,
        "cold_share": args.cold, "cpu_threads": torch.get_num_threads(),
        "cpu_kernel": "C++ (" + torch.ops.moet_cpu.isa("auto") + ")" if cpu_build.load() else "PyTorch path",
        "expert_base_mb": store.span / 2**20, "tokens": {},
    }
    print(f"moet bench hybrid: {results['geometry']}, E={e} top-{k}, {args.cold:.0%} cold, CPU {results['cpu_kernel']} "
          f"on {results['cpu_threads']} threads, {results['expert_base_mb']:.2f} MiB per expert")
    for tokens in (int(t) for t in args.tokens.split(",")):
        per: dict[str, Any] = {}
        for mode in args.modes.split(","):
            per[mode] = _measure(mode, tokens, k, resident, store, s13, s2, args)
            print(f"  T={tokens:3} {mode:9} {per[mode]['ms_per_step']:8.3f} ms/step  rel.err vs resident "
                  f"{per[mode]['rel_err_vs_resident']:.2e}" + "".join(f"  {key} {value}" for key, value in per[mode].items()
                                                                 if key in ("hit_rate", "replays_per_step", "cpu_experts_per_step",
                                                                            "fetched_experts_per_step")))
        results["tokens"][str(tokens)] = per
    path = write_results("hybrid", results, args.out_dir)
    print(f"moet bench hybrid: {path}")
    return 0


def _layer(w13: Any, w2: Any, cache: Any = None, hybrid: Any = None) -> SimpleNamespace:
    """What the plugin's apply body reads from a vLLM FusedMoE layer."""
    return SimpleNamespace(expert_map=None, moet_fp4=None, moet_ordinal=0, moet_w13=w13, moet_w2=w2,
                           moet_cache=None if cache is None else SimpleNamespace(cache=cache, hybrid=hybrid),
                           activation=SimpleNamespace(value="silu"))


def _measure(mode: str, tokens: int, top_k: int, resident: Any, store: Any, s13: Any, s2: Any, args: argparse.Namespace) -> dict:
    import torch

    from moet.kernels.cache_slots import KernelSlots
    from moet.kernels.glue import select_experts
    from moet.store import ExpertCache, ReplayDriver
    from moet.testing.reference import moe_reference
    from moet.vllm.hybrid import HybridExperts
    from moet.vllm.moe_op import apply_moe

    experts, hidden = s13.codes.shape[0], s13.codes.shape[2] * 4
    cache = driver = hybrid = None
    layer = resident
    if mode != "resident":
        cache = ExpertCache(store, slots=round((1 - args.cold) * experts), device=torch.device("cuda"), storage=KernelSlots)
        cache.begin_step()
        cache.fetch([(0, x) for x in range(cache.slots)])  # the warm share
        hybrid = HybridExperts(cache, mode) if mode in ("cpu", "both") else None
        layer = _layer(cache.storage.w13, cache.storage.w2, cache, hybrid)
        driver = ReplayDriver(cache, fp_max=2, kpi_secs=1e9)
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    times, errors, band = [], [], None
    kpis0 = None
    for step in range(args.warmup + args.steps):
        x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
        weights, ids = select_experts(torch.randn(tokens, experts, device="cuda", generator=gen), top_k)
        want = apply_moe(resident, x, weights, ids)
        if band is None:
            ref = moe_reference(x, weights, ids, s13, s2)
            band = float((want.double() - ref).norm() / ref.norm())
        if step == args.warmup and driver is not None:
            kpis0 = (driver.kpis(), None if hybrid is None else dict(vars(hybrid.counts)))
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = apply_moe(layer, x, weights, ids) if driver is None else driver.run(lambda: apply_moe(layer, x, weights, ids))
        torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
            errors.append(float((out.double() - want.double()).norm() / want.double().norm()))
    entry: dict[str, Any] = {"ms_per_step": 1e3 * statistics.median(times), "ms_mean": 1e3 * statistics.mean(times),
                             "rel_err_vs_resident": max(errors), "resident_rel_err_vs_float64": band}
    if driver is not None:
        k0, h0 = kpis0
        k1 = driver.kpis()
        lookups = k1["lookups"] - k0["lookups"]
        entry["hit_rate"] = round(1 - (k1["misses"] - k0["misses"]) / max(lookups, 1), 3)
        entry["replays_per_step"] = round((k1["replays"] - k0["replays"]) / args.steps, 2)
        entry["fetch_mb_per_step"] = round((k1["fetch_bytes"] - k0["fetch_bytes"]) / 2**20 / args.steps, 1)
        if hybrid is not None:
            c = vars(hybrid.counts)
            entry["cpu_experts_per_step"] = round((c["cpu_experts"] - h0["cpu_experts"]) / args.steps, 1)
            entry["fetched_experts_per_step"] = round((c["fetched_experts"] - h0["fetched_experts"]) / args.steps, 1)
            entry["rates_gb_s"] = {"cpu": hybrid.kpis()["cpu_gb_s"], "fetch": hybrid.kpis()["fetch_gb_s"]}
    return entry
