"""`moet inspect MODEL_DIR`: the codebook sweep (moet.quant.sweep) over a checkpoint's routed experts and its PASS/FAIL verdict."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moet.quant.sweep import SweepReport


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("inspect", help="codebook sweep: bias and RMS of {-4,-1,+1,+4} vs the best asymmetric set, PASS/FAIL")
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="HF checkpoint directory")
    parser.add_argument("--json", action="store_true", help="print the summary and every tensor's figures as JSON")
    parser.add_argument("--per-tensor", action="store_true", help="also print one line per tensor")
    parser.set_defaults(func=run)


def sweep_checkpoint(model_dir: str | Path, progress: bool = False) -> SweepReport:
    """Sweep every routed-expert tensor of a checkpoint (streamed, one tensor in memory at a time)."""
    from tqdm import tqdm

    from moet.formats.experts import RoutedExperts
    from moet.quant.codebook import Tier
    from moet.quant.requant import requantize
    from moet.quant.sweep import SweepReport, sweep_tensor

    report = SweepReport()
    with RoutedExperts(model_dir) as experts:
        for src in tqdm(experts, total=len(experts), unit="tensor", desc="sweep", disable=None if progress else True, leave=False):
            result = sweep_tensor(src.name, requantize(src, Tier.PLANES))
            if result is None:
                report.skipped += 1
            else:
                report.tensors.append(result)
    return report


def run(args: argparse.Namespace) -> int:
    report = sweep_checkpoint(args.model_dir, progress=not args.json)
    summary = report.summary()
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
        return 0
    if args.per_tensor:
        print(f"{'tensor':60s} {'bias sym':>10s} {'bias asym':>10s} {'rms sym':>8s} {'rms asym':>8s}  asymmetric levels")
        for t in report.tensors:
            levels = " ".join(f"{v:+.2f}" for v in t.levels_asym)
            print(f"{t.name:60s} {t.bias_sym:+10.5f} {t.bias_asym:+10.5f} {t.rel_rms_sym:8.4f} {t.rel_rms_asym:8.4f}  {levels}")
    print(f"moet inspect: {summary['tensors']} routed-expert tensors ({summary['skipped']} all-zero skipped) in {args.model_dir}")
    if summary["tensors"]:
        print(f"  mean |bias|  symmetric {summary['mean_abs_bias_sym']:.5f}  asymmetric {summary['mean_abs_bias_asym']:.5f}  (ratio {summary['bias_ratio']:.1f}x)")
        print(f"  mean rel RMS symmetric {summary['mean_rel_rms_sym']:.4f}  asymmetric {summary['mean_rel_rms_asym']:.4f}  (L2 penalty {summary['l2_penalty']:+.1%}; unconstrained optimum {summary['mean_rel_rms_lloyd']:.4f})")
        print(f"  symmetric best (|bias|) on {summary['symmetric_best_share']:.1%} of tensors")
        for check, ok in summary["checks"].items():
            print(f"  [{'ok' if ok else 'FAIL'}] {check}")
    print(f"verdict: {'PASS' if summary['pass'] else 'FAIL'}")
    return 0
