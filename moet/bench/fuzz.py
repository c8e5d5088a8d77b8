"""Fuzz the readers of untrusted files: safetensors headers, checkpoint indexes and the model list.

A checkpoint downloaded from the hub and a models.yaml edited by hand are inputs moet does not
control. Each may only ever fail with moet's own error (CheckpointError, ConfigError: a one-line
message naming the file), never with another exception, a hang, or an allocation of whatever size
the file claims. The properties are defined once in moet.bench._fuzzing: the test suite runs them for seconds
(tests/test_fuzz.py), `moet bench fuzz` for longer and records what it ran.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--examples", type=int, default=20000, help="examples per target (default 20000)")
    parser.add_argument("--targets", default="safetensors,index,yaml", help="comma-separated subset of safetensors, index, yaml (default: all)")
    parser.add_argument("--out", type=Path, default=None, help="results directory (default bench/results)")


def run(args: argparse.Namespace) -> int:
    from hypothesis import HealthCheck, settings

    from moet.bench._fuzzing import ALLOC_LIMIT_BYTES, property_for
    from moet.bench._record import write_results

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="moet-fuzz-") as tmp:
        for target in args.targets.split(","):
            config = settings(max_examples=args.examples, deadline=None, database=None,
                              suppress_health_check=list(HealthCheck))
            start = time.monotonic()
            try:
                config(property_for(target, Path(tmp)))()
                outcome = "passed"
            except Exception as exc:  # the falsifying example is the result
                outcome = f"FAILED: {type(exc).__name__}: {str(exc)[:500]}"
            results[target] = {"examples": args.examples, "seconds": round(time.monotonic() - start, 1), "outcome": outcome}
            print(f"fuzz {target}: {results[target]}", flush=True)
    write_results("fuzz", {"alloc_limit_bytes": ALLOC_LIMIT_BYTES, "targets": results}, args.out)
    return 0 if all(r["outcome"] == "passed" for r in results.values()) else 1
