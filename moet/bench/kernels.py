"""MoE expert kernels on the GPU: the 2-bit base, FP4 copies and mixed tiers vs bf16 PyTorch, and a plain read.

For each geometry and token count: correctness of every variant against a float64 reference
(fresh inputs, NaN-poisoned workspaces), then timings. Decode (T ≤ 64) is timed as CUDA-graph
replays of `--layers` consecutive layers, each with its own routing over all experts (its experts
renamed to ones no other layer uses where they fit), so that weights come from HBM; the GEMMs are
compared with a Triton read kernel of the same bytes rotated the same way. Prefill is timed eagerly
(its weights dwarf L2).
Tiers: "base" (no slot table), "fp4" (every expert's FP4 copy), "mix25"/"mix50" (a slot table that
puts 25% / 50% of the experts at FP4, in the same launches): the cost of a step with a fraction x of
its routed experts promoted is checked against base + x·(fp4 − base) + 5%.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

GEOMETRIES = {
    "deepseek-v4-flash": (4096, 2048, 256, 6),
    "glm-5.2": (6144, 2048, 256, 8),
    "kimi-k2": (7168, 2048, 384, 8),
}
DECODE_TOKENS = (1, 4, 16, 64)
PREFILL_TOKENS = (512, 2048, 8192)
TIERS = ("base", "fp4", "mix25", "mix50")
MIXED = {"mix25": 0.25, "mix50": 0.5}
CHECK_ROWS = 64  # prefill correctness is checked on this many random tokens (all are computed)
# prefill variants are timed eagerly after this much warm-up: at 15:47 on 2026-12-05 the variant timed right after
# the host-bound bf16 loop measured 2.2× the same kernel forced a moment later (docs/KERNELS.md)
PREFILL_WARMUP_MS = 50.0
READ_SCRATCH_BYTES = 8 << 30  # the same-bytes read rotates through at most this much (≥ 2 distinct buffers)
READ_PROGRAMS_PER_SM = 8  # programs per SM of the plain read (grid-stride, 4,096 words a step)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--geometries", default=",".join(GEOMETRIES), help="comma-separated subset of %(default)s")
    parser.add_argument("--tokens", default=",".join(map(str, DECODE_TOKENS + PREFILL_TOKENS)))
    parser.add_argument("--scale-kind", choices=("mx32", "nv16"), default="mx32")
    parser.add_argument("--layers", type=int, default=8, help="layers rotated through in decode timings")
    parser.add_argument("--budget-ms", type=float, default=40.0, help="graph replays per timing fill about this long")
    parser.add_argument("--routing", choices=("disjoint", "sliced"), default="disjoint",
                        help="decode layers' routing: over all experts, each layer's renamed to experts no other "
                        "layer uses (disjoint), or drawn from E / layers experts of its own (sliced: the figures "
                        "before 2026-12-08)")
    parser.add_argument("--sweep", default="", help="tiers also timed over candidate configs at T=1, 4 and every T > 64, e.g. base")
    parser.add_argument("--out-dir", type=Path, default=None, help="results directory (default bench/results)")


@dataclass
class Layer:
    """One decode layer's inputs: x, routing, the bytes its active experts occupy, host routes for the loop."""

    x: Any
    weights: Any
    ids: Any
    experts: int
    routes: list


def run(args: argparse.Namespace) -> int:
    import torch

    from moet.bench._record import write_results

    if not torch.cuda.is_available():
        print("moet bench kernels: needs a CUDA GPU")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    records: list[dict[str, Any]] = []
    tokens = [int(t) for t in args.tokens.split(",")]
    copy_gbs = _copy_bandwidth()
    print(f"device copy bandwidth (read+write): {copy_gbs:.0f} GB/s")
    for name in args.geometries.split(","):
        records += _bench_geometry(name, GEOMETRIES[name], tokens, args)
        torch.cuda.empty_cache()
        if args.out_dir or os.environ.get("MOET_BENCH_DIR"):  # survive a run cut short
            partial = Path(args.out_dir or os.environ["MOET_BENCH_DIR"]) / "kernels-partial.json"
            partial.write_text(json.dumps(records, indent=1) + "\n")
    results = {
        "device": torch.cuda.get_device_name(),
        "scale_kind": args.scale_kind,
        "layers_rotated": args.layers,
        "copy_gbs": copy_gbs,
        "records": records,
        "summary": _summary(records),
    }
    path = write_results("kernels", results, args.out_dir)
    _plot(records, path.with_suffix(".png"))
    _print_table(records)
    return 0


def _copy_bandwidth() -> float:
    import torch

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    ms = _event_ms(lambda: dst.copy_(src), 10)
    return 2 * src.numel() / ms / 1e6


def _event_ms(fn: Callable[[], Any], repeats: int, warmup_ms: float = 0.0) -> float:
    """Median milliseconds of fn over `repeats` event-timed calls, after one warm-up call and then more until
    `warmup_ms` of GPU time has passed (so that clocks that dropped during a host-bound variant are back up)."""
    import time

    import torch

    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    while (time.perf_counter() - start) * 1000 < warmup_ms:
        fn()
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _graph_us(steps: list[Callable[[], Any]], budget_ms: float) -> float:
    """µs per step: capture all steps (one per layer) in one CUDA graph, replay it for about budget_ms."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for step in steps:
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for step in steps:
            step()
    once = _event_ms(graph.replay, 3)
    replays = max(3, min(200, int(budget_ms / max(once, 1e-3))))
    ms = _event_ms(lambda: [graph.replay() for _ in range(replays)], 5)
    del graph
    return ms * 1000 / (replays * len(steps))


def _bench_geometry(name: str, geometry: tuple[int, int, int, int], tokens: list[int], args) -> list[dict]:

    import torch

    from moet.kernels.layout import Fp4Slots, StackedWeights, mma_fp4_words
    from moet.testing.random_stacked import random_stored

    hidden, inter, experts, top_k = geometry
    print(f"== {name}: H={hidden} I={inter} E={experts} top-{top_k}, scales {args.scale_kind}")
    s13 = random_stored(experts, 2 * inter, hidden, args.scale_kind, "cuda", seed=13, refine=False)
    s2 = random_stored(experts, hidden, inter, args.scale_kind, "cuda", seed=2, refine=False)
    w13 = StackedWeights.from_stacked(s13, torch.device("cuda"), gate_up=True)
    w2 = StackedWeights.from_stacked(s2, torch.device("cuda"), gate_up=False)
    every = Fp4Slots.every_expert(mma_fp4_words(s13.fp4, True), mma_fp4_words(s2.fp4, False))
    slots = {"base": None, "fp4": every}
    order = torch.randperm(experts, device="cuda", generator=torch.Generator(device="cuda").manual_seed(5))
    for tier, fraction in MIXED.items():  # views of the same planes: a table naming a fraction of the experts
        table = torch.full((experts,), -1, dtype=torch.int32, device="cuda")
        chosen = order[: round(fraction * experts)]
        table[chosen] = chosen.to(torch.int32)
        slots[tier] = Fp4Slots(table, every.w13, every.w2)
    b13, b2 = _bf16_weights(s13), _bf16_weights(s2)
    ctx = dict(name=name, geometry=geometry, s13=s13, s2=s2, w13=w13, w2=w2, b13=b13, b2=b2, slots=slots, args=args)
    records = []
    for t in tokens:
        records += _check(ctx, t)
        records += _time_decode(ctx, t) if t <= 64 else _time_prefill(ctx, t)
        _print_table([r for r in records if r["tokens"] == t])
    return records


def _bf16_weights(stored) -> Any:
    """The FP4 tier's weights rounded to bf16 [E, N, K], expert by expert (the bf16 reference's weights)."""
    import torch

    from moet.quant.codebook import Tier

    e, n, kq = stored.codes.shape
    out = torch.empty(e, n, kq * 4, dtype=torch.bfloat16, device=stored.codes.device)
    for i in range(e):
        out[i] = stored.dequantize(i, Tier.PLANES).to(torch.bfloat16)
    return out


def _routing(tokens: int, experts: int, top_k: int, allowed=None, gen=None):
    import torch

    from moet.kernels.glue import select_experts

    logits = torch.randn(tokens, experts, device="cuda", generator=gen)
    if allowed is not None:
        mask = torch.full((experts,), float("-inf"), device="cuda")
        mask[allowed] = 0.0
        logits = logits + mask
    return select_experts(logits, top_k)


def _check(ctx: dict, tokens: int) -> list[dict]:
    """‖out − ref‖/‖ref‖ of every variant on fresh inputs, with NaN-poisoned pair buffers."""
    import torch

    from moet.kernels.moe import block_shared_memory, default_configs, multiprocessors
    from moet.testing.reference import bf16_moe_grouped, moe_reference, run_poisoned

    hidden, inter, experts, top_k = ctx["geometry"]
    gen = torch.Generator(device="cuda").manual_seed(1000 + tokens)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    weights, ids = _routing(tokens, experts, top_k, gen=gen)
    rows = None if tokens <= CHECK_ROWS else torch.randperm(tokens, device="cuda", generator=gen)[:CHECK_ROWS]
    refs = {tier: moe_reference(x, weights, ids, ctx["s13"], ctx["s2"], tokens=rows, fp4_experts=_fp4_mask(ctx, tier))
            for tier in TIERS}
    refs["bf16"] = refs["fp4"]
    out_records = []
    backend = _backend(ctx, tokens)
    variants = [("bf16", "bf16", None)] + [(tier, tier, backend) for tier in TIERS]
    backends = _backends(ctx, tokens)
    variants += [(f"{tier}_{other}", tier, other) for other in backends if other != backend for tier in TIERS]
    if "gluon" in backends:  # the FP8 prefill, against float64 with its e4m3 inputs (fp8_rows)
        from moet.eval.variants import fp8_rows

        variants.append(("base_fp8", "base_fp8", "gluon"))
        refs["base_fp8"] = moe_reference(x, weights, ids, ctx["s13"], ctx["s2"], tokens=rows, inputs=fp8_rows)
    for variant, tier, backend in variants:
        if variant == "bf16":
            out = bf16_moe_grouped(x, weights, ids, ctx["b13"], ctx["b2"])
            written = True
        else:
            configs = default_configs(tokens, hidden, inter, backend, top_k, multiprocessors(x.device),
                                      fp8_prefill=tier.endswith("_fp8"), block_shared=block_shared_memory(x.device))
            out, written = run_poisoned(x, weights, ids, ctx["w13"], ctx["w2"], ctx["slots"][tier.removesuffix("_fp8")],
                                        configs, backend)
        got = out if rows is None else out[rows]
        ref = refs[tier]
        err = _rel_err(got, ref)
        ok = written and bool(torch.isfinite(got).all()) and err < 1e-2
        record = dict(geometry=ctx["name"], tokens=tokens, variant=variant, kind="check", backend=backend,
                      rel_err=err, written=written, ok=ok)
        if variant == "base_fp8":  # and what the e4m3 inputs cost against the exact one
            record["rel_err_vs_exact"] = _rel_err(got, refs["base"])
        out_records.append(record)
    return out_records


def _fp4_mask(ctx: dict, tier: str):
    """bool [E]: the experts `tier` computes at FP4 (None: none)."""
    slots = ctx["slots"][tier]
    return None if slots is None else slots.table >= 0


def _backend(ctx: dict, tokens: int) -> str:
    from moet.kernels.oracle import select_moe_backend

    return select_moe_backend(ctx["w13"].words.device, tokens)


def _backends(ctx: dict, tokens: int) -> list[str]:
    """Every GPU backend that can serve `tokens` tokens on this device (the oracle picks the first)."""
    from moet.kernels.oracle import gpu_backends

    return gpu_backends(ctx["w13"].words.device.index, tokens)


def _rel_err(out, ref) -> float:
    """‖out − ref‖/‖ref‖ against a float64 reference."""
    return ((out.double() - ref).norm() / ref.norm()).item()


def _decode_layers(ctx: dict, tokens: int, count: int) -> list[Layer]:
    """`count` layers of routing over all experts, each layer's experts moved onto experts of its own where they fit
    (disjoint_experts), or ("sliced" routing) drawn from its own slice of the experts."""
    import torch

    from moet.testing.reference import host_routes

    hidden, _, experts, top_k = ctx["geometry"]
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    perm = torch.randperm(experts, device="cuda", generator=gen)
    sliced = ctx["args"].routing == "sliced" and tokens * top_k * count <= experts
    xs, weights, ids = [], [], []
    for i in range(count):
        allowed = perm[i * experts // count : (i + 1) * experts // count] if sliced else None
        w, e = _routing(tokens, experts, top_k, allowed, gen)
        weights.append(w)
        ids.append(e)
        xs.append(torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16))
    if not sliced:
        ids = disjoint_experts(ids, perm) or ids
    return [Layer(x, w, e, int(torch.unique(e).numel()), host_routes(w, e)) for x, w, e in zip(xs, weights, ids)]


def disjoint_experts(layer_ids: list, perm) -> list | None:
    """Each layer's expert ids with its distinct experts renamed to the next unused entries of `perm` (order kept), so
    that no two layers share an expert and none finds its weights in L2 left by another, while its tokens share
    experts exactly as the router over all experts made them; None where the layers' distinct experts outnumber perm.
    (Drawing each layer from its own slice of E / layers experts, as the bench did until 2026-12-08, keeps the layers
    apart too but makes the tokens of a layer share experts more often: DeepSeek-V4-Flash T = 4 names ~18 distinct
    experts in its 24 pairs from a slice of 32, ~23 from all 256.)"""
    import torch

    renamed, used = [], 0
    for ids in layer_ids:
        distinct, inverse = torch.unique(ids, return_inverse=True)
        if used + distinct.numel() > perm.numel():
            return None
        renamed.append(perm[used + inverse].to(ids.dtype))
        used += distinct.numel()
    return renamed


def _time_decode(ctx: dict, tokens: int) -> list[dict]:
    import torch

    from moet.kernels.moe import block_shared_memory, default_configs, fused_moe_2bit, multiprocessors
    from moet.testing.reference import bf16_moe_grouped, bf16_moe_loop

    args = ctx["args"]
    hidden, inter, _, _ = ctx["geometry"]
    w13, w2 = ctx["w13"], ctx["w2"]
    layers = _decode_layers(ctx, tokens, args.layers)
    active = sum(layer.experts for layer in layers) / len(layers)
    rec = dict(geometry=ctx["name"], tokens=tokens, kind="decode", active_experts=active, routing=args.routing)
    out = []

    def add(variant: str, us: float, nbytes: float | None = None, **extra) -> None:
        r = dict(rec, variant=variant, us=us, **extra)
        if nbytes:
            r.update(bytes=nbytes, gbs=nbytes / us / 1e3)
        out.append(r)

    bf16_bytes = active * 2 * (3 * hidden * inter)
    add("bf16_grouped", _graph_us([_bind(bf16_moe_grouped, l.x, l.weights, l.ids, ctx["b13"], ctx["b2"]) for l in layers], args.budget_ms), bf16_bytes)
    add("bf16_loop", _graph_us([_bind(bf16_moe_loop, l.x, l.routes, ctx["b13"], ctx["b2"]) for l in layers], args.budget_ms), bf16_bytes)
    scratch = torch.empty(0, dtype=torch.int32, device="cuda")
    device = layers[0].x.device
    configs = default_configs(tokens, hidden, inter, _backend(ctx, tokens), ctx["geometry"][3], multiprocessors(device),
                              block_shared=block_shared_memory(device))
    for tier in TIERS:
        slots = ctx["slots"][tier]
        fraction = _promoted_fraction(layers, _fp4_mask(ctx, tier))
        fp4_13, fp4_2 = w13.fp4_nbytes() + _scale_bytes(w13), w2.fp4_nbytes() + _scale_bytes(w2)
        n13 = active * (fraction * fp4_13 + (1 - fraction) * w13.base_nbytes(1))
        n2 = active * (fraction * fp4_2 + (1 - fraction) * w2.base_nbytes(1))
        add(tier, _graph_us([_bind(fused_moe_2bit, l.x, l.weights, l.ids, w13, w2, slots=slots, backend=_backend(ctx, tokens))
                             for l in layers], args.budget_ms),
            n13 + n2, promoted=fraction)
        gemm_us = _graph_us([_gemms_step(l, w13, w2, slots, configs) for l in layers], args.budget_ms)
        # the same bytes, rotated the same way: per layer one read of w13's and one of w2's active bytes
        # (distinct buffers: one per layer, but at least 2 and at most what fits in READ_SCRATCH_BYTES)
        words13, words2 = int(n13) // 4, int(n2) // 4
        buffers = max(2, min(len(layers), READ_SCRATCH_BYTES // (4 * (words13 + words2))))
        if scratch.numel() < buffers * (words13 + words2):
            scratch = torch.empty(buffers * (words13 + words2), dtype=torch.int32, device="cuda").fill_(1)
        sink = torch.empty(_read_programs(scratch.device), dtype=torch.int32, device="cuda")
        reads2, reads1 = [], []
        for i in range(len(layers)):
            base = (i % buffers) * (words13 + words2)
            a, b = scratch[base : base + words13], scratch[base + words13 : base + words13 + words2]
            reads2.append(_bind(_read, (a, b), sink))
            reads1.append(_bind(_read, (scratch[base : base + words13 + words2],), sink))
        read2_us = _graph_us(reads2, args.budget_ms)
        read1_us = _graph_us(reads1, args.budget_ms)
        add(f"{tier}_gemms", gemm_us, n13 + n2, read2_us=read2_us, read1_us=read1_us, promoted=fraction,
            vs_read2=gemm_us / read2_us, vs_read1=gemm_us / read1_us, config13=vars(configs[0]), config2=vars(configs[1]))
        if configs[0].backend == "cuda" and tier == "base":  # w2 launched after w13 drains; then also the torch combine
            us = _graph_us([_gemms_step(l, w13, w2, slots, configs, overlap=False) for l in layers], args.budget_ms)
            add(f"{tier}_gemms_serial", us, n13 + n2, vs_read2=us / read2_us, vs_read1=us / read1_us)
            us = _graph_us([_serial_layer(l, w13, w2, slots, configs) for l in layers], args.budget_ms)
            add(f"{tier}_serial", us, n13 + n2)
        if configs[0].backend == "cuda" and tier in ("base", "fp4"):  # the Triton kernels on the same layers
            triton_configs = default_configs(tokens, hidden, inter)
            us = _graph_us([_gemms_step(l, w13, w2, slots, triton_configs) for l in layers], args.budget_ms)
            add(f"{tier}_triton_gemms", us, n13 + n2, vs_read2=us / read2_us, vs_read1=us / read1_us,
                config13=vars(triton_configs[0]), config2=vars(triton_configs[1]))
        if tier in args.sweep.split(",") and tokens in (1, 4):
            for cand in _candidates(tokens, hidden, inter, configs[0].backend, picks=configs):
                err = _sweep_error(ctx, layers[0], tier, cand) if configs[0].backend == "cuda" else None
                us = _graph_us([_gemms_step(l, w13, w2, slots, cand) for l in layers], args.budget_ms)
                add(f"{tier}_gemms_sweep", us, n13 + n2, vs_read2=us / read2_us, vs_read1=us / read1_us,
                    config13=vars(cand[0]), config2=vars(cand[1]), rel_err=err)
    return out


def _scale_bytes(w) -> int:
    """Per expert: the block and row scales an FP4 copy is read with (shared with the base)."""
    return (w.scales.numel() + w.row_scale.numel() * 4) // w.shape[0]


def _promoted_fraction(layers: list, mask) -> float:
    """The fraction of the layers' active experts the slot table puts at FP4."""
    import torch

    if mask is None:
        return 0.0
    active = [torch.unique(layer.ids.long()) for layer in layers]
    return sum(int(mask[a].sum()) for a in active) / sum(a.numel() for a in active)


def _sweep_error(ctx: dict, layer: Layer, tier: str, configs) -> float:
    """‖out − ref‖/‖ref‖ of one sweep candidate on one layer (float64 reference)."""
    from moet.kernels.moe import fused_moe_2bit
    from moet.testing.reference import moe_reference

    out = fused_moe_2bit(layer.x, layer.weights, layer.ids, ctx["w13"], ctx["w2"], slots=ctx["slots"][tier], configs=configs,
                       backend=configs[0].backend)
    ref = moe_reference(layer.x, layer.weights, layer.ids, ctx["s13"], ctx["s2"], fp4_experts=_fp4_mask(ctx, tier))
    return _rel_err(out, ref)


def _candidates(tokens: int, hidden: int, inter: int, backend: str = "triton", picks: tuple | None = None) -> list:
    """Configs to compare with the defaults: the CUDA decode kernels' built tunings, for both stages alike and, given
    the picks, for one stage beside the other's pick (the stages' grids differ, so may their best tunings); Triton
    decode varies K split, blocks and stages; prefill the tiles."""
    from dataclasses import replace

    from moet.kernels.cuda import MAX_TOKENS, TUNINGS
    from moet.kernels.moe import GemmConfig, cuda_config, default_configs
    from moet.kernels.oracle import gluon_prefill_available

    if backend == "cuda":
        built = [cuda_config(t) for t in TUNINGS]
        fit13 = [c for c in built if (2 * inter) % c.rows == 0]
        fit2 = [c for c in built if hidden % c.rows == 0]
        both = [(c, c) for c in fit13 if c in fit2]
        if picks is None:
            return both
        one_stage = [(c, picks[1]) for c in fit13] + [(picks[0], c) for c in fit2]
        return both + [pair for pair in one_stage if pair[0] != pair[1] and pair != picks]
    c13, c2 = default_configs(tokens, hidden, inter)
    if tokens > 64:  # prefill tiles (blocks, bm, warps, stages) around the default; the CUDA tunings where the oracle may pick them
        tiles = [GemmConfig(*t) for t in ((8, 64, 8, 3), (8, 64, 4, 3), (8, 128, 4, 2), (8, 128, 4, 4), (8, 256, 4, 2),
                                          (16, 128, 4, 3), (16, 64, 4, 3), (4, 128, 4, 3))]
        if gluon_prefill_available(None):  # moet.kernels.hopper's tiles (bm, warps, stages)
            tiles += [GemmConfig(w, bm, w, st, backend="gluon")  # 16 rows per warp
                      for bm, w, st in ((64, 8, 4), (128, 8, 3), (128, 8, 4), (256, 8, 3), (64, 4, 4), (128, 4, 4))]
        return [(c, c) for c in tiles] + (_candidates(tokens, hidden, inter, "cuda") if tokens <= MAX_TOKENS else [])
    cands = [
        (replace(c13, split=c13.split * 2), replace(c2, split=c2.split * 2)),
        (replace(c13, split=max(1, c13.split // 2)), replace(c2, split=max(1, c2.split // 2))),
        (replace(c13, num_stages=4), replace(c2, num_stages=4)),
        (replace(c13, blocks=4), replace(c2, blocks=2)),
        (replace(c13, blocks=16, num_warps=8), replace(c2, blocks=8, num_warps=8)),
    ]
    return [(a, b) for a, b in cands if (hidden // 128) % a.split == 0 and (inter // 128) % b.split == 0]


def _bind(fn, *a, **kw) -> Callable[[], Any]:
    return lambda: fn(*a, **kw)


def _workspace(layer: Layer, w13, configs):
    """A layer's own workspace (moet.kernels.moe.new_workspace)."""
    from moet.kernels.moe import new_workspace

    return new_workspace(layer.ids.numel(), w13.shape[1] // 2, layer.x.shape[1], layer.x.device, configs)


def _gemms_step(layer: Layer, w13, w2, slots, configs, overlap: bool = True) -> Callable[[], Any]:
    """One layer's expert GEMMs (no combine) with its own workspace."""
    from moet.kernels.moe import expert_gemms

    ws = _workspace(layer, w13, configs)
    return _bind(expert_gemms, layer.x, layer.weights, layer.ids, w13, w2, slots, configs, ws, overlap)


def _serial_layer(layer: Layer, w13, w2, slots, configs) -> Callable[[], Any]:
    """The CUDA layer as before programmatic launches: w2 after w13 drains, then the torch combine."""
    from moet.kernels.glue import combine
    from moet.kernels.moe import expert_gemms

    ws = _workspace(layer, w13, configs)

    def step():
        expert_gemms(layer.x, layer.weights, layer.ids, w13, w2, slots, configs, ws, overlap=False)
        return combine(ws.pair_out, *layer.ids.shape, layer.x.dtype)

    return step


def _read_programs(device) -> int:
    """Programs of the plain read: READ_PROGRAMS_PER_SM on each SM of `device` (the sink takes one word each)."""
    from moet.kernels.moe import multiprocessors

    return READ_PROGRAMS_PER_SM * multiprocessors(device)


def _read(sources: tuple, sink) -> None:
    """One plain read launch per source buffer, at most _read_programs programs (4,096 words a step)."""
    from moet.kernels.gemm import read_kernel

    for src in sources:
        grid = min(_read_programs(src.device), max(1, src.numel() // (4096 * 4)))
        read_kernel[(grid,)](src, sink, src.numel(), BLOCK=4096, num_warps=8)


def _time_prefill(ctx: dict, tokens: int) -> list[dict]:
    import torch

    from moet.kernels.moe import fused_moe_2bit
    from moet.testing.reference import bf16_moe_grouped, bf16_moe_loop, host_routes

    hidden, inter, experts, top_k = ctx["geometry"]
    gen = torch.Generator(device="cuda").manual_seed(7 * tokens)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    weights, ids = _routing(tokens, experts, top_k, gen=gen)
    routes = host_routes(weights, ids)
    flops = 2 * tokens * top_k * 3 * hidden * inter
    out = []
    variants = {
        "bf16_grouped": lambda: bf16_moe_grouped(x, weights, ids, ctx["b13"], ctx["b2"]),
        "bf16_loop": lambda: bf16_moe_loop(x, routes, ctx["b13"], ctx["b2"]),
    }
    for tier in TIERS:
        variants[tier] = _bind(fused_moe_2bit, x, weights, ids, ctx["w13"], ctx["w2"], slots=ctx["slots"][tier],
                               backend=_backend(ctx, tokens))
        for backend in _backends(ctx, tokens):  # each, whichever the oracle picks
            variants[f"{tier}_{backend}"] = _bind(fused_moe_2bit, x, weights, ids, ctx["w13"], ctx["w2"],
                                                  slots=ctx["slots"][tier], backend=backend)
        if "gluon" in _backends(ctx, tokens) and tier != "fp4":  # the FP8 prefill serves the base experts
            variants[f"{tier}_gluon_fp8"] = _bind(fused_moe_2bit, x, weights, ids, ctx["w13"], ctx["w2"],
                                                  slots=ctx["slots"][tier], backend="gluon", fp8_prefill=True)
    for tier in filter(None, ctx["args"].sweep.split(",")):
        for c13, c2 in _candidates(tokens, hidden, inter):
            name = f"{tier}_sweep {c13.backend} {c13.tuning or f'b{c13.blocks}/{c2.blocks} m{c13.bm} w{c13.num_warps} s{c13.num_stages}'}"
            variants[name] = _bind(fused_moe_2bit, x, weights, ids, ctx["w13"], ctx["w2"], slots=ctx["slots"][tier],
                                   configs=(c13, c2), backend=c13.backend)
    for variant, fn in variants.items():
        us = _event_ms(fn, 5, PREFILL_WARMUP_MS) * 1000
        out.append(dict(geometry=ctx["name"], tokens=tokens, kind="prefill", variant=variant, us=us,
                        tflops=flops / us / 1e6))
    return out


def _summary(records: list[dict]) -> list[dict]:
    """Per geometry and T: the targets' ratios (bf16 = the faster of grouped and loop)."""
    rows = []
    keys = sorted({(r["geometry"], r["tokens"]) for r in records if "us" in r}, key=lambda k: (k[0], k[1]))
    for geometry, t in keys:
        by = {r["variant"]: r for r in records if r["geometry"] == geometry and r["tokens"] == t and "us" in r}
        bf16 = min(by["bf16_grouped"]["us"], by["bf16_loop"]["us"])
        row = dict(geometry=geometry, tokens=t, bf16_us=bf16)
        for tier in TIERS:
            row[f"{tier}_us"] = by[tier]["us"]
            row[f"{tier}_speedup_vs_bf16"] = bf16 / by[tier]["us"]
            if f"{tier}_gemms" in by:
                g = by[f"{tier}_gemms"]
                row[f"{tier}_gemms_us"] = g["us"]
                row[f"{tier}_gemms_vs_read2"] = g["vs_read2"]
                row[f"{tier}_gemms_vs_read1"] = g["vs_read1"]
        for tier, fraction in MIXED.items():  # the promotion cost bound: base + x·(fp4 − base) + 5%
            x = by[tier].get("promoted", fraction)
            bound = (by["base"]["us"] + x * (by["fp4"]["us"] - by["base"]["us"])) * 1.05
            row[f"{tier}_promoted"] = x
            row[f"{tier}_vs_bound"] = by[tier]["us"] / bound
        rows.append(row)
    return rows


def _print_table(records: list[dict]) -> None:
    for r in records:
        if r["kind"] == "check":
            vs_exact = f" vs exact {r['rel_err_vs_exact']:.2e}" if "rel_err_vs_exact" in r else ""
            print(f"  {r['geometry']:18} T={r['tokens']:<5} {r['variant']:13} check rel_err={r['rel_err']:.2e}{vs_exact} "
                  f"written={r['written']} {'OK' if r['ok'] else 'FAIL'}")
        else:
            extra = ""
            if "gbs" in r:
                extra += f" {r['gbs']:7.0f} GB/s"
            if "config13" in r:
                c, d = r["config13"], r["config2"]
                tuning = c["tuning"] if c["tuning"] == d["tuning"] else f"{c['tuning']}/{d['tuning']}"
                extra += (f" {c['backend']} {tuning} blocks={c['blocks']}/{d['blocks']} w{c['num_warps']} s{c['num_stages']}"
                          f" split {c['split']}/{d['split']}")
            if r.get("rel_err") is not None:
                extra += f" rel_err {r['rel_err']:.2e}"
            if "read2_us" in r:
                extra += f" read2 {r['read2_us']:.1f} µs read1 {r['read1_us']:.1f} µs ratio {r['vs_read2']:.2f}/{r['vs_read1']:.2f}"
            elif "vs_read2" in r:
                extra += f" ratio {r['vs_read2']:.2f}/{r['vs_read1']:.2f}"
            if "tflops" in r:
                extra += f" {r['tflops']:6.0f} TFLOP/s"
            print(f"  {r['geometry']:18} T={r['tokens']:<5} {r['variant']:13} {r['us']:9.1f} µs{extra}")


def _plot(records: list[dict], path: Path) -> None:
    """µs per MoE layer vs tokens, one panel per geometry."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    geometries = sorted({r["geometry"] for r in records})
    fig, axes = plt.subplots(1, len(geometries), figsize=(6 * len(geometries), 4.5), squeeze=False)
    for ax, geometry in zip(axes[0], geometries):
        for variant in ("bf16_grouped", "bf16_loop") + TIERS + tuple(f"{t}_gemms" for t in TIERS):  # sweeps not plotted
            pts = sorted((r["tokens"], r["us"]) for r in records if r["geometry"] == geometry and r.get("variant") == variant and "us" in r)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=variant, linestyle="--" if variant.endswith("gemms") else "-")
        ax.set(xscale="log", yscale="log", xlabel="tokens", ylabel="µs per MoE layer", title=geometry)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"moet bench: wrote {path}")
