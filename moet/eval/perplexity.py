"""Held-out perplexity of a checkpoint with its routed experts swapped for other weights.

The quality benchmark compares variants of one model (BF16 master, FP4 source, 2-bit base, …)
that differ only in the routed experts. So a model is loaded from a checkpoint directory with
everything but the experts taken as stored (bf16 attention, router, embeddings), and the experts
taken from a mapping ExpertKey → float [N, K], which `expert_weights` builds from the checkpoint
itself or which a caller builds for a new variant. Scoring runs in float32 with transformers.

    python -m moet.eval.perplexity moet/models/default --variants source,base --tokens 65536
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moet.formats.experts import iter_routed_experts
from moet.formats.checkpoint import open_checkpoint
from moet.formats.source import ExpertKey
from moet.quant.codebook import Tier, dequantize_base, dequantize_fp4
from moet.quant.requant import requantize

SEQ_LEN = 512
VARIANTS = ("source", "fp4", "base")
ExpertWeights = Mapping[ExpertKey, torch.Tensor]


def expert_weights(model_dir: str | Path, variant: str = "source") -> dict[ExpertKey, torch.Tensor]:
    """Routed-expert matrices of a checkpoint as float32 [N, K], per variant.

    source: the stored values (NVFP4/MXFP4 decoded, BF16 as is); fp4: the FP4 tier (the source for
    FP4 checkpoints, the reference rule for float ones); base: the sign-symmetric 2-bit base.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; one of {VARIANTS}")
    out: dict[ExpertKey, torch.Tensor] = {}
    for src in iter_routed_experts(model_dir):
        if variant == "source" and src.kind == "float":
            out[src.key] = src.data.to(torch.float32)
        elif variant == "base":
            out[src.key] = dequantize_base(requantize(src)).to(torch.float32)
        else:
            out[src.key] = dequantize_fp4(requantize(src, Tier.PLANES)).to(torch.float32)
    return out


def set_expert_weights(model: torch.nn.Module, experts: ExpertWeights) -> None:
    """Copy every routed expert of `model` from `experts` (all must be present)."""
    layers = model.model.layers
    cfg = model.config
    n_experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    missing = [
        (layer, e, p)
        for layer in range(len(layers))
        for e in range(n_experts)
        for p in ("gate", "up", "down")
        if ExpertKey(layer, e, p) not in experts
    ]
    if missing:
        raise KeyError(f"{len(missing)} expert matrices missing, first (layer, expert, proj) = {missing[0]}")
    with torch.no_grad():
        for layer, block in enumerate(layers):
            mod = block.mlp.experts
            for e in range(n_experts):
                gate, up, down = (experts[ExpertKey(layer, e, p)] for p in ("gate", "up", "down"))
                if hasattr(mod, "gate_up_proj"):  # fused [E, 2I, H], gate rows first
                    mod.gate_up_proj[e].copy_(torch.cat([gate, up]))
                    mod.down_proj[e].copy_(down)
                else:
                    mod[e].gate_proj.weight.copy_(gate)
                    mod[e].up_proj.weight.copy_(up)
                    mod[e].down_proj.weight.copy_(down)


def load_model(
    model_dir: str | Path,
    experts: ExpertWeights | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    experts_implementation: str | None = None,
) -> torch.nn.Module:
    """A transformers causal LM of `model_dir` with its non-expert tensors as stored and `experts`
    (default: the checkpoint's own experts, decoded) in the routed-expert slots.

    `experts_implementation` defaults to transformers' "grouped_mm" on CPU (20× faster than the
    per-expert loop there, same perplexity to 1e-6) and "eager" elsewhere: grouped GEMM on CUDA
    wants bf16, and scoring runs in float32."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    ckpt = open_checkpoint(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # experts arrive decoded; the rest of the checkpoint is float
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    if experts_implementation is None:
        experts_implementation = "grouped_mm" if torch.device(device).type == "cpu" else "eager"
    model.config._experts_implementation = experts_implementation
    state: dict[str, torch.Tensor] = {}
    for path in ckpt.shards:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if ckpt.scheme.match_per_expert(name) is None:
                    state[name] = f.get_tensor(name).to(dtype)
    result = model.load_state_dict(state, strict=False)
    not_experts = [k for k in result.missing_keys if ".experts." not in k]
    if not_experts or result.unexpected_keys:
        raise KeyError(f"{model_dir}: missing {not_experts[:3]}, unexpected {result.unexpected_keys[:3]}")
    set_expert_weights(model, experts if experts is not None else expert_weights(model_dir, "source"))
    return model.to(device).eval()


def heldout_windows(ids: np.ndarray | torch.Tensor, n_tokens: int = 65536, seq_len: int = SEQ_LEN) -> torch.Tensor:
    """Non-overlapping windows of seq_len + 1 ids, evenly spaced over the stream, scoring ~n_tokens."""
    ids = torch.as_tensor(np.asarray(ids, dtype=np.int64))
    span = seq_len + 1
    total = ids.numel() // span
    n = max(1, min(total, math.ceil(n_tokens / seq_len)))
    starts = (torch.arange(n) * total // n) * span
    return ids[starts.unsqueeze(1) + torch.arange(span)]


def heldout_ids(model_dir: str | Path, tokens_npy: str | Path | None = None) -> np.ndarray:
    """The held-out token stream: from a .npy written by moet.models.data, else by tokenizing this
    interpreter's held-out standard-library files with the model's tokenizer (same split)."""
    if tokens_npy is not None:
        return np.load(tokens_npy)
    from tokenizers import Tokenizer

    from moet.models.data import encode_stream, read_text, split_files, stdlib_files

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    return encode_stream(tok, [read_text(f) for f in split_files(stdlib_files())[1]])


@torch.no_grad()
def iter_logprobs(model: torch.nn.Module, windows: torch.Tensor, batch: int = 8) -> Iterator[torch.Tensor]:
    """Per batch of windows, float32 log-softmax over the vocabulary [b, seq_len, V] (for KL etc.)."""
    device = next(model.parameters()).device
    for i in range(0, windows.shape[0], batch):
        logits = model(input_ids=windows[i : i + batch, :-1].to(device)).logits
        yield torch.log_softmax(logits.float(), dim=-1)


@dataclass
class Score:
    """Per-token results over the windows: log p(target) and the argmax token, both [n, seq_len]."""

    logprobs: torch.Tensor
    top1: torch.Tensor

    @property
    def perplexity(self) -> float:
        return math.exp(-float(self.logprobs.double().mean()))


def score(model: torch.nn.Module, windows: torch.Tensor, batch: int = 8) -> Score:
    """Teacher-forced scoring of the windows' next tokens."""
    lps, tops = [], []
    for i, lp in enumerate(iter_logprobs(model, windows, batch)):
        targets = windows[i * batch : (i + 1) * batch, 1:].to(lp.device)
        lps.append(lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).cpu())
        tops.append(lp.argmax(-1).cpu())
    return Score(torch.cat(lps), torch.cat(tops))


def evaluate(
    model_dir: str | Path,
    variants: list[str],
    windows: torch.Tensor,
    device: str = "cpu",
    batch: int = 8,
) -> dict[str, dict[str, float]]:
    """Perplexity of each expert variant of one checkpoint, and top-1 agreement with the first."""
    results: dict[str, dict[str, float]] = {}
    reference: Score | None = None
    for variant in variants:
        t0 = time.perf_counter()
        model = load_model(model_dir, expert_weights(model_dir, variant), device=device)
        s = score(model, windows, batch)
        del model
        entry = {"perplexity": round(s.perplexity, 4), "seconds": round(time.perf_counter() - t0, 1)}
        if reference is None:
            reference = s
        else:
            entry["top1_agreement_with_" + variants[0]] = round(float((s.top1 == reference.top1).double().mean()), 4)
        results[variant] = entry
        print(f"{model_dir} [{variant}]: {entry}", flush=True)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--variants", default="source,base", help=f"comma-separated, of {VARIANTS}")
    parser.add_argument("--heldout", type=Path, default=None, help="uint16 .npy of held-out ids (else re-tokenized)")
    parser.add_argument("--tokens", type=int, default=65536, help="held-out tokens scored")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    windows = heldout_windows(heldout_ids(args.model_dir, args.heldout), args.tokens)
    results = {
        "model_dir": str(args.model_dir),
        "tokens_scored": int(windows[:, 1:].numel()),
        "seq_len": SEQ_LEN,
        "dtype": "float32",
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "variants": evaluate(args.model_dir, args.variants.split(","), windows, args.device, args.batch),
    }
    text = json.dumps(results, indent=2) + "\n"
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
