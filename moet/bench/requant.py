"""Requantization throughput (MB/s of source) and peak RSS of `moet quantize` on generated NVFP4 checkpoints.

Each size gets a synthetic Qwen3-MoE modelopt NVFP4 checkpoint (random nibbles, valid e4m3 scales),
written shard by shard with one tensor in memory at a time, in a temporary directory that is
removed afterwards. `moet quantize` then runs as a child process; its peak RSS comes from the
kernel's rusage of that child (ru_maxrss), so two sizes show whether memory depends on the
checkpoint's size.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HIDDEN = 2048
EXPERT_WIDTH = 1024
EXPERTS = 64
LAYERS_PER_SHARD = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes-gb", default="1,4", help="comma-separated checkpoint sizes in GB (default 1,4)")
    parser.add_argument("--tier", choices=("none", "planes", "refine"), default="refine", help="FP4 tier that moet quantize builds")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of moet quantize (its --threads)")
    parser.add_argument("--dir", type=Path, default=None, help="where to generate the checkpoints (default: the system temp dir)")


def _expert_tensors(layer: int, expert: int, hidden: int = HIDDEN, width: int = EXPERT_WIDTH) -> list[tuple[str, Any, tuple[int, ...]]]:
    import torch

    specs = []
    for proj, (n, k) in (("gate_proj", (width, hidden)), ("up_proj", (width, hidden)), ("down_proj", (hidden, width))):
        module = f"model.layers.{layer}.mlp.experts.{expert}.{proj}"
        specs += [
            (f"{module}.weight", torch.uint8, (n, k // 2)),
            (f"{module}.weight_scale", torch.float8_e4m3fn, (n, k // 16)),
            (f"{module}.weight_scale_2", torch.float32, ()),
            (f"{module}.input_scale", torch.float32, ()),
        ]
    return specs


def _random_tensor(dtype: Any, shape: tuple[int, ...], gen: Any) -> Any:
    import torch

    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    if dtype == torch.float8_e4m3fn:  # e4m3 bytes 0x30..0x47: 0.5 .. 15, never NaN
        return torch.randint(0x30, 0x48, shape, dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)
    return torch.rand(shape, generator=gen, dtype=torch.float32) * 1e-3 + 1e-4


def generate(
    out: Path, size_gb: float, seed: int = 0, hidden: int = HIDDEN, width: int = EXPERT_WIDTH, experts: int = EXPERTS,
    layers_per_shard: int = LAYERS_PER_SHARD,
) -> int:
    """Write a synthetic NVFP4 checkpoint of about `size_gb` GB (all of it routed experts); returns its layer count."""
    import torch

    from moet.formats.safetensors_io import DTYPES, TAGS, write_streaming

    per_layer = sum(math.prod(shape) * DTYPES[TAGS[dtype]][1] for e in range(experts) for _, dtype, shape in _expert_tensors(0, e, hidden, width))
    layers = max(1, round(size_gb * 1e9 / per_layer))
    out.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    shards = math.ceil(layers / layers_per_shard)
    for shard in range(shards):
        layer_range = range(shard * layers_per_shard, min(layers, (shard + 1) * layers_per_shard))
        specs = [s for layer in layer_range for e in range(experts) for s in _expert_tensors(layer, e, hidden, width)]
        shapes = {name: (dtype, shape) for name, dtype, shape in specs}
        name = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        write_streaming(out / name, specs, lambda t: _random_tensor(*shapes[t], gen))
        weight_map.update(dict.fromkeys(shapes, name))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": hidden,
        "moe_intermediate_size": width,
        "num_experts": experts,
        "num_hidden_layers": layers,
        "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "ignore": ["lm_head"]},
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return layers


def measure(model_dir: Path, tier: str, threads: int) -> dict[str, Any]:
    """Run `moet quantize` as a child; wall time, its reported rate and the child's peak RSS."""
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "moet.cli", "quantize", str(model_dir), "--tier", tier, "--threads", str(threads)], stdout=subprocess.PIPE, text=True)
    stdout = child.stdout.read() if child.stdout else ""
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    if child.returncode != 0:
        raise RuntimeError(f"moet quantize exited {child.returncode}")
    rate = re.search(r"time ([\d.]+) s, ([\d.]+) MB/s", stdout)
    tensors = re.search(r"(\d+) routed-expert tensors", stdout)
    return {
        "wall_s": round(wall, 2),
        "quantize_s": float(rate.group(1)) if rate else None,
        "mb_per_s": float(rate.group(2)) if rate else None,
        "tensors": int(tensors.group(1)) if tensors else None,
        "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),  # Linux reports KiB
        "summary": stdout.strip().splitlines(),
    }


def run(args: argparse.Namespace) -> int:
    from moet.bench._record import write_results

    sizes = [float(s) for s in args.sizes_gb.split(",") if s]
    runs = []
    base = Path(tempfile.mkdtemp(prefix="moet-bench-requant-", dir=args.dir))
    try:
        for size in sizes:
            model = base / f"nvfp4-{size:g}gb"
            t0 = time.perf_counter()
            layers = generate(model, size)
            source = sum(p.stat().st_size for p in model.glob("*.safetensors"))
            gen_s = time.perf_counter() - t0
            result = {"size_gb": size, "layers": layers, "source_bytes": source, "generate_s": round(gen_s, 1), **measure(model, args.tier, args.threads)}
            print(f"{size:g} GB ({layers} layers): {result['mb_per_s']} MB/s, peak RSS {result['peak_rss_mb']} MB, {result['wall_s']} s wall")
            runs.append(result)
            shutil.rmtree(model)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    shape = {"hidden": HIDDEN, "expert_width": EXPERT_WIDTH, "experts_per_layer": EXPERTS, "layers_per_shard": LAYERS_PER_SHARD}
    write_results("requant", {"tier": args.tier, "threads": args.threads, "format": "modelopt NVFP4 (synthetic Qwen3-MoE)", "shape": shape, "runs": runs})
    return 0
