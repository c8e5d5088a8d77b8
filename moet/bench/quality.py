"""Quality of the 2-bit path, the FP4 pool and the confidence gate on the embedded default model.

Every variant differs from the source only in its routed experts and is scored on the same
held-out positions (windows of --seq-len + 1 tokens; positions from --prefill − 1 on, so that the
gate's decode steps and the batch-scored variants cover the same tokens):

- fixed weights (batch teacher forcing): BF16 master (when a copy is available), the NVFP4 source,
  the sign-symmetric 2-bit base, the best-asymmetric 2-bit ablation, the same two in the first N
  layers only (depth), 2-bit + a static FP4 pool of several sizes whose hot set comes from
  routing counts on a calibration slice of the training text, and the 2-bit base with its experts'
  inputs in e4m3 (one or two terms per 32-k block: the FP8-activation path of the sm_120a kernels; and
  one scale per token with weights in e4m3 per row: what an FP8 wgmma on sm_90 allows, `base_fp8token`);
- 2-bit + gate at fixed τ and at fire budgets (stepwise teacher-forced decode on a KV cache with
  the real gate driver, re-running fired steps);
- real greedy decode with the gate at several budgets, the source and the base stepped on the
  same tokens: the share of the base's top-1 disagreements with the source that the gate recovers.

Per variant: perplexity, KL(source ‖ variant) per token, top-1 agreement with the source, mean
signed weight bias, gate fire rate, decode tokens/s of this harness (float32 transformers on CPU:
it measures re-run cost, not kernel speed) and routed-expert bytes read per token (the pool's and
the gate's price; the x axis of the PNG). JSON and PNG go to bench/results/quality-*.
"""

from __future__ import annotations

import argparse
import math
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "models" / "default"
DATA_DIR = Path(".cache/default_model")
GPU_REFERENCE = "bench/results/default_model_perplexity_gpu-20261203.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="checkpoint directory (default: the embedded model)")
    parser.add_argument("--heldout", type=Path, default=DATA_DIR / "heldout.npy", help="held-out ids (.npy); re-tokenized if missing")
    parser.add_argument("--calibration", type=Path, default=DATA_DIR / "train.npy", help="ids (.npy) whose routing picks the static hot set")
    parser.add_argument("--master", type=Path, default=DATA_DIR / "master", help="BF16 master checkpoint, scored when present")
    parser.add_argument("--windows", type=int, default=8, help="held-out windows")
    parser.add_argument("--seq-len", type=int, default=192)
    parser.add_argument("--prefill", type=int, default=32, help="prompt tokens of each window before the scored positions")
    parser.add_argument("--pool-fractions", default="0.125,0.25,0.5,1.0", help="static pool sizes as shares of all experts")
    parser.add_argument("--depths", default="2,4,8", help="first-N-layers ablation depths (all layers are the full variants)")
    parser.add_argument("--mx-terms", default="1,2", help="e4m3 activation terms of the FP8-activation variants (empty: none)")
    parser.add_argument("--taus", default="0.4,0.6,0.8", help="fixed gate thresholds")
    parser.add_argument("--budgets", default="0.10,0.25", help="gate fire budgets (budget:F)")
    parser.add_argument("--gate-slots", type=int, default=0, help="pool slots of the gate variants (0: layers × top-k, one step's experts)")
    parser.add_argument("--recovery-budgets", default="0.05,0.10,0.25,0.40", help="fire budgets of the real-decode recovery curve")
    parser.add_argument("--recovery-slots", default="", help="pool sizes of the recovery curves (default: --gate-slots and twice it)")
    parser.add_argument("--prompts", type=int, default=8, help="real-decode prompts")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per prompt")
    parser.add_argument("--speed-steps", type=int, default=48, help="decode steps timed for each fixed-weight variant")
    parser.add_argument("--fp4-tier", choices=("refine", "planes"), default="refine", help="how a promoted expert is read (bytes)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the box is shared)")
    parser.add_argument("--out-dir", type=Path, default=None)


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _expert_bytes(model_dir: Path) -> dict[str, float]:
    """Bytes that one routed (token, expert) pair reads per variant, from the first expert's tensors."""
    from moet.formats.experts import iter_routed_experts
    from moet.quant.codebook import Tier
    from moet.quant.requant import requantize

    sizes = {"weights": 0, "base": 0, "refine": 0, "planes": 0, "source": 0}
    for src in iter_routed_experts(model_dir):
        if (src.key.layer, src.key.expert) != (0, 0):
            break
        n, k = src.data.shape[0], src.data.shape[1] * (2 if src.kind in ("nvfp4", "mxfp4") else 1)
        refine, planes = requantize(src, Tier.REFINE), requantize(src, Tier.PLANES)
        sizes["weights"] += n * k
        sizes["base"] += refine.base_nbytes()
        sizes["refine"] += refine.base_nbytes() + refine.tier_nbytes()
        sizes["planes"] += planes.tier_nbytes() + planes.scales.numel() + 4 * n
        sizes["source"] += src.data.numel() * src.data.element_size() + (src.scales.numel() if src.scales is not None else 0) + 4
    sizes["bf16"] = 2 * sizes["weights"]
    return sizes


class Bench:
    """Shared state of one run: weights, windows, the source's log-probabilities, settings."""

    def __init__(self, args: argparse.Namespace) -> None:
        from moet.eval.perplexity import expert_weights, heldout_ids, heldout_windows, iter_logprobs, load_model
        from moet.eval.variants import asymmetric_weights

        self.args = args
        self.model_dir = args.model
        t0 = time.perf_counter()
        self.source = expert_weights(self.model_dir, "source")
        self.fp4 = expert_weights(self.model_dir, "fp4")
        self.base = expert_weights(self.model_dir, "base")
        self.asym = asymmetric_weights(self.model_dir)
        print(f"quality: expert variants built in {time.perf_counter() - t0:.0f} s", flush=True)
        ids = heldout_ids(self.model_dir, args.heldout if args.heldout.exists() else None)
        self.ids = ids
        self.windows = heldout_windows(ids, args.windows * args.seq_len, args.seq_len)[: args.windows]
        self.targets = self.windows[:, args.prefill :]
        model = load_model(self.model_dir, self.source)
        config = model.config
        self.layers = config.num_hidden_layers
        self.experts = getattr(config, "num_experts", None) or config.num_local_experts
        self.top_k = config.num_experts_per_tok
        self.source_lp = torch.cat(list(iter_logprobs(model, self.windows)))
        del model
        self.sizes = _expert_bytes(self.model_dir)

    def traffic(self, base_pairs: int, fp4_pairs: int, tokens: int, bytes_per_pair: float) -> dict[str, float]:
        """Routed-expert bytes per token (FP4 pairs read as --fp4-tier, and as the other tier) and the FP4 share."""
        other = "planes" if self.args.fp4_tier == "refine" else "refine"
        return {
            "expert_bytes_per_token": round((base_pairs * bytes_per_pair + fp4_pairs * self.sizes[self.args.fp4_tier]) / tokens),
            f"expert_bytes_per_token_{other}": round((base_pairs * bytes_per_pair + fp4_pairs * self.sizes[other]) / tokens),
            "fp4_share_of_routed": round(fp4_pairs / (base_pairs + fp4_pairs), 4),
        }

    def scored(self, logprobs: torch.Tensor) -> torch.Tensor:
        return logprobs[:, self.args.prefill - 1 :]

    def metrics(self, logprobs: torch.Tensor) -> dict[str, Any]:
        from moet.eval.compare import compare

        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in compare(logprobs, self.scored(self.source_lp), self.targets).items()}


def _fixed(bench: Bench, name: str, weights, bytes_per_pair: float, model_dir: Path | None = None, pool=None,
           fp8: Callable[[torch.nn.Module], None] | None = None) -> dict[str, Any]:
    """Batch-scored variant with fixed weights (or 2-bit + a committed static pool; or, with `fp8`, the experts
    computing as an FP8 path would: moet.eval.variants.mx_activation_experts or token_fp8_experts)."""
    from moet.eval.decode import ExpertSwitch, GatedDecoder, split_pairs, stepwise_logprobs
    from moet.eval.perplexity import iter_logprobs, load_model
    from moet.eval.variants import weight_bias

    t0 = time.perf_counter()
    model = load_model(model_dir or bench.model_dir, weights)
    switch = ExpertSwitch(model, weights, bench.fp4 if pool is not None else None)
    if fp8 is not None:  # after the switch, which writes the weights into the model (a rounding before it was lost)
        fp8(model)
    effective = weights
    if pool is not None:
        switch.apply(pool.commit())
        table = pool.use_fp4
        effective = {key: (bench.fp4[key] if table[key.layer, key.expert] else weights[key]) for key in weights}
    lp = torch.cat(list(iter_logprobs(model, bench.windows)))
    base_pairs, fp4_pairs = split_pairs(switch.take_routed(), pool.use_fp4 if pool is not None else None)
    entry = bench.metrics(bench.scored(lp))
    entry.update({k: round(v, 6) for k, v in weight_bias(effective, bench.source).items()})
    entry.update(bench.traffic(base_pairs, fp4_pairs, bench.windows.shape[0] * bench.args.seq_len, bytes_per_pair))
    if pool is not None:
        entry["pool_slots"] = pool.slots
        entry["pool_resident"] = int(pool.use_fp4.sum())
        entry["logits_equal_source"] = bool(torch.equal(lp, bench.source_lp))
    steps = bench.args.speed_steps
    decoder = GatedDecoder(model, switch, pool)
    stepwise_logprobs(decoder, bench.windows[:1, : bench.args.prefill + steps + 1], bench.args.prefill)
    entry["decode_tokens_per_s"] = round(steps / decoder.stats.seconds, 2)
    entry["seconds"] = round(time.perf_counter() - t0, 1)
    print(f"quality [{name}]: {entry}", flush=True)
    return entry


def _gated(bench: Bench, spec: str, slots: int) -> dict[str, Any]:
    """2-bit + gate (τ spec) over a pool of `slots`, stepwise teacher-forced decode."""
    from moet.eval.decode import ExpertSwitch, GatedDecoder, stepwise_logprobs
    from moet.eval.perplexity import load_model
    from moet.eval.variants import weight_bias
    from moet.tier.gate import Gate
    from moet.tier.pool import FP4Pool

    t0 = time.perf_counter()
    model = load_model(bench.model_dir, bench.base)
    gate = Gate(spec)
    decoder = GatedDecoder(model, ExpertSwitch(model, bench.base, bench.fp4), FP4Pool(bench.layers, bench.experts, slots), gate)
    lp, fired = stepwise_logprobs(decoder, bench.windows, bench.args.prefill)
    entry = bench.metrics(lp)
    entry.update({k: round(v, 6) for k, v in weight_bias(bench.base, bench.source).items()})
    stats = decoder.stats
    entry.update(
        {
            "fire_rate": round(sum(fired) / len(fired), 4),
            **bench.traffic(stats.base_pairs, stats.fp4_pairs, stats.steps, bench.sizes["base"]),
            "forwards_per_step": round(stats.forwards / stats.steps, 4),
            "decode_tokens_per_s": round(stats.steps / stats.seconds, 2),
            "pool_slots": slots,
            "gate": gate.counters(),
            "seconds": round(time.perf_counter() - t0, 1),
        }
    )
    print(f"quality [gate {spec}]: {entry}", flush=True)
    return entry


def _calibrated_heat(bench: Bench) -> torch.Tensor:
    """Routed-token counts [layers, experts] of the 2-bit model over the calibration slice."""
    from moet.eval.decode import ExpertSwitch
    from moet.eval.perplexity import heldout_windows, iter_logprobs, load_model

    if not bench.args.calibration.exists():
        raise SystemExit(f"{bench.args.calibration}: no calibration ids; write them with python -m moet.models.data --out {DATA_DIR}")
    ids = np.load(bench.args.calibration)
    model = load_model(bench.model_dir, bench.base)
    switch = ExpertSwitch(model, bench.base)
    for _ in iter_logprobs(model, heldout_windows(ids, bench.args.windows * bench.args.seq_len, bench.args.seq_len)):
        pass
    return switch.take_routed()


def _ideal_coverage(bench: Bench, fractions: list[float]) -> dict[str, float]:
    """The teacher-forced bound for a gate on the 2-bit base at these fire fractions (moet.eval.compare)."""
    from moet.eval.compare import ideal_gate_coverage
    from moet.eval.perplexity import iter_logprobs, load_model

    lp = torch.cat(list(iter_logprobs(load_model(bench.model_dir, bench.base), bench.windows)))
    return ideal_gate_coverage(bench.scored(lp), bench.scored(bench.source_lp), fractions)


def _recovery(bench: Bench, budgets: list[float], sizes: list[int]) -> list[dict[str, Any]]:
    from moet.eval.decode import ExpertSwitch, GatedDecoder, greedy_recovery
    from moet.eval.perplexity import heldout_windows, load_model
    from moet.tier.gate import Gate
    from moet.tier.pool import FP4Pool

    args = bench.args
    prompts = heldout_windows(bench.ids[args.seq_len // 2 :], args.prompts * args.prompt_len, args.prompt_len)[: args.prompts, : args.prompt_len]

    def plain(weights) -> GatedDecoder:
        model = load_model(bench.model_dir, weights)
        return GatedDecoder(model, ExpertSwitch(model, weights))

    source, base = plain(bench.source), plain(bench.base)
    curve = []
    for slots, budget in ((s, b) for s in sizes for b in budgets):
        t0 = time.perf_counter()
        model = load_model(bench.model_dir, bench.base)
        gate = Gate(f"budget:{budget}")
        gated = GatedDecoder(model, ExpertSwitch(model, bench.base, bench.fp4), FP4Pool(bench.layers, bench.experts, slots), gate)
        r = greedy_recovery(gated, source, base, prompts, args.new_tokens)
        point = {
            "pool_slots": slots,
            "budget": budget,
            "fire_rate": round(r.fired / r.steps, 4),
            "tau_final": round(gate.tau, 4),
            "steps": r.steps,
            "base_disagreements": r.base_disagreements,
            "base_disagreement_rate": round(r.base_disagreements / r.steps, 4),
            "recovered": r.recovered,
            "recovery": round(r.recovery, 4),
            "gated_disagreement_rate": round(r.gated_disagreements / r.steps, 4),
            "seconds": round(time.perf_counter() - t0, 1),
        }
        print(f"quality [recovery {slots} slots, budget:{budget}]: {point}", flush=True)
        curve.append(point)
    return curve


def _plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = {k: v for k, v in results["variants"].items() if "kl_per_token" in v}
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    for ax, metric, label in ((axes[0], "kl_per_token", "KL(source ‖ variant), nats/token"), (axes[1], "top1_agreement", "top-1 agreement with source")):
        for name, v in variants.items():
            color = "tab:red" if name.startswith("gate") else "tab:green" if name.startswith("pool") else "tab:purple" if "asym" in name else "tab:blue"
            ax.scatter(v["expert_bytes_per_token"] / 1e6, v[metric], color=color, s=22)
            ax.annotate(name, (v["expert_bytes_per_token"] / 1e6, v[metric]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("routed-expert MB read per token (incl. gate re-runs)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("symlog", linthresh=1e-3)
    for slots in sorted({p["pool_slots"] for p in results["recovery_curve"]}):
        curve = [p for p in results["recovery_curve"] if p["pool_slots"] == slots]
        axes[2].plot([p["fire_rate"] for p in curve], [p["recovery"] for p in curve], "o-", label=f"gate + pool of {slots} experts")
    coverage = results["ideal_gate_coverage_teacher_forced"]
    axes[2].plot([float(f) for f in coverage], list(coverage.values()), "s--", color="gray", label="ideal gate bound (teacher-forced)")
    axes[2].legend(fontsize=8)
    axes[2].axhline(0.6, color="gray", ls="--", lw=0.8)
    axes[2].set_xlabel("gate fire rate (real greedy decode)")
    axes[2].set_ylabel("share of 2-bit top-1 disagreements recovered")
    axes[2].set_xlim(0, 1)
    axes[2].set_ylim(0, 1)
    axes[2].grid(alpha=0.3)
    fig.suptitle(f"{results['model']}: quality vs bytes read (held-out, {results['scored_tokens']} tokens)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> None:
    from moet.bench._record import write_results
    from moet.eval.variants import first_layers, mx_activation_experts, token_fp8_experts
    from moet.tier.pool import FP4Pool

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    bench = Bench(args)
    sizes = bench.sizes
    gate_slots = args.gate_slots or bench.layers * bench.top_k
    variants: dict[str, Any] = {}
    if (args.master / "config.json").exists():
        from moet.eval.perplexity import expert_weights

        variants["bf16_master"] = _fixed(bench, "bf16_master", expert_weights(args.master, "source"), sizes["bf16"], model_dir=args.master)
    variants["source"] = _fixed(bench, "source", bench.source, sizes["source"])
    variants["base_sym"] = _fixed(bench, "base_sym", bench.base, sizes["base"])
    variants["base_asym"] = _fixed(bench, "base_asym", bench.asym, sizes["base"])
    for terms in (int(t) for t in _floats(args.mx_terms)):
        variants[f"base_fp8act{terms}"] = _fixed(bench, f"base_fp8act{terms}", bench.base, sizes["base"],
                                                 fp8=partial(mx_activation_experts, terms=terms))
    variants["base_fp8token"] = _fixed(bench, "base_fp8token", bench.base, sizes["base"], fp8=token_fp8_experts)
    variants["base_fp8prefill"] = _fixed(bench, "base_fp8prefill", bench.base, sizes["base"],
                                         fp8=partial(token_fp8_experts, round_weights=False))
    depth: dict[str, Any] = {}
    for n in [int(d) for d in _floats(args.depths)] + [bench.layers]:
        depth[str(n)] = {}
        for name, quant in (("sym", bench.base), ("asym", bench.asym)):
            if n == bench.layers:
                entry = variants[f"base_{name}"]
            else:
                entry = _fixed(bench, f"{name}_first{n}", first_layers(quant, bench.source, n), sizes["base"])
            depth[str(n)][name] = {k: entry[k] for k in ("perplexity", "kl_per_token", "top1_agreement", "mean_signed_bias", "mean_abs_bias")}
    heat = _calibrated_heat(bench)
    for fraction in _floats(args.pool_fractions):
        pool = FP4Pool(bench.layers, bench.experts, round(fraction * bench.layers * bench.experts), decay=1.0)
        pool.record(heat)
        pool.propose()
        variants[f"pool_{fraction:g}"] = _fixed(bench, f"pool_{fraction:g}", bench.base, sizes["base"], pool=pool)
    for spec in [f"{t:g}" for t in _floats(args.taus)] + [f"budget:{b:g}" for b in _floats(args.budgets)]:
        variants[f"gate_{spec}"] = _gated(bench, spec, gate_slots)
    recovery_slots = [int(x) for x in _floats(args.recovery_slots)] or [gate_slots, 2 * gate_slots]
    curve = _recovery(bench, _floats(args.recovery_budgets), recovery_slots)
    results: dict[str, Any] = {
        "model": str(args.model),
        "scored_tokens": int(bench.targets.numel()),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"},
        "bytes_per_expert": sizes,
        "gate_pool_slots": gate_slots,
        "fp4_equals_source": all(torch.equal(bench.fp4[k], bench.source[k]) for k in bench.source),
        "variants": variants,
        "depth": depth,
        "recovery_curve": curve,
        "ideal_gate_coverage_teacher_forced": _ideal_coverage(bench, _floats(args.recovery_budgets)),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if "bf16_master" not in variants:
        results["bf16_master"] = f"not available locally ({args.master} has no checkpoint); the master's GPU perplexities: {GPU_REFERENCE}"
    path = write_results("quality", results, args.out_dir)
    _plot(results, path.with_suffix(".png"))
    print(f"moet bench: wrote {path.with_suffix('.png')}")
    for p in curve:
        if p["budget"] == 0.25 and not math.isnan(p["recovery"]):
            print(f"quality: pool of {p['pool_slots']}, fire rate {p['fire_rate']:.2f}: the gate recovered {p['recovery']:.0%} of the base's disagreements")
