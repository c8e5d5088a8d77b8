"""Plain reads in the decode kernels' access pattern against one dense front of reads (a device-visit tool).

    python3 scripts/read_pattern.py --build          # here: nvcc scripts/read_pattern.cu → moet/kernels/cubins/sm_90a
    python3 scripts/read_pattern.py --out $OUT       # there: the sweep, printed and written as read-pattern-<time>.json

The question (docs/KERNELS.md, "Not done"): at T = 1 the decode's GEMMs run at 1.28-1.42× a plain read of their bytes
while their warps wait on their own loads. Is that the decode's own cost, or does DRAM serve the decode's pattern
(~3,000 warps, each streaming its own 4-8 KB through a ring of 512 B chunks) slower than the bench's read kernel (a
grid-stride front over contiguous memory)? Each case reads the same bytes, rotating through 8 buffers (> L2) in a
CUDA graph as `moet bench kernels` does; see scripts/read_pattern.cu for GROUP, RING and WORK.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
CUBIN = ROOT / "moet" / "kernels" / "cubins" / "sm_90a" / "read_pattern.cubin"
CHUNK = 512  # bytes a warp reads per chunk
BUFFERS = 8
# (label, warps, chunks per warp): DeepSeek-V4-Flash T = 1 with the pick's K split over two warps (w13: 6 experts ×
# 256 row blocks × 2, 16 chunks each; w2: 8 each), the same bytes with longer streams, and Kimi-K2's w13 (8 experts).
SHAPES = (("w13-ds", 3072, 16), ("w2-ds", 3072, 8), ("w13-ds-k1", 1536, 32), ("w13-ds-768w", 768, 64),
          ("w13-kimi", 4096, 28))
GROUPS = (1, 2, 4, 16, 64, 512, 0)  # 0: every warp (a dense front)
KERNELS = ("read_ring_r2_w0", "read_ring_r4_w0", "read_ring_r8_w0", "read_ring_r4_w120", "read_ring_r8_w120")


def build(cubin: Path = CUBIN) -> None:
    cubin.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["nvcc", "-cubin", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "-o", str(cubin),
                    str(ROOT / "scripts" / "read_pattern.cu")], check=True)
    print(f"built {cubin}")


def sweep(out_dir: Path) -> None:
    import torch

    from moet.bench.kernels import _graph_us, _read
    from moet.kernels.cuda import _check, _driver

    torch.empty(1, device="cuda")
    module = ctypes.c_void_p()
    _check(_driver().cuModuleLoadData(ctypes.byref(module), CUBIN.read_bytes()), f"loading {CUBIN}")
    functions = {}
    for name in KERNELS:
        functions[name] = ctypes.c_void_p()
        _check(_driver().cuModuleGetFunction(ctypes.byref(functions[name]), module, name.encode()), name)
    stream = ctypes.c_void_p()

    def launch(name: str, src: torch.Tensor, sink: torch.Tensor, warps: int, chunks: int, group: int) -> None:
        stream.value = torch.cuda.current_stream().cuda_stream
        args = [ctypes.c_void_p(src.data_ptr()), ctypes.c_void_p(sink.data_ptr()), ctypes.c_int(chunks), ctypes.c_int(group)]
        params = (ctypes.c_void_p * 4)(*[ctypes.addressof(a) for a in args])
        _check(_driver().cuLaunchKernel(functions[name], warps // 4, 1, 1, 128, 1, 1, 0, stream, params, None), name)

    props = torch.cuda.get_device_properties(0)
    device = dict(name=props.name, sms=props.multi_processor_count, date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    copy = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    copy_us = _graph_us([lambda: copy[: 1 << 27].copy_(copy[1 << 27 :])], 20)
    device["copy_gbs"] = 2 * (1 << 27) / copy_us / 1e3
    print(device, flush=True)
    records = []
    for label, warps, chunks in SHAPES:
        nbytes = warps * chunks * CHUNK
        bufs = [torch.randint(0, 1 << 30, (nbytes // 4,), dtype=torch.int32, device="cuda") for _ in range(BUFFERS)]
        sink = torch.zeros(warps, dtype=torch.int32, device="cuda")
        read_sink = torch.zeros(132 * 8, dtype=torch.int32, device="cuda")
        dense = _graph_us([lambda b=b: _read((b,), read_sink) for b in bufs], 5)
        records.append(dict(shape=label, warps=warps, chunks=chunks, bytes=nbytes, kernel="triton_read", group=None,
                            us=dense, gbs=nbytes / dense / 1e3))
        print(f"{label}: {nbytes / 1e6:.1f} MB, bench read kernel {dense:.2f} µs ({nbytes / dense / 1e3:.0f} GB/s)", flush=True)
        for name in KERNELS:
            line = []
            for group in GROUPS:
                g = group or warps
                if warps % g:
                    continue
                us = _graph_us([lambda b=b: launch(name, b, sink, warps, chunks, g) for b in bufs], 5)
                records.append(dict(shape=label, warps=warps, chunks=chunks, bytes=nbytes, kernel=name, group=g, us=us,
                                    gbs=nbytes / us / 1e3, vs_read=us / dense))
                line.append(f"g{g} {us:.2f}")
            print(f"  {name}: " + "  ".join(line), flush=True)
        del bufs
    path = out_dir / f"read-pattern-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    path.write_text(json.dumps(dict(device=device, records=records), indent=1))
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", action="store_true", help="build the cubin with nvcc (here; the visit carries it)")
    parser.add_argument("--out", type=Path, default=Path("."), help="directory for the JSON")
    args = parser.parse_args()
    build() if args.build else sweep(args.out)


if __name__ == "__main__":
    main()
