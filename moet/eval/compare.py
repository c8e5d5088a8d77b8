"""Per-token quality of a variant against the source on the same positions: the benchmark's metrics.

Perplexity says how well a variant predicts the text; KL(source ‖ variant) and top-1 agreement say
how closely it reproduces *the source model*, which is what a quantized serving path owes its
users (a variant may even score a lower perplexity by luck while disagreeing more).
"""

from __future__ import annotations

import math

import torch


def compare(logprobs: torch.Tensor, source: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """logprobs, source: float log-probabilities [..., V] over the same positions; targets [...] ids.

    Returns perplexity of the targets, mean KL(source ‖ variant) in nats per token (float64
    accumulation), and the share of positions whose argmax equals the source's.
    """
    lp = logprobs.double()
    ls = source.double()
    nll = -lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    kl = (ls.exp() * (ls - lp)).sum(-1)
    return {
        "perplexity": math.exp(float(nll.mean())),
        "kl_per_token": float(kl.mean()),
        "top1_agreement": float((logprobs.argmax(-1) == source.argmax(-1)).double().mean()),
        "tokens": int(targets.numel()),
    }


def ideal_gate_coverage(logprobs: torch.Tensor, source: torch.Tensor, fractions: list[float]) -> dict[str, float]:
    """Teacher-forced bound for a gate on `logprobs`' top-1 probability: per fire fraction F, the share
    of positions where the variant's top-1 differs from the source's that lie among the F least
    confident positions — what a gate firing there could recover if a fired step became the source."""
    confidence = logprobs.amax(-1).flatten()
    disagree = (logprobs.argmax(-1) != source.argmax(-1)).flatten()
    total = int(disagree.sum())
    out = {}
    for fraction in fractions:
        fired = confidence <= confidence.quantile(fraction)
        out[f"{fraction:g}"] = int((disagree & fired).sum()) / total if total else float("nan")
    return out
