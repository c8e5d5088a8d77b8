"""Where and how benchmarks record results: JSON with the machine, the date and the command."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(os.environ.get("MOET_BENCH_DIR", "bench/results"))


def machine() -> dict[str, Any]:
    """The machine a figure was measured on (CPU model and count, GPU name if any)."""
    info: dict[str, Any] = {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        info["cpu"] = platform.processor()
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    return info


def write_results(name: str, results: dict[str, Any], out_dir: Path | None = None) -> Path:
    """Write results to <out_dir>/<name>-<UTC timestamp>.json (atomically) and return the path."""
    out_dir = RESULTS_DIR if out_dir is None else out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.timezone.utc)
    record = {
        "benchmark": name,
        "date": now.isoformat(timespec="seconds"),
        "command": shlex.join(["moet", *sys.argv[1:]]) if sys.argv else "",
        "machine": machine(),
        **results,
    }
    path = out_dir / f"{name}-{now.strftime('%Y%m%dT%H%M%SZ')}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(path)
    print(f"moet bench: wrote {path}")
    return path
