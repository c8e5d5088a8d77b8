"""Memory a checkpoint load stages: process RSS plus the page cache it leaves, per layer, with and without dropping pages.

On unified-memory machines (DGX Spark class) the page cache counts against the GPU's memory, so a
loader that reads a 100 GB checkpoint through the cache can starve the model it is loading. The
loader's read path (moet.formats.experts.RoutedExperts: positioned reads, then requantization) drops
each layer's source pages (VLLM_MOE_W2_DROP_SOURCE_PAGES, posix_fadvise DONTNEED) once the layer is
requantized. Measured here on a generated NVFP4 checkpoint (moet.bench.requant.generate), loaded
cold in a fresh process per variant: at every layer boundary and every `--every-s` seconds, the
process's RSS and /proc/meminfo Cached as deltas from before the load, and the checkpoint's own pages
in the cache (mincore over its shards: exact, unlike Cached, which other processes also move).
Target: at no point more than one layer's source bytes + 256 MiB.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import multiprocessing
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

GIB = 2**30
SLACK_BYTES = 256 * 2**20  # the target allows one layer's source bytes plus this
# What the seed project reports for its loader on DGX Spark: staged memory per layer before / after dropping pages.
SEED_DGX_SPARK_GIB = {"without": 4.7, "with": 1.69}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size-gb", type=float, default=8.0, help="generated checkpoint size in GB (default 8)")
    parser.add_argument("--tier", choices=("none", "planes", "refine"), default="none", help="FP4 tier built while loading (default none, as the plugin without a pool)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the load (default 1)")
    parser.add_argument("--repeats", type=int, default=1, help="loads per variant, in alternating order (default 1: keep, then drop)")
    parser.add_argument("--every-s", type=float, default=0.1, help="sampling period between layer boundaries (default 0.1 s)")
    parser.add_argument("--dir", type=Path, default=None, help="where to generate the checkpoint (default: the system temp dir); removed afterwards")
    parser.add_argument("--out-dir", type=Path, default=None, help="results directory (default bench/results)")


def _cached_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Cached:"):
                return int(line.split()[1]) * 1024
    raise OSError("no Cached in /proc/meminfo")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_LIBC.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_LIBC.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident_bytes(path: Path) -> int:
    """Bytes of `path` in the page cache (mincore over a mapping that is never touched, so no page is faulted in)."""
    size = path.stat().st_size
    if size == 0:
        return 0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr == _MAP_FAILED:
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        try:
            pages = -(-size // mmap.PAGESIZE)
            vec = (ctypes.c_ubyte * pages)()
            if _LIBC.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {path}")
            return (pages - bytes(vec).count(0)) * mmap.PAGESIZE  # bit 0 set = resident; the other bits are reserved (0)
        finally:
            _LIBC.munmap(addr, size)
    finally:
        os.close(fd)


class Probe:
    """Deltas from the moment it was made: RSS, Cached and the shards' resident pages (all in bytes)."""

    def __init__(self, shards: list[Path]) -> None:
        self.shards = shards
        self.t0 = time.monotonic()
        self.rss0, self.cached0 = _rss_bytes(), _cached_bytes()

    def sample(self, **extra: Any) -> dict[str, Any]:
        rss, cached = _rss_bytes() - self.rss0, _cached_bytes() - self.cached0
        resident = sum(resident_bytes(p) for p in self.shards)
        return {"t_s": round(time.monotonic() - self.t0, 3), "rss": rss, "cached": cached, "resident": resident,
                "rss_cached": rss + cached, "rss_resident": rss + resident, **extra}


def load(model_dir: Path, drop: bool, tier: str, threads: int, every_s: float) -> dict[str, Any]:
    """Stream and requantize every routed expert as the loader does, sampling memory; runs in a fresh process."""
    import torch

    from moet.formats.experts import RoutedExperts
    from moet.quant.codebook import Tier
    from moet.quant.requant import requantize

    torch.set_num_threads(threads)
    probe = Probe(sorted(model_dir.glob("*.safetensors")))
    timed: list[dict[str, Any]] = []
    stop = threading.Event()

    def sample_every() -> None:
        while not stop.wait(every_s):
            timed.append(probe.sample())

    sampler = threading.Thread(target=sample_every, daemon=True)
    layers: list[dict[str, Any]] = []
    source, layer_bytes, current = 0, 0, None
    start = time.perf_counter()
    sampler.start()
    with RoutedExperts(model_dir, drop_pages=drop) as stream:
        for src in stream:
            if src.key.layer != current:
                if current is not None:  # the previous layer is requantized (and, with drop, its pages dropped)
                    layers.append(probe.sample(layer=current, source_bytes=layer_bytes))
                current, layer_bytes = src.key.layer, 0
            requantize(src, Tier(tier))
            layer_bytes += src.source_nbytes()
            source += src.source_nbytes()
    layers.append(probe.sample(layer=current, source_bytes=layer_bytes))
    wall = time.perf_counter() - start
    stop.set()
    sampler.join()
    return {"drop_source_pages": drop, "wall_s": round(wall, 2), "source_bytes": source,
            "mb_per_s": round(source / 1e6 / wall, 1), "layers": layers, "samples": timed}


def _in_child(model_dir: Path, drop: bool, args: argparse.Namespace) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no allocator state shared between variants
    with ctx.Pool(1) as pool:
        return pool.apply(load, (model_dir, drop, args.tier, args.threads, args.every_s))


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """Peaks over layer boundaries and timed samples, against the target of one layer's source + 256 MiB."""
    points = run["layers"] + run["samples"]
    layer_source = max(layer["source_bytes"] for layer in run["layers"])
    target = layer_source + SLACK_BYTES
    peak = {key: max(p[key] for p in points) for key in ("rss", "cached", "resident", "rss_cached", "rss_resident")}
    return {"drop_source_pages": run["drop_source_pages"], "wall_s": run["wall_s"], "mb_per_s": run["mb_per_s"],
            "layer_source_bytes": layer_source, "target_bytes": target,
            "peak_bytes": peak, "peak_gib": {k: round(v / GIB, 3) for k, v in peak.items()},
            # the checkpoint's own pages are exact; Cached also moves with every other process on the machine
            "meets_target": peak["rss_resident"] <= target, "meets_target_by_cached": peak["rss_cached"] <= target}


def run(args: argparse.Namespace) -> int:
    from moet.bench._record import write_results
    from moet.bench.requant import EXPERT_WIDTH, EXPERTS, HIDDEN, LAYERS_PER_SHARD, generate
    from moet.bench.tiers import drop_page_cache

    base = Path(tempfile.mkdtemp(prefix="moet-bench-staging-", dir=args.dir))
    try:
        model = base / "nvfp4"
        t0 = time.perf_counter()
        layers = generate(model, args.size_gb)
        shards = sorted(model.glob("*.safetensors"))
        print(f"generated {sum(p.stat().st_size for p in shards) / 1e9:.2f} GB, {layers} layers in {time.perf_counter() - t0:.0f} s")
        runs = []
        for drop in [d for i in range(args.repeats) for d in ((False, True) if i % 2 == 0 else (True, False))]:
            for shard in shards:  # every load starts cold
                drop_page_cache(shard)
            result = _in_child(model, drop, args)
            result["summary"] = summarize(result)
            s = result["summary"]
            print(f"drop_source_pages={int(drop)}: {s['mb_per_s']} MB/s, peak RSS+Cached {s['peak_gib']['rss_cached']} GiB, "
                  f"RSS+checkpoint pages {s['peak_gib']['rss_resident']} GiB (target {s['target_bytes'] / GIB:.3f} GiB: "
                  f"{'met' if s['meets_target'] else 'missed'})")
            runs.append(result)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    without, with_ = (max(r["summary"]["peak_gib"]["rss_resident"] for r in runs if r["drop_source_pages"] == d) for d in (False, True))
    rates = {f"drop_source_pages={int(d)}": statistics.median(r["mb_per_s"] for r in runs if r["drop_source_pages"] == d) for d in (False, True)}
    print(f"median MB/s of source: {rates}")
    print(f"staged memory, without → with dropping: seed on DGX Spark {SEED_DGX_SPARK_GIB['without']} → "
          f"{SEED_DGX_SPARK_GIB['with']} GiB per layer; here {without} → {with_} GiB peak "
          f"(layers of {runs[0]['summary']['layer_source_bytes'] / GIB:.3f} GiB)")
    shape = {"hidden": HIDDEN, "expert_width": EXPERT_WIDTH, "experts_per_layer": EXPERTS, "layers": layers, "layers_per_shard": LAYERS_PER_SHARD}
    results = {"format": "modelopt NVFP4 (synthetic Qwen3-MoE)", "size_gb": args.size_gb, "tier": args.tier, "threads": args.threads,
               "shape": shape, "seed_dgx_spark_gib": SEED_DGX_SPARK_GIB, "peak_gib": {"without": without, "with": with_},
               "median_mb_per_s": rates, "runs": runs}
    path = write_results("staging", results, args.out_dir)
    plot(runs[:2], path.with_suffix(".png"))
    return 0


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    """Memory over the load, per variant: RSS + checkpoint pages (solid), RSS + Cached (dotted), the target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for result, color in zip(runs, ("tab:red", "tab:blue")):
        label = "drop pages" if result["drop_source_pages"] else "keep pages"
        points = sorted(result["layers"] + result["samples"], key=lambda p: p["t_s"])
        t = [p["t_s"] for p in points]
        ax.plot(t, [p["rss_resident"] / GIB for p in points], color=color, label=f"{label}: RSS + checkpoint pages")
        ax.plot(t, [p["rss_cached"] / GIB for p in points], color=color, linestyle=":", label=f"{label}: RSS + ΔCached")
    ax.axhline(runs[0]["summary"]["target_bytes"] / GIB, color="gray", linestyle="--", label="target: 1 layer + 256 MiB")
    ax.set(xlabel="seconds into the load", ylabel="GiB attributable to the load", title="checkpoint load: staged memory")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"moet bench: wrote {path}")
