"""Tiered residency: decode step time, hit and replay rates vs cache and arena sizes; pack vs re-quantizing boot; disk speed; RSS.

A synthetic MoE with Zipf routing (moet.testing.synthetic_moe) runs single-stream decode steps through
the device cache (a CPU tensor pool here) and the replay driver. The boot comparison writes a
larger pack, drops it from the page cache, and reads it back with the reader pool and O_DIRECT,
against a dd-like O_DIRECT read of the same file in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # decode model: 8 layers × 64 experts of 32 KiB base; boot model: 8 × 64 experts of ~450 KiB
    "full": {"decode": (8, 64, 256, 128, 4), "boot": (8, 64, 1024, 512), "steps": 32, "warmup": 8, "boot_trials": 7,
             "cache": [0.25, 0.5, 0.75, 1.0], "arena": [0.0, 0.125, 0.25, 0.5], "rss_mib": [32, 64, 128, 192]},
    "quick": {"decode": (2, 16, 64, 32, 2), "boot": (2, 16, 128, 64), "steps": 4, "warmup": 2, "boot_trials": 2,
              "cache": [0.5, 1.0], "arena": [0.0, 0.5], "rss_mib": [1]},
}
DD_REQUEST = 8 << 20
DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "models" / "default"
HELDOUT_FILES = 4  # held-out standard-library files tokenized for the trace
RSS_STEPS = 120


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full", help="model sizes and sweep (quick: a smoke run)")
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of expert popularity")
    parser.add_argument("--threads", type=int, default=4, help="pack reader threads (VLLM_MOE_W2_STORE_THREADS)")
    parser.add_argument("--workdir", type=Path, default=None, help="where packs are written (default: a temp dir under /var/tmp)")
    parser.add_argument("--out", type=Path, default=None, help="results directory (default bench/results)")
    parser.add_argument("--trace-model", type=Path, default=DEFAULT_MODEL if DEFAULT_MODEL.is_dir() else None,
                        help="record this checkpoint's routing over held-out text and replay it through the cache (default: the embedded model)")
    parser.add_argument("--trace-tokens", type=int, default=512, help="decode positions in the recorded routing trace")
    parser.add_argument("--no-trace", action="store_true", help="skip the routing-trace sweep")


def run(args: argparse.Namespace) -> int:
    import torch

    from moet.bench._record import write_results

    torch.set_num_threads(1)
    preset = PRESETS[args.preset]
    with tempfile.TemporaryDirectory(dir=args.workdir or "/var/tmp", prefix="moet-tiers-") as work:
        work_dir = Path(work)
        results: dict[str, Any] = {"preset": args.preset, "zipf_s": args.zipf, "threads": args.threads}
        results["decode"] = decode_sweep(preset, args.zipf, work_dir / "decode", args.threads)
        results["boot"] = boot_comparison(preset, work_dir / "boot", args.threads)
        results["rss"] = [rss_probe_subprocess(work_dir / "boot", mib, args.threads, args.zipf) for mib in preset["rss_mib"]]
    if args.trace_model is not None and not args.no_trace:
        results["trace"] = trace_sweep(record_trace(args.trace_model, args.trace_tokens), preset["cache"])
    path = write_results("tiers", results, args.out)
    plot(results, path.with_suffix(".png"))
    print(summary(results))
    return 0


def decode_sweep(preset: dict[str, Any], zipf: float, pack_dir: Path, threads: int) -> dict[str, Any]:
    """Step time, hit, zero-miss and replay rates for device cache sizes (all pinned) and arena sizes (over a pack)."""
    import torch

    from moet.store import ArenaStore, ExpertCache, PackStore, PinnedStore, build_pack
    from moet.testing.synthetic_moe import make_model

    layers, experts, hidden, inter, top_k = preset["decode"]
    model = make_model(layers, experts, hidden, inter, top_k, zipf_s=zipf, seed=7)
    total = layers * experts
    pack = build_pack(pack_dir, 0, "bench-decode", model.layout, experts, layers, lambda layer: model.weights[layer])
    gen = torch.Generator().manual_seed(8)
    tokens = [torch.randn(1, hidden, dtype=torch.float64, generator=gen) for _ in range(preset["warmup"] + preset["steps"])]
    out: dict[str, Any] = {"model": {"layers": layers, "experts": experts, "hidden": hidden, "inter": inter, "top_k": top_k,
                                     "row_bytes": model.layout.base_span, "base_mib": total * model.layout.base_span / 2**20}}
    out["resident"] = _steps(model, tokens, preset, ExpertCache(PinnedStore.from_weights(model.layout, model.weights), slots=total))
    out["cache"] = []
    for share in preset["cache"]:
        cache = ExpertCache(PinnedStore.from_weights(model.layout, model.weights), slots=max(1, int(share * total)))
        out["cache"].append({"cache_share": share, **_steps(model, tokens, preset, cache)})
    out["arena"] = []
    cache_share = preset["cache"][0]
    for share in preset["arena"]:
        for protected in (0.8, 0.0) if share else (0.8,):
            slots = int(share * total)
            store = ArenaStore(pack, slots * pack.layout.base_span, threads, direct=True, protected_share=protected) if slots else \
                PackStore(pack, threads, direct=True)
            cache = ExpertCache(store, slots=max(1, int(cache_share * total)))
            row = _steps(model, tokens, preset, cache, prefill_every=16)
            out["arena"].append({"arena_share": share, "protected_share": protected if slots else None,
                                 "cache_share": cache_share, **row})
            store.close()
    pack.close()
    return out


def _host_hit_rate(stats: Any) -> float:
    return stats.hits / max(stats.hits + stats.misses, 1)


def _steps(model: Any, tokens: list, preset: dict[str, Any], cache: Any, prefill_every: int = 0) -> dict[str, Any]:
    """Warm start, warm-up decode steps, then measured decode steps (one token each).

    With `prefill_every`, a prefill scan streams every expert through the host tier that often;
    the host hit rate counts only the decode steps' fetches.
    """
    from moet.store import ReplayDriver
    from moet.testing.synthetic_moe import cached, forward

    driver = ReplayDriver(cache, fp_max=2 * model.layers, kpi_secs=1e9)
    keys = [(layer, expert) for layer in range(model.layers) for expert in range(model.experts)]
    popular = sorted(keys, key=lambda k: -float(model.prior[k]))[: cache.slots]
    cache.fetch(popular)  # warm start: the most popular experts, as a long-running server holds them
    times, before, host = [], None, [0, 0]
    for i, x in enumerate(tokens):
        if i == preset["warmup"]:
            before = driver.kpis()
        if prefill_every and i % prefill_every == prefill_every - 1:
            _prefill_scan(cache.store, keys, cache.slots)
        hits, misses = cache.store.stats.hits, cache.store.stats.misses
        start = time.perf_counter()
        driver.run(lambda x=x: forward(model, x, cached(cache)))
        times.append(time.perf_counter() - start)
        if before is not None:
            host[0] += cache.store.stats.hits - hits
            host[1] += cache.store.stats.misses - misses
    after = driver.kpis()
    steps = after["steps"] - before["steps"]
    delta = {k: after[k] - before[k] for k in ("zero_miss_steps", "replayed_steps", "replays", "fetch_bytes", "fetch_secs", "lookups", "misses")}
    measured = sorted(times[preset["warmup"]:])
    return {
        "steps": steps,
        "step_ms_median": 1e3 * measured[len(measured) // 2],
        "step_ms_mean": 1e3 * sum(measured) / len(measured),
        "zero_miss_fraction": delta["zero_miss_steps"] / steps,
        "replay_rate": delta["replayed_steps"] / steps,
        "replays_per_step": delta["replays"] / steps,
        "fetch_mib_per_step": delta["fetch_bytes"] / steps / 2**20,
        "fetch_ms_per_step": 1e3 * delta["fetch_secs"] / steps,
        "hit_rate": 1.0 - delta["misses"] / max(delta["lookups"], 1),
        "host_hit_rate": host[0] / max(sum(host), 1),
        "cache_slots": cache.slots,
    }


def record_trace(model_dir: Path, tokens: int) -> dict[str, Any]:
    """A real model's routing: one forward over held-out text; position t is decode step t, and each
    MoE layer's router gives its top-k experts there (teacher-forced, so the same as generating it)."""
    import numpy as np
    import torch
    from tokenizers import Tokenizer

    from moet.eval.perplexity import load_model
    from moet.models.data import encode_stream, read_text, split_files, stdlib_files

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = encode_stream(tok, [read_text(f) for f in split_files(stdlib_files())[1][:HELDOUT_FILES]])[:tokens]
    model = load_model(model_dir)
    routed: list[torch.Tensor] = []
    gates = [m for name, m in model.named_modules() if name.endswith("mlp.gate")]
    hooks = [g.register_forward_hook(lambda mod, args, out: routed.append(out[2])) for g in gates]
    with torch.no_grad():
        model(input_ids=torch.as_tensor(ids.astype(np.int64))[None])
    for hook in hooks:
        hook.remove()
    config = model.config
    return {"model": str(model_dir), "experts": config.num_experts, "hidden": config.hidden_size,
            "inter": config.moe_intermediate_size, "routing": torch.stack(routed, 1)}  # [tokens, layers, top_k]


def trace_sweep(trace: dict[str, Any], shares: list[float]) -> dict[str, Any]:
    """Replay a routing trace through device caches of several sizes: hit, zero-miss and replay rates.

    The routing is fixed by the trace, so one replay always reaches the fixed point; what matters is
    how often a step has to replay and how many bytes it fetches.
    """
    from moet.store import ExpertCache, PinnedStore, ReplayDriver
    from moet.store.layout import RowLayout
    from moet.store.reader import aligned_empty

    routing = trace["routing"]
    steps, layers, top_k = routing.shape
    experts = trace["experts"]
    layout = RowLayout.for_moe(trace["hidden"], trace["inter"], "nv16")
    store = PinnedStore(aligned_empty(layers * experts, layout.base_span), layout, experts, layers)
    rows = []
    for share in shares:
        cache = ExpertCache(store, slots=max(int(share * layers * experts), layers * top_k))
        driver = ReplayDriver(cache, fp_max=2, kpi_secs=1e9)
        warmup = steps // 4
        for t in range(steps):
            if t == warmup:
                before = driver.kpis()
            driver.run(lambda t=t: [cache.lookup(layer, routing[t, layer]) for layer in range(layers)])
        after = driver.kpis()
        n = after["steps"] - before["steps"]
        rows.append({
            "cache_share": share, "cache_slots": cache.slots, "steps": n,
            "hit_rate": 1.0 - (after["misses"] - before["misses"]) / (after["lookups"] - before["lookups"]),
            "zero_miss_fraction": (after["zero_miss_steps"] - before["zero_miss_steps"]) / n,
            "replay_rate": (after["replayed_steps"] - before["replayed_steps"]) / n,
            "fetch_kib_per_step": (after["fetch_bytes"] - before["fetch_bytes"]) / n / 1024,
        })
    return {"model": trace["model"], "tokens": steps, "layers": layers, "experts": experts, "top_k": top_k,
            "row_bytes": layout.base_span, "cache": rows}


def _prefill_scan(store: Any, keys: list, chunk: int) -> None:
    """A long prompt touches every expert once: streamed through the host tier with decode=False."""
    chunk = min(chunk, store.capacity or chunk)
    for start in range(0, len(keys), chunk):
        store.rows(keys[start : start + chunk], decode=False)


def boot_comparison(preset: dict[str, Any], pack_dir: Path, threads: int) -> dict[str, Any]:
    """Re-quantizing boot (FP4 source in memory → 2-bit rows) vs pack boot (cold pack → rows), and the disk's own speed."""
    import torch

    from moet.store import PinnedStore, build_pack, open_pack
    from moet.store.layout import RowLayout
    from moet.store.reader import RowReader, aligned_empty
    from moet.testing.synthetic_moe import quantize_source, random_source

    layers, experts, hidden, inter = preset["boot"]
    layout = RowLayout.for_moe(hidden, inter, "mx32")
    gen = torch.Generator().manual_seed(9)
    sources = [[random_source(layout, gen) for _ in range(experts)] for _ in range(layers)]
    start = time.perf_counter()
    weights = [[quantize_source(layout, src) for src in per_layer] for per_layer in sources]
    rows = PinnedStore.from_weights(layout, weights)
    requant_secs = time.perf_counter() - start
    del sources
    build_pack(pack_dir, 0, "bench-boot", layout, experts, layers, lambda layer: weights[layer]).close()
    del weights
    base_bytes = rows.host_bytes()
    del rows
    path = pack_dir / "rank0.pack"
    pack = open_pack(pack_dir, 0, "bench-boot")
    keys = [(layer, expert) for layer in range(layers) for expert in range(experts)]
    table = aligned_empty(len(keys), layout.base_span)
    table.fill_(0)  # pages faulted in once: the read phase alone
    reader = RowReader(pack, threads, direct=True)
    trials: dict[str, list[float]] = {"dd_gbps": [], "pack_read_gbps": [], "pack_boot_secs": []}
    for _ in range(preset["boot_trials"]):  # interleaved: the shared disk's speed drifts
        drop_page_cache(path)
        trials["dd_gbps"].append(dd_read(path))
        drop_page_cache(path)
        start = time.perf_counter()
        nbytes = reader.read(keys, list(table))
        trials["pack_read_gbps"].append(nbytes / (time.perf_counter() - start) / 1e9)
        drop_page_cache(path)
        start = time.perf_counter()
        booted = open_pack(pack_dir, 0, "bench-boot")
        PinnedStore.from_pack(booted, threads, direct=True)
        trials["pack_boot_secs"].append(time.perf_counter() - start)
        booted.close()
    reader.close()
    pack.close()
    median = {name: statistics.median(values) for name, values in trials.items()}
    return {
        "layers": layers, "experts": experts, "hidden": hidden, "inter": inter,
        "pack_bytes": path.stat().st_size, "base_bytes": base_bytes,
        "requant_boot_secs": requant_secs,
        "pack_boot_secs": median["pack_boot_secs"],
        "pack_boot_gbps": base_bytes / median["pack_boot_secs"] / 1e9,
        "pack_read_gbps": median["pack_read_gbps"],
        "disk_seq_read_gbps": median["dd_gbps"],
        "pack_read_fraction_of_disk": median["pack_read_gbps"] / median["dd_gbps"],
        "pack_read_fraction_of_disk_paired_median": statistics.median(r / d for r, d in zip(trials["pack_read_gbps"], trials["dd_gbps"])),
        "pack_boot_fraction_of_disk": base_bytes / median["pack_boot_secs"] / 1e9 / median["dd_gbps"],
        "speedup_vs_requant": requant_secs / median["pack_boot_secs"],
        "trials": trials,
    }


def drop_page_cache(path: Path) -> None:
    """Evict a file from the page cache (after syncing it), so the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def dd_read(path: Path) -> float:
    """GB/s of one sequential O_DIRECT read of the whole file in 8 MiB requests (dd iflag=direct bs=8M)."""
    from moet.store.reader import aligned_empty

    buf = memoryview(aligned_empty(1, DD_REQUEST).numpy()).cast("B")
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    total, start = 0, time.perf_counter()
    try:
        while n := os.readv(fd, [buf]):
            total += n
    finally:
        os.close(fd)
    return total / (time.perf_counter() - start) / 1e9


def rss_probe_subprocess(pack_dir: Path, arena_mib: int, threads: int, zipf: float) -> dict[str, Any]:
    """Peak RSS of a fresh process serving decode fetches and a prefill scan from the boot pack through an arena."""
    code = f"from moet.bench.tiers import rss_probe; rss_probe({str(pack_dir)!r}, {arena_mib}, {threads}, {zipf})"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def rss_probe(pack_dir: str, arena_mib: int, threads: int, zipf: float) -> None:
    """(Runs in the child.) Prints {arena_mib, baseline_mib, peak_mib, overhead_mib} as JSON."""
    import torch

    from moet.store import ArenaStore, open_pack

    baseline = _vm_hwm_mib()
    pack = open_pack(pack_dir, 0, "bench-boot")
    store = ArenaStore(pack, arena_mib << 20, threads, direct=True)
    gen = torch.Generator().manual_seed(3)
    weights = torch.arange(1, pack.experts + 1, dtype=torch.float64).pow(-zipf)
    keys = [(layer, expert) for layer in range(pack.layers) for expert in range(pack.experts)]
    for step in range(RSS_STEPS):
        picks = torch.multinomial(weights, 4, generator=gen).tolist()
        store.rows([(layer, e) for layer in range(pack.layers) for e in picks], decode=True)
        if step == RSS_STEPS // 2:
            _prefill_scan(store, keys, store.lru.slots)
    peak = _vm_hwm_mib()
    print(json.dumps({"arena_mib": arena_mib, "baseline_mib": baseline, "peak_mib": peak, "overhead_mib": peak - baseline - arena_mib,
                      "arena_hit_rate": _host_hit_rate(store.stats)}))


def _vm_hwm_mib() -> float:
    """This process's peak RSS (VmHWM: unlike ru_maxrss it does not inherit the parent's peak across exec)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def summary(results: dict[str, Any]) -> str:
    boot, dec = results["boot"], results["decode"]
    lines = [f"boot: pack {boot['pack_boot_secs']:.2f} s ({boot['pack_boot_gbps']:.2f} GB/s into fresh memory) vs re-quantizing "
             f"{boot['requant_boot_secs']:.2f} s; pack reads {boot['pack_read_gbps']:.2f} GB/s = "
             f"{100 * boot['pack_read_fraction_of_disk']:.0f}% of the disk's {boot['disk_seq_read_gbps']:.2f} GB/s (O_DIRECT dd, same run)"]
    for row in dec["cache"]:
        lines.append(f"cache {row['cache_share']:>5.3f}: step {row['step_ms_median']:.1f} ms, zero-miss {row['zero_miss_fraction']:.2f}, "
                     f"replay {row['replay_rate']:.2f}, fetch {row['fetch_mib_per_step']:.2f} MiB/step")
    for row in dec["arena"]:
        lines.append(f"arena {row['arena_share']:>5.3f} (protected {row['protected_share']}): host hit {row['host_hit_rate']:.2f}, "
                     f"step {row['step_ms_median']:.1f} ms, fetch {row['fetch_ms_per_step']:.2f} ms/step")
    for row in results.get("trace", {}).get("cache", []):
        lines.append(f"trace cache {row['cache_share']:>5.3f}: hit {row['hit_rate']:.3f}, zero-miss {row['zero_miss_fraction']:.2f}, "
                     f"replay {row['replay_rate']:.2f}, fetch {row['fetch_kib_per_step']:.0f} KiB/step")
    for row in results["rss"]:
        lines.append(f"rss: arena {row['arena_mib']} MiB → peak {row['peak_mib']:.0f} MiB (baseline {row['baseline_mib']:.0f}, overhead {row['overhead_mib']:.0f})")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dec, boot = results["decode"], results["boot"]
    fig, ax = plt.subplots(2, 2, figsize=(11, 8))
    shares = [r["cache_share"] for r in dec["cache"]]
    for key, label in (("zero_miss_fraction", "zero-miss steps"), ("replay_rate", "replayed steps"), ("hit_rate", "expert hit rate")):
        ax[0, 0].plot(shares, [r[key] for r in dec["cache"]], "o-", label=label)
    if "trace" in results:
        rows = results["trace"]["cache"]
        ax[0, 0].plot([r["cache_share"] for r in rows], [r["zero_miss_fraction"] for r in rows], "^:", label="zero-miss steps (default-model trace)")
    ax[0, 0].set(xlabel="device cache (share of all experts)", ylabel="fraction", title=f"Zipf s={results['zipf_s']} decode, all-pinned host")
    ax[0, 0].legend()
    ax[0, 1].plot(shares, [r["step_ms_median"] for r in dec["cache"]], "o-", label="step (median)")
    ax[0, 1].plot(shares, [r["fetch_ms_per_step"] for r in dec["cache"]], "s--", label="fetch per step")
    ax[0, 1].axhline(dec["resident"]["step_ms_median"], color="gray", ls=":", label="fully resident")
    ax[0, 1].set(xlabel="device cache (share of all experts)", ylabel="ms", title="decode step time (float64 reference forward)")
    ax[0, 1].legend()
    for protected in (0.8, 0.0):
        rows = [r for r in dec["arena"] if r["protected_share"] in (protected, None)]
        ax[1, 0].plot([r["arena_share"] for r in rows], [r["host_hit_rate"] for r in rows], "o-",
                      label=f"arena hit rate (decode), protected {protected}")
    ax[1, 0].set(xlabel="host arena (share of all experts)", ylabel="host hit rate", title="pack + arena, prefill scan every 16 steps")
    ax[1, 0].legend()
    rss = results["rss"]
    ax[1, 1].plot([r["arena_mib"] for r in rss], [r["peak_mib"] for r in rss], "o-", label="peak RSS")
    ax[1, 1].plot([r["arena_mib"] for r in rss], [r["baseline_mib"] + r["arena_mib"] for r in rss], "k:", label="baseline + arena")
    ax[1, 1].set(xlabel="arena MiB", ylabel="MiB", title=f"boot: pack {boot['pack_boot_secs']:.2f} s vs requant {boot['requant_boot_secs']:.2f} s; "
                 f"reads {100 * boot['pack_read_fraction_of_disk']:.0f}% of disk")
    ax[1, 1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"moet bench: wrote {path}")
