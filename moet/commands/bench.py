"""`moet bench NAME`: benchmarks that print and record JSON under bench/results/ (never timed tests)."""

from __future__ import annotations

import argparse
import importlib
import pkgutil

import moet.bench


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("bench", help="run a benchmark and record JSON (+ PNG) under bench/results/")
    benches = parser.add_subparsers(dest="bench", metavar="NAME", required=True)
    for info in sorted(pkgutil.iter_modules(moet.bench.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"moet.bench.{info.name}")
        child = benches.add_parser(info.name, help=(module.__doc__ or "").strip().splitlines()[0])
        module.add_arguments(child)
        child.set_defaults(func=module.run)
