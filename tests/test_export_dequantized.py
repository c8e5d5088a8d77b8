"""export_dequantized: an NVFP4 checkpoint back to BF16, each weight its source value rounded once."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from moet.formats.export import export_dequantized

E2M1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6]


def test_nvfp4_linears_become_their_values_in_bf16(checkpoint, tmp_path) -> None:
    src = checkpoint("qwen3_moe", "nvfp4")
    out = export_dequantized(src, tmp_path / "bf16")
    got = load_file(str(out / "model.safetensors"))
    raw = load_file(str(src / "model.safetensors"))
    name = "model.layers.1.mlp.experts.2.down_proj.weight"
    packed = raw[name]
    nibbles = torch.stack([packed & 15, packed >> 4], -1).flatten(-2).long()
    magnitude = torch.tensor(E2M1, dtype=torch.float64)[nibbles & 7]
    value = torch.where(nibbles >= 8, -magnitude, magnitude)
    scale = raw[name.replace(".weight", ".weight_scale")].double().repeat_interleave(16, -1)
    want = (value * scale * raw[name.replace(".weight", ".weight_scale_2")].double()).to(torch.bfloat16)
    assert torch.equal(got[name], want)
    assert not any(k.endswith(("weight_scale", "weight_scale_2", "input_scale")) for k in got)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert torch.equal(got["model.embed_tokens.weight"], raw["model.embed_tokens.weight"])
