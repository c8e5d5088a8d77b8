"""`moet quantize MODEL_DIR`: requantize every routed expert to the 2-bit base (+ FP4 tier) and summarize.

`--dump-dequant OUT.safetensors` writes, per routed-expert source tensor NAME (HF per-expert naming,
fused layouts split back), float32 `NAME@2bit` and `NAME@fp4`: what the base and the FP4 tier
represent, computed in float64 and rounded once. It is collected in memory (a debugging and test
tool, not for full-size checkpoints) and written to a temporary file renamed into place, so an
error never leaves a partial file. `--store DIR` then writes (or reuses, and says so) the rank-0 pack
file with moet.store.build.write_pack_from_checkpoint, which streams the checkpoint a second time.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from moet.errors import ConfigError

TIERS = ("none", "planes", "refine")


@dataclass
class Totals:
    tensors: int = 0
    weights: int = 0
    source_bytes: int = 0
    base_bytes: int = 0
    tier_bytes: int = 0

    def bits(self, nbytes: int) -> float:
        return 8 * nbytes / self.weights if self.weights else 0.0


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("quantize", help="requantize a checkpoint's routed experts to the 2-bit base and FP4 tier")
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="HF checkpoint directory (NVFP4, MXFP4, FP8 block or BF16/FP16)")
    parser.add_argument("--tier", choices=TIERS, default="refine", help="FP4 tier to build beside the base (default: refine)")
    parser.add_argument("--store", metavar="DIR", type=Path, help="also write the pack file there (reused when complete and current)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: per-tensor work is small and OpenMP threads stall under other load; "
        "measured 61 MB/s with 1 vs 4.5 MB/s with 2 on a busy 2-core machine)",
    )
    parser.add_argument("--dump-dequant", metavar="OUT.safetensors", type=Path, help="write NAME@2bit and NAME@fp4 float32 tensors per routed expert")
    parser.set_defaults(func=run)


def _write_dump(out: Path, tensors: dict) -> None:
    from safetensors.torch import save_file

    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from moet.formats.experts import RoutedExperts
    from moet.quant.codebook import Tier, dequantize_base, dequantize_fp4
    from moet.quant.requant import requantize

    if args.threads < 1:
        raise ConfigError(f"--threads {args.threads}: must be at least 1")
    torch.set_num_threads(args.threads)
    dump: Path | None = args.dump_dequant
    if dump is not None and not dump.parent.is_dir():
        raise ConfigError(f"--dump-dequant {dump}: directory {dump.parent} does not exist")
    # The dump needs the FP4 tier's values, so it builds one even with --tier none.
    requested = Tier(args.tier)
    tier = Tier.PLANES if dump is not None and requested == Tier.NONE else requested
    totals = Totals()
    dumped: dict[str, torch.Tensor] = {}
    start = time.perf_counter()
    with RoutedExperts(args.model_dir) as experts:
        ckpt = experts.checkpoint
        for src in tqdm(experts, total=len(experts), unit="tensor", desc="requantize", leave=False, disable=None):
            qw = requantize(src, tier)
            n, k = qw.shape
            totals.tensors += 1
            totals.weights += n * k
            totals.source_bytes += src.source_nbytes()
            totals.base_bytes += qw.base_nbytes()
            totals.tier_bytes += qw.tier_nbytes()
            if dump is not None:
                dumped[f"{src.name}@2bit"] = dequantize_base(qw).to(torch.float32)
                dumped[f"{src.name}@fp4"] = dequantize_fp4(qw).to(torch.float32)
    elapsed = time.perf_counter() - start
    if dump is not None:
        _write_dump(dump, dumped)
    mb = totals.source_bytes / 1e6
    print(f"moet quantize: {totals.tensors} routed-expert tensors, {totals.weights:,} weights ({ckpt.architecture}, {ckpt.quant}) from {ckpt.root}")
    print(f"  source      {mb:12.3f} MB  {totals.bits(totals.source_bytes):6.3f} bits/weight")
    print(f"  2-bit base  {totals.base_bytes / 1e6:12.3f} MB  {totals.bits(totals.base_bytes):6.3f} bits/weight")
    if tier != Tier.NONE:
        print(f"  FP4 tier ({tier}) {totals.tier_bytes / 1e6:8.3f} MB  {totals.bits(totals.tier_bytes):6.3f} bits/weight")
    print(f"  time {elapsed:.2f} s, {mb / elapsed if elapsed > 0 else 0.0:.1f} MB/s of source")
    if dump is not None:
        print(f"  wrote {len(dumped)} tensors to {dump}")
    if args.store is not None:
        from moet.store.build import write_pack_from_checkpoint
        from moet.store.pack import sidecar_path

        start = time.perf_counter()
        sidecar = sidecar_path(args.store, 0)
        before = _file_version(sidecar)
        with write_pack_from_checkpoint(args.model_dir, args.store, rank=0, tier=requested) as pack:
            size = pack.path.stat().st_size
            # Every layer written replaces the sidecar (the pack's commit record): unchanged means reused.
            how = "reused (complete and current)" if before is not None and _file_version(sidecar) == before else "written"
            print(f"  pack {pack.path} {how}: {pack.layers} layers x {pack.experts} experts, {size / 1e6:.3f} MB, "
                  f"{time.perf_counter() - start:.2f} s")
    return 0


def _file_version(path: Path) -> tuple[int, int, int] | None:
    """(inode, mtime, size) of a file, None when it does not exist: tells a replaced file from the same one."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size
