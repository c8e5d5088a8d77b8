"""gpt-oss served through real vLLM on CPU with 2-bit experts: its fused MXFP4 experts (`*_blocks` /
`*_scales`, gate and up rows interleaved), per-expert biases and the clamped "swigluoai" activation.

The checkpoint is written here in the official layout (transformers' GptOssForCausalLM saved in bf16,
then moet.formats.export.export_mxfp4, with the official `modules_to_not_convert` globs): 4 layers that
alternate sliding-window and full attention with sinks, 8 experts, weights at a trained model's scales
and non-zero biases and sinks. The sliding window is 8 tokens so that the prompts cross it, and the
gate/up projections are wide enough that the activation's clamp at 7 is reached.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moet.formats.experts import RoutedExperts
from moet.kernels.cpu import moe_forward
from moet.kernels.oracle import select_moe_backend
from moet.quant.codebook import Tier, dequantize_base, dequantize_fp4
from moet.quant.requant import requantize
from moet.testing.random_stacked import random_stored
from moet.vllm.config import source_kind
from tests.ckpt import write_tokenizer
from tests.test_vllm_plugin import _compare, run_vllm

PROMPTS = ["def main(argv):\n    return argv[0] if argv else None", "The quick brown fox jumps over the lazy dog."]
LAYERS, HIDDEN, WIDTH, EXPERTS, TOP_K, WINDOW = 4, 128, 64, 8, 2, 8
ALPHA, LIMIT = 1.702, 7.0  # the official config's swiglu_alpha / swiglu_limit
# The official gpt-oss config.json keys transformers does not write, and its unquantized-module globs.
OFFICIAL = {"experts_per_token": TOP_K, "initial_context_length": 4096}
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def build_checkpoints(root: Path, seed: int = 0) -> tuple[Path, Path]:
    """(bf16, mxfp4) gpt-oss checkpoint directories under `root`."""
    from transformers import GptOssConfig, GptOssForCausalLM

    from moet.formats.export import export_mxfp4

    bf16, mxfp4 = root / "gpt_oss-bf16", root / "gpt_oss-mxfp4"
    bf16.mkdir(parents=True)
    vocab = write_tokenizer(bf16)
    config = GptOssConfig(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=WIDTH,
        num_hidden_layers=LAYERS,
        num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2),
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "original_max_position_embeddings": 4096, "truncate": False},
        swiglu_limit=LIMIT,
        bos_token_id=vocab - 3,
        eos_token_id=vocab - 2,
        pad_token_id=vocab - 1,
    )
    torch.manual_seed(seed)
    model = GptOssForCausalLM(config)
    _trained_scales(model)
    model.to(torch.bfloat16).save_pretrained(bf16)
    path = bf16 / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **OFFICIAL}, indent=2))
    export_mxfp4(bf16, mxfp4)
    path = mxfp4 / "config.json"
    written = json.loads(path.read_text())
    written["quantization_config"]["modules_to_not_convert"] = NOT_CONVERTED
    path.write_text(json.dumps(written, indent=2))
    return bf16, mxfp4


def _trained_scales(model: torch.nn.Module) -> None:
    """Every matrix N(0, 1/fan_in), gate and up of each expert scaled by their own log-normal factor (so
    that some gate/up values pass the clamp at 7), embeddings N(0, 1), biases and sinks non-zero:
    transformers' init (N(0, 0.02), zero expert biases) would leave the biases and the clamp untested."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "embed_tokens" in name:
                param.normal_(0.0, 1.0)
            elif name.endswith("experts.gate_up_proj"):  # [E, H, 2I] for x @ W, gate columns even, up odd
                param.normal_(0.0, param.shape[1] ** -0.5)
                param.mul_(torch.randn(param.shape[0], 1, 2).mul(0.5).add(1.0).exp().repeat(1, 1, param.shape[2] // 2))
            elif name.endswith("experts.down_proj"):  # [E, I, H]
                param.normal_(0.0, param.shape[1] ** -0.5)
            elif name.endswith("sinks"):
                param.normal_(0.0, 1.0)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.5 if "experts" in name else 0.1)
            elif param.dim() == 2:
                param.normal_(0.0, param.shape[-1] ** -0.5)


def two_bit_experts(quant: Path, tier: Tier = Tier.NONE) -> dict[str, torch.Tensor]:
    """Every routed expert's 2-bit base (or FP4 tier) as moet.formats reads and moet.quant requantizes it
    (what `moet quantize --dump-dequant` writes), float64, by HF per-expert name."""
    out = {}
    with RoutedExperts(quant) as experts:
        for src in experts:
            qw = requantize(src, Tier.PLANES)
            out[src.name] = (dequantize_base(qw) if tier == Tier.NONE else dequantize_fp4(qw)).to(torch.float64)
    return out


def reference_log_probs(bf16: Path, experts: dict[str, torch.Tensor], token_ids: list[int], biases: bool = True) -> torch.Tensor:
    """float64 log-softmax at every position from transformers' GptOssForCausalLM (eager attention with
    sinks and the sliding window, its own swigluoai), its routed experts replaced by `experts`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.float64, experts_implementation="eager")
    with torch.no_grad():
        for name, weight in experts.items():
            _, layer, _, _, expert, proj, _ = name.split(".")[1:]
            mlp = model.model.layers[int(layer)].mlp.experts
            if proj == "down_proj":
                mlp.down_proj[int(expert)] = weight.T
            else:
                column = 0 if proj == "gate_proj" else 1  # gate columns even, up odd
                mlp.gate_up_proj[int(expert), :, column::2] = weight.T
        if not biases:
            for layer in model.model.layers:
                layer.mlp.experts.gate_up_proj_bias.zero_()
                layer.mlp.experts.down_proj_bias.zero_()
        logits = model(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits, dim=-1)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return build_checkpoints(tmp_path_factory.mktemp("gpt_oss"))


@pytest.mark.vllm
def test_gpt_oss_mxfp4_served_matches_float64_reference(gpt_oss: tuple[Path, Path]) -> None:
    """vLLM (float32) with the plugin serves the MXFP4 checkpoint with 2-bit experts: every reported top-5
    log-prob (prompt and generated positions) within 2e-3 of transformers in float64 over the same 2-bit
    experts, greedy tokens its argmax. The references without the expert biases and over the FP4 tier are
    far away, so vLLM ran the biases and the 2-bit codes."""
    bf16, quant = gpt_oss
    base, fp4 = two_bit_experts(quant), two_bit_experts(quant, Tier.PLANES)
    results = run_vllm({"model": str(quant), "prompts": PROMPTS, "dtype": "float32"}, VLLM_MOE_W2="1")
    deltas, away = [], []
    for result in results:
        assert len(result["prompt_ids"]) > WINDOW  # the sliding-window layers drop keys
        tokens = result["prompt_ids"] + result["tokens"]
        deltas.append(_compare(result, reference_log_probs(bf16, base, tokens)))
        for other in (reference_log_probs(bf16, base, tokens, biases=False), reference_log_probs(bf16, fp4, tokens)):
            away.append(_distance(result, other))
    deltas_all = torch.cat(deltas)
    assert len(deltas_all) >= 300
    assert float(deltas_all.max()) < 2e-3, f"max |Δ log-prob| {float(deltas_all.max()):.2e}, mean {float(deltas_all.mean()):.2e}"
    assert min(float(a.mean()) for a in away) > 20 * float(deltas_all.max()), "a reference without biases or at FP4 is as close"


# vLLM's only CPU MXFP4 MoE backend (CPUExpertsMxfp4) needs AMX tiles; without them stock vLLM refuses the
# MXFP4 checkpoint ("No MXFP4 MoE backend supports the deployment configuration ... backend: CPU, reason:
# kernel does not support current device cpu"), with or without the plugin.
NEEDS_AMX = pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="vLLM's CPU MXFP4 MoE backend needs AMX tiles")


@pytest.mark.vllm
@pytest.mark.parametrize("fmt", ["bf16", pytest.param("mxfp4", marks=NEEDS_AMX)])
def test_gpt_oss_knob_off_is_stock_vllm(gpt_oss: tuple[Path, Path], fmt: str) -> None:
    """VLLM_MOE_W2=0 with the plugin installed serves gpt-oss exactly as vLLM without the plugin does
    (greedy tokens and top-5 log-probs, bf16: the only dtype vLLM's MXFP4 method takes)."""
    spec = {"model": str(gpt_oss[0] if fmt == "bf16" else gpt_oss[1]), "prompts": PROMPTS}
    assert run_vllm(spec, VLLM_MOE_W2="0") == run_vllm(spec, VLLM_PLUGINS="", VLLM_MOE_W2="0")


def _distance(result: dict, reference: torch.Tensor) -> torch.Tensor:
    """|vLLM − reference| of every reported top log-prob."""
    steps = result["prompt_logprobs"][1:] + result["logprobs"]
    return torch.tensor([abs(lp - float(reference[pos, int(t)])) for pos, step in enumerate(steps) for t, lp in step.items()])


def test_vllm_renamed_gpt_oss_mxfp4_is_mxfp4() -> None:
    """vLLM hands the plugin gpt-oss's quantization_config with quant_method renamed to gpt_oss_mxfp4."""
    assert source_kind({"quant_method": "gpt_oss_mxfp4", "modules_to_not_convert": NOT_CONVERTED}) == ("mxfp4", NOT_CONVERTED)


def test_cpu_biased_swigluoai_matches_float64(single_thread: None) -> None:
    """The CPU path's biases and swigluoai against a float64 loop written from transformers' definition:
    gate/up biases after w13 (gate rows then up rows), the clamp (hit here), the down bias after w2 and
    before the routing weight; experts at the FP4 tier and ids of other ranks (−1) included."""
    experts, inter, hidden, tokens, k = 6, 64, 96, 9, 2
    w13, w2 = random_stored(experts, 2 * inter, hidden, "mx32", seed=1), random_stored(experts, hidden, inter, "mx32", seed=2)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, hidden, generator=gen) * 15  # |gate_up| ~ 4: some past the clamp
    b13, b2 = torch.randn(experts, 2 * inter, generator=gen), torch.randn(experts, hidden, generator=gen)
    ids = torch.randint(0, experts, (tokens, k), generator=gen, dtype=torch.int32)
    ids[0, 1] = -1
    weights = torch.rand(tokens, k, generator=gen)
    use_fp4 = torch.tensor([True, False] * (experts // 2))
    backend = select_moe_backend(x.device, tokens, use_fp4, biased=True)
    got = moe_forward(x, weights, ids, w13, w2, "swigluoai", use_fp4, w13_bias=b13, w2_bias=b2, backend=backend)

    want = torch.zeros(tokens, hidden, dtype=torch.float64)
    clamped = 0
    for t in range(tokens):
        for j in range(k):
            e = int(ids[t, j])
            if e < 0:
                continue
            tier = Tier.PLANES if use_fp4[e] else Tier.NONE
            gate_up = x[t].double() @ w13.dequantize(e, tier).T + b13[e].double()
            gate, up = gate_up[:inter], gate_up[inter:]
            clamped += int((gate > LIMIT).sum() + (up.abs() > LIMIT).sum())
            gate, up = gate.clamp(max=LIMIT), up.clamp(-LIMIT, LIMIT)
            y = ((up + 1) * gate * torch.sigmoid(ALPHA * gate)) @ w2.dequantize(e, tier).T + b2[e].double()
            want[t] += float(weights[t, j]) * y
    assert clamped > 0
    assert float((got.double() - want).norm() / want.norm()) < 1e-5
