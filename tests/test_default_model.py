"""The shipped default model: config, tokenizer and NVFP4 tensors agree and are well formed (no forward pass)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

DEFAULT = Path(__file__).resolve().parents[1] / "moet" / "models" / "default"
FILES = (
    "config.json",
    "hf_quant_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)

pytestmark = pytest.mark.skipif(not (DEFAULT / "model.safetensors").exists(), reason="default checkpoint not built")


def _config() -> dict:
    return json.loads((DEFAULT / "config.json").read_text())


def test_files_present_and_small() -> None:
    sizes = {name: (DEFAULT / name).stat().st_size for name in FILES}
    assert sum(sizes.values()) <= 40 * 1000 * 1000, sizes


def test_architecture() -> None:
    cfg = _config()
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    assert cfg["num_hidden_layers"] >= 12
    assert cfg["hidden_size"] == 256 and cfg["moe_intermediate_size"] == 256
    assert cfg.get("num_experts", cfg.get("num_local_experts")) == 16 and cfg["num_experts_per_tok"] == 4
    assert cfg["head_dim"] in (32, 64, 80, 96, 112, 128)
    assert cfg["tie_word_embeddings"] is False and cfg["norm_topk_prob"] is True


def test_tokenizer_matches_vocab(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEFAULT)
    assert len(tok) == _config()["vocab_size"] == 4096
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == _config()["eos_token_id"]
    prompt = tok.apply_chat_template([{"role": "user", "content": "def f(x):"}], add_generation_prompt=True, tokenize=False)
    assert prompt == "<|user|>\ndef f(x):\n<|assistant|>\n"
    ids = tok(prompt)["input_ids"]
    assert tok.convert_tokens_to_ids("<|user|>") == ids[0] and tok.decode(ids) == prompt


def test_quant_config_excludes_everything_but_experts() -> None:
    cfg = _config()
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "NVFP4" and qc["group_size"] == 16
    legacy = json.loads((DEFAULT / "hf_quant_config.json").read_text())["quantization"]
    assert legacy["quant_algo"] == "NVFP4" and set(legacy["exclude_modules"]) == set(qc["ignore"])
    assert "lm_head" in qc["ignore"] and "model.embed_tokens" in qc["ignore"]
    assert not any(".experts." in name for name in qc["ignore"])


def test_nvfp4_tensors_well_formed() -> None:
    from safetensors import safe_open

    from moet.formats.naming import SCHEMES

    cfg = _config()
    scheme = SCHEMES["Qwen3MoeForCausalLM"]
    hidden, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    seen = set()
    with safe_open(str(DEFAULT / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            m = scheme.match_per_expert(name)
            t = f.get_tensor(name)
            if m is None:
                assert t.dtype == torch.bfloat16, name
                continue
            layer, expert, proj, suffix = m
            n, k = shapes[proj]
            seen.add((layer, expert, proj, suffix))
            if suffix == "weight":
                assert t.dtype == torch.uint8 and tuple(t.shape) == (n, k // 2), name
            elif suffix == "weight_scale":
                assert t.dtype == torch.float8_e4m3fn and tuple(t.shape) == (n, k // 16), name
                assert torch.isfinite(t.float()).all() and (t.float() >= 0).all(), name
            else:
                assert suffix in ("weight_scale_2", "input_scale") and t.dtype == torch.float32 and t.numel() == 1, name
                assert torch.isfinite(t).all() and float(t) > 0, name
    want = {
        (layer, e, p, s)
        for layer in range(cfg["num_hidden_layers"])
        for e in range(experts)
        for p in shapes
        for s in ("weight", "weight_scale", "weight_scale_2", "input_scale")
    }
    assert seen == want
