"""`moet plan MODEL`: before a long load, where each part of the model will live, whether it fits, how fast it decodes.

Reads config.json and the safetensors headers only (moet.planning.geometry), places dense weights,
2-bit experts, FP4 pool, KV cache, host store and pack on the GPUs, host RAM and NVMe given (or
found here) under the VLLM_MOE_W2_* knobs of the environment (moet.planning.fit), and predicts batch-1
decode tok/s from constants measured on the H200 (moet.planning.measured, each named by its file).
A plan that does not fit is refused with one line and exit 1. `moet serve` and `moet supervise` print
`startup_check`'s one-line summary first and refuse only what no vLLM setting can make fit.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from moet.errors import ConfigError, MoetError
from moet.knobs import Knobs

UNITS = {"": 2**30, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "plan",
        help="where a model's tiers go on this hardware, whether it fits, and its predicted decode tok/s",
        description="From the checkpoint's headers alone (no weight is read): per tier what goes where, and the "
        "predicted decode tok/s. Exits 1 with one line when it cannot fit. Sizes take K/M/G/T suffixes "
        "(binary: 96G = 96 GiB); knobs come from the VLLM_MOE_W2_* environment.",
    )
    parser.add_argument("model", metavar="MODEL", help="checkpoint directory or cached Hugging Face id")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs the model is split over (tensor parallel; default 1)")
    parser.add_argument("--gpu-mem", type=parse_size, help="memory per GPU (default: GPU 0's, from nvidia-smi; none: plan for CPU)")
    parser.add_argument("--ram", type=parse_size, help="host RAM (default: MemTotal)")
    parser.add_argument("--nvme", type=Path, help="where packs go (default VLLM_MOE_W2_STORE_DIR; unset: no packs)")
    parser.add_argument("--max-model-len", type=int, help="KV cache tokens (default: the model's context window)")
    parser.add_argument("--json", action="store_true", help="the plan as JSON on stdout (exit 1 still means it does not fit)")
    parser.set_defaults(func=run)


def parse_size(text: str) -> int:
    """'96G', '96GiB', '1.5T', '512M', '96' (GiB) → bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if m is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 96G, 512M, 1.5T)")
    return int(float(m[1]) * UNITS[m[2]])


def gpu_memory() -> int | None:
    """GPU 0's memory from nvidia-smi (no CUDA context is created), None where there is no NVIDIA GPU."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return int(out[0]) * 2**20 if out and out[0].isdigit() else None


def ram_total() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise OSError("no MemTotal in /proc/meminfo")


def make(model_dir: Path, knobs: Knobs, gpus: int, gpu_bytes: int | None, ram: int | None, nvme: Path | None, max_len: int | None):
    """The plan of a checkpoint directory (moet.planning.fit.Plan); the prediction is left out when the
    measured constants are not there (an installed wheel carries no bench/results)."""
    from moet.planning.fit import Resources, make_plan
    from moet.planning.geometry import read_geometry
    from moet.planning.measured import measured

    if gpus < 1:
        raise ConfigError(f"--gpus {gpus}: must be at least 1")
    geo = read_geometry(model_dir)
    try:
        constants = measured()
    except MoetError as exc:
        constants, missing = None, str(exc)
    else:
        missing = None
    plan = make_plan(geo, knobs, Resources(gpus, gpu_bytes, ram or ram_total(), nvme, max_len), constants)
    if missing is not None:
        plan.notes.append(f"no decode prediction: {missing}")
    return plan


def render(plan) -> str:
    """The plan as a table: one row per part, then each tier's total against what it holds."""
    from moet.planning.fit import gib

    geo = plan.geometry
    where_name = {"vram": "VRAM/GPU", "ram": "host RAM", "nvme": "NVMe"}
    lines = [
        f"moet plan: {geo.root}",
        f"  {geo.architecture}, {geo.quant} experts → 2-bit {geo.scale_kind} ({geo.base_bits_per_weight:.3f} bits/weight); "
        f"{geo.moe_layers} of {geo.layers} layers MoE, {geo.experts} experts (H {geo.hidden}, I {geo.inter}), top-{geo.top_k}; "
        f"{plan.device}" + (f" × {plan.gpus}" if plan.device == "gpu" else " (vLLM's CPU build)"),
        f"  {'part':<30} {'where':<9} {'GiB':>8}  note",
    ]
    for p in plan.parts:
        lines.append(f"  {p.name:<30} {where_name[p.where]:<9} {gib(p.bytes):>8}  {p.note}")
    for where, cap in plan.capacity.items():
        label = "vLLM budget" if where == "vram" else ("free" if where == "nvme" else "total")
        lines.append(f"  {'= ' + where_name[where]:<30} {'':<9} {gib(plan.need(where)):>8}  of {gib(cap)} ({label})")
    if plan.tok_s is not None:
        lines.append(f"  decode ≈ {plan.tok_s:.0f} tok/s at batch 1 on an H200, from:")
        lines += [f"    {c}" for c in plan.constants]
    lines += [f"  note: {n}" for n in plan.notes]
    lines.append("  fits" if plan.fits else f"  does not fit: {'; also '.join(plan.problems)}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from moet.commands.serve import serve_knobs
    from moet.models import resolve_model

    model_dir = resolve_model(args.model)
    gpu_bytes = args.gpu_mem if args.gpu_mem is not None else gpu_memory()
    plan = make(model_dir, serve_knobs(dict(os.environ)), args.gpus, gpu_bytes, args.ram, args.nvme, args.max_model_len)
    if args.json:
        print(json.dumps(plan.as_dict(), indent=1))
        return 0 if plan.fits else 1
    if not plan.fits:
        raise MoetError("; also ".join(plan.problems))
    print(render(plan))
    return 0


def _vllm_arg(vllm_args: Sequence[str], *names: str) -> int | None:
    """The integer value of a vLLM option (`--name N` or `--name=N`), None when absent."""
    for i, arg in enumerate(vllm_args):
        key, _, value = arg.partition("=")
        if key in names:
            value = value or (vllm_args[i + 1] if i + 1 < len(vllm_args) else "")
            return int(value) if value.isdigit() else None
    return None


def startup_check(model_dir: Path, knobs: Knobs, vllm_args: Sequence[str], gpus: int | None = None) -> str:
    """`moet serve`/`moet supervise`'s first line: the plan in short. Raises MoetError only when the plan is
    certainly impossible; a plan that cannot be made (an architecture moet's reader does not know) is a note."""
    from moet.planning.fit import gib
    from moet.serving import CPU_MAX_MODEL_LEN, on_cpu

    if not knobs.w2:
        return "moet: plan: skipped (VLLM_MOE_W2=0: stock vLLM path)"
    gpu_bytes = gpu_memory()
    tp = _vllm_arg(vllm_args, "--tensor-parallel-size", "-tp") or gpus or 1
    max_len = _vllm_arg(vllm_args, "--max-model-len")
    try:
        plan = make(model_dir, knobs, tp, gpu_bytes, None, None, max_len)
        if max_len is None and plan.device == "cpu" and on_cpu():
            plan = make(model_dir, knobs, tp, gpu_bytes, None, None, min(plan.tokens, CPU_MAX_MODEL_LEN))
    except MoetError as exc:
        return f"moet: plan: skipped ({exc})"
    if plan.impossible:
        raise MoetError(f"{model_dir}: {'; also '.join(plan.impossible)}; see `moet plan {model_dir}`")
    tiers = ", ".join(f"{name} {gib(plan.need(w))} of {gib(cap)} GiB" for w, name in (("vram", "VRAM/GPU"), ("ram", "RAM"), ("nvme", "NVMe"))
                      if (cap := plan.capacity.get(w)) is not None)
    speed = f"; ≈ {plan.tok_s:.0f} tok/s at batch 1 (H200 constants)" if plan.tok_s else ""
    verdict = "" if plan.fits else f"; may not fit: {plan.problems[0]}"
    return f"moet: plan: {tiers} ({plan.tokens} tokens of KV){speed}{verdict}"
