"""Build and load the CPU MoE kernel (moet/kernels/cpu_src) as a torch op library, moet_cpu.

Built ahead of time (install.sh and the Nix package run `python -m moet.kernels.cpu_build`) with
torch.utils.cpp_extension into the package's cpu_lib/ folder, so serving never compiles or needs
a network. The library's name carries a hash of the sources and the torch version: a stale build
is never loaded, and the PyTorch path (moet.kernels.cpu) is used instead, with one log line.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import tempfile
from functools import cache
from importlib import resources
from pathlib import Path

import torch

logger = logging.getLogger("moet")

SOURCES = ("moe.cpp", "avx512.cpp", "avx2.cpp", "bf16.cpp")
HEADERS = ("rows.h", "rows_body.h", "scale.h")
CFLAGS = ["-O3", "-fopenmp", "-std=c++17"]  # per-ISA code is chosen at run time (rows.h), not by -march


def _source_dir() -> Path:
    return Path(str(resources.files("moet.kernels") / "cpu_src"))


def library_name() -> str:
    """moet_cpu_<hash of sources, flags and torch version>: what this package's sources build to."""
    digest = hashlib.sha256(torch.__version__.encode() + " ".join(CFLAGS).encode())
    for name in SOURCES + HEADERS:
        digest.update((_source_dir() / name).read_bytes())
    return f"moet_cpu_{digest.hexdigest()[:12]}"


def library_dir() -> Path:
    """MOET_CPU_KERNEL_DIR if set, else the package's cpu_lib/ folder (where `build` writes)."""
    if "MOET_CPU_KERNEL_DIR" in os.environ:
        return Path(os.environ["MOET_CPU_KERNEL_DIR"])
    return Path(str(resources.files("moet.kernels"))) / "cpu_lib"


def library_path() -> Path:
    return library_dir() / f"{library_name()}.so"


def build(out_dir: Path | None = None, verbose: bool = False) -> Path:
    """Compile the sources into out_dir (default library_dir()) and return the library's path.

    cpp_extension also loads the fresh build into this process (torch.ops.moet_cpu is then ready).
    """
    from torch.utils import cpp_extension

    out_dir = library_dir() if out_dir is None else out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    name = library_name()
    with tempfile.TemporaryDirectory(prefix="moet-cpu-build-") as tmp:
        cpp_extension.load(
            name=name,
            sources=[str(_source_dir() / s) for s in SOURCES],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=tmp,
            is_python_module=False,
            verbose=verbose,
        )
        target = out_dir / f"{name}.so"
        partial = target.with_suffix(".so.tmp")
        shutil.copyfile(Path(tmp) / f"{name}.so", partial)
        partial.replace(target)
    for stale in out_dir.glob("moet_cpu_*.so"):
        if stale != target:
            stale.unlink()
    return target


@cache
def load() -> bool:
    """Load the built library once; False (logged once) when there is none for these sources."""
    path = library_path()
    if not path.exists():
        logger.warning("moet: CPU MoE kernel not built (%s missing; run python -m moet.kernels.cpu_build); "
                       "using the slower PyTorch path", path)
        return False
    try:
        torch.ops.load_library(str(path))
    except OSError as exc:
        logger.warning("moet: CPU MoE kernel %s did not load (%s); using the slower PyTorch path", path, exc)
        return False
    logger.info("moet: CPU MoE kernel %s (%s)", path.name, torch.ops.moet_cpu.isa("auto"))
    return True


def main() -> int:
    """`python -m moet.kernels.cpu_build`: build, load and say which ISA the kernel will use, in one line."""
    try:
        path = build()
    except Exception as exc:  # noqa: BLE001 — any compiler or loader failure becomes the one-line report
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"moet: CPU MoE kernel build failed ({first}); serving on CPU uses the slower PyTorch path", file=sys.stderr)
        return 1
    print(f"moet: CPU MoE kernel built: {path} ({torch.ops.moet_cpu.isa('auto')} on this CPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
