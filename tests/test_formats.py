"""Safetensors header validation, checkpoint discovery and routed-expert naming on real files."""

from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moet.errors import CheckpointError
from moet.formats.checkpoint import open_checkpoint
from moet.formats.experts import RoutedExperts, iter_routed_experts
from moet.formats.safetensors_io import SafetensorsFile, read_header, write_streaming


def _raw_file(path: Path, header: object, data: bytes = b"", length: int | None = None) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


def _error(path: Path) -> str:
    with pytest.raises(CheckpointError) as info:
        read_header(path)
    message = str(info.value)
    assert str(path) in message and "\n" not in message
    return message


def test_truncated_and_empty_files(tmp_path: Path) -> None:
    tiny = tmp_path / "tiny.safetensors"
    tiny.write_bytes(b"\x01\x02")
    assert "too short" in _error(tiny)
    good = tmp_path / "good.safetensors"
    save_file({"x": torch.arange(100, dtype=torch.float32)}, good)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[:-40])
    assert "beyond the end" in _error(cut)


def test_header_length_claiming_terabytes_is_refused(tmp_path: Path) -> None:
    path = _raw_file(tmp_path / "huge.safetensors", {"x": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, b"\0", length=2 * 10**12)
    assert "header length 2000000000000" in _error(path)


def test_tensor_claiming_terabytes_is_refused(tmp_path: Path) -> None:
    header = {"model.layers.0.mlp.experts.0.up_proj.weight": {"dtype": "BF16", "shape": [2**20, 2**20], "data_offsets": [0, 2**41]}}
    message = _error(_raw_file(tmp_path / "lie.safetensors", header, b"\0" * 64))
    assert "model.layers.0.mlp.experts.0.up_proj.weight" in message and "beyond the end" in message


@pytest.mark.parametrize(
    "header, expected",
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "not a JSON object"),
        ({"x": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 2]}}, "unknown dtype"),
        ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, "needs 8"),
        ({"x": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 0]}}, "non-negative"),
        ({"x": {"dtype": "U8", "shape": [2], "data_offsets": [2, 0]}}, "begin <= end"),
        ({"x": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}, "y": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}}, "overlap"),
    ],
)
def test_corrupt_headers(tmp_path: Path, header: object, expected: str) -> None:
    assert expected in _error(_raw_file(tmp_path / "bad.safetensors", header, b"\0" * 16))


def test_reader_matches_safetensors(tmp_path: Path) -> None:
    tensors = {
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "e4m3": torch.randn(4, 8).to(torch.float8_e4m3fn),
        "u8": torch.randint(0, 256, (7,), dtype=torch.uint8),
        "scalar": torch.tensor(0.125, dtype=torch.float32),
        "empty": torch.zeros(0, 4, dtype=torch.float16),
    }
    path = tmp_path / "t.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    with SafetensorsFile(path) as ours, safe_open(path, "pt") as ref:
        assert set(ours.tensors) == set(ref.keys())
        for name in ref.keys():
            got, want = ours.read(name), ref.get_tensor(name)
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))


def test_streaming_writer_round_trips_through_safetensors(tmp_path: Path) -> None:
    tensors = {"a": torch.arange(6, dtype=torch.int64).reshape(2, 3), "s": torch.tensor(2.5, dtype=torch.float32), "b": torch.ones(5, dtype=torch.bfloat16)}
    path = tmp_path / "w.safetensors"
    write_streaming(path, [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()], tensors.__getitem__)
    loaded = load_file(path)
    assert all(torch.equal(loaded[n], t) for n, t in tensors.items())
    with pytest.raises(ValueError):
        write_streaming(tmp_path / "x.safetensors", [("a", torch.float32, (2,))], lambda _: torch.zeros(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]


@pytest.mark.parametrize(
    "arch, layers",
    [("qwen3_moe", [0, 1]), ("mixtral", [0, 1]), ("deepseek_v3", [1, 2]), ("glm4_moe", [1, 2]), ("gpt_oss", [0, 1]), ("qwen2_moe", [0, 1]), ("olmoe", [0, 1])],
)
def test_routed_experts_only(checkpoint, arch: str, layers: list[int]) -> None:
    weights = list(iter_routed_experts(checkpoint(arch, "bf16")))
    assert len(weights) == len(layers) * 4 * 3
    assert sorted({w.key.layer for w in weights}) == layers  # DeepSeek's and GLM's first_k_dense layer 0 is skipped
    assert not any("shared" in w.name for w in weights)
    assert sorted((w.key.layer, w.key.expert, w.key.proj) for w in weights) == sorted((layer, e, p) for layer in layers for e in range(4) for p in ("gate", "up", "down"))
    assert {w.shape for w in weights} == {(32, 64), (64, 32)}


def test_gpt_oss_fused_bf16_is_transposed_and_interleaved(checkpoint) -> None:
    path = checkpoint("gpt_oss", "bf16")
    raw = load_file(path / "model.safetensors")
    gate_up = raw["model.layers.1.mlp.experts.gate_up_proj"]  # [E, H, 2I], x @ W layout
    down = raw["model.layers.1.mlp.experts.down_proj"]  # [E, I, H]
    got = {w.name: w.data for w in iter_routed_experts(path)}
    for e in range(4):
        prefix = f"model.layers.1.mlp.experts.{e}"
        assert torch.equal(got[f"{prefix}.gate_proj.weight"], gate_up[e][:, 0::2].T)
        assert torch.equal(got[f"{prefix}.up_proj.weight"], gate_up[e][:, 1::2].T)
        assert torch.equal(got[f"{prefix}.down_proj.weight"], down[e].T)


def test_gpt_oss_mxfp4_export_matches_transformers_dequantization(checkpoint) -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    path = checkpoint("gpt_oss", "mxfp4")
    raw = load_file(path / "model.safetensors")
    source = load_file(checkpoint("gpt_oss", "bf16") / "model.safetensors")
    for proj in ("gate_up_proj", "down_proj"):
        name = f"model.layers.0.mlp.experts.{proj}"
        assert name not in raw and raw[f"{name}_blocks"].dtype == torch.uint8
        ours = convert_moe_packed_tensors(raw[f"{name}_blocks"], raw[f"{name}_scales"], dtype=torch.float32)
        want = source[name].to(torch.float32)
        assert ours.shape == want.shape
        assert (ours - want).norm() / want.norm() < 0.2  # FP4 error, orientation and interleave preserved
    assert json.loads((path / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"


def _e2m1_nearest(u: float) -> int:
    """Independent nearest-e2m1 search: least distance, ties to the lower magnitude."""
    mags = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    code = min(range(8), key=lambda i: (abs(abs(u) - mags[i]), i))
    return code | (8 if math.copysign(1.0, u) < 0 else 0)


def test_nvfp4_export_bits(checkpoint) -> None:
    path = checkpoint("qwen3_moe", "nvfp4-experts")
    raw = load_file(path / "model.safetensors")
    source = load_file(checkpoint("qwen3_moe", "bf16") / "model.safetensors")
    name = "model.layers.1.mlp.experts.2.down_proj"
    w = source[f"{name}.weight"].to(torch.float64)
    scale_2 = raw[f"{name}.weight_scale_2"]
    assert scale_2.dtype == torch.float32 and scale_2.shape == ()
    assert scale_2.item() == torch.tensor(w.abs().max().item() / (6 * 448), dtype=torch.float32).item()
    scales = raw[f"{name}.weight_scale"].to(torch.float64)
    packed = raw[f"{name}.weight"]
    n, k = w.shape
    for row in range(0, n, 7):
        for col in range(k):
            byte = int(packed[row, col // 2])
            nibble = byte & 0xF if col % 2 == 0 else byte >> 4
            u = w[row, col].item() / (scales[row, col // 16].item() * scale_2.item())
            assert nibble == _e2m1_nearest(u)
    assert raw["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16  # experts only
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    assert config["quant_algo"] == "NVFP4" and config["group_size"] == 16 and "model.layers.0.self_attn.q_proj" in config["ignore"]
    legacy = json.loads((path / "hf_quant_config.json").read_text())["quantization"]
    assert legacy["exclude_modules"] == config["ignore"]


def test_nvfp4_all_linears_keeps_routers_and_head(checkpoint) -> None:
    raw = load_file(checkpoint("deepseek_v3", "nvfp4") / "model.safetensors")
    assert raw["model.layers.0.mlp.gate_proj.weight"].dtype == torch.uint8  # dense MLP quantized
    assert raw["model.layers.1.self_attn.kv_b_proj.weight"].dtype == torch.uint8
    for name in ("model.layers.1.mlp.gate.weight", "lm_head.weight", "model.embed_tokens.weight"):
        assert raw[name].dtype == torch.bfloat16


def test_fp8_block_export_scales(checkpoint) -> None:
    raw = load_file(checkpoint("mixtral", "fp8_block") / "model.safetensors")
    source = load_file(checkpoint("mixtral", "bf16") / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj"  # [128, 64]: one 128×128 block
    w = source[f"{name}.weight"].to(torch.float64)
    scale_inv = raw[f"{name}.weight_scale_inv"]
    assert scale_inv.shape == (1, 1) and scale_inv.item() == torch.tensor(w.abs().max().item() / 448, dtype=torch.float32).item()
    decoded = raw[f"{name}.weight"].to(torch.float64) * scale_inv.item()
    assert (decoded - w).abs().max() <= w.abs().max() / 16  # e4m3: 3 mantissa bits


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_nvfp4_config_flat_and_legacy_forms(checkpoint, tmp_path: Path) -> None:
    legacy_only = _copy(checkpoint("qwen3_moe", "nvfp4"), tmp_path / "legacy")
    config = json.loads((legacy_only / "config.json").read_text())
    del config["quantization_config"]
    (legacy_only / "config.json").write_text(json.dumps(config))
    flat_only = _copy(checkpoint("qwen3_moe", "nvfp4"), tmp_path / "flat")
    (flat_only / "hf_quant_config.json").unlink()
    for path in (legacy_only, flat_only):
        ckpt = open_checkpoint(path)
        assert ckpt.quant == "nvfp4" and "lm_head" in ckpt.ignore
    assert open_checkpoint(checkpoint("qwen3_moe", "fp8_block")).quant == "fp8_block"
    assert open_checkpoint(checkpoint("gpt_oss", "mxfp4")).quant == "mxfp4"
    assert open_checkpoint(checkpoint("mixtral", "bf16")).quant == "float"


def test_sharded_checkpoint_reads_like_single_file(checkpoint, tmp_path: Path) -> None:
    src = checkpoint("mixtral", "nvfp4-experts")
    out = _copy(src, tmp_path / "sharded")
    tensors = load_file(out / "model.safetensors")
    (out / "model.safetensors").unlink()
    names = sorted(tensors)
    # split so that a weight and its scales land in different shards
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, out / file)
        weight_map.update(dict.fromkeys(part, file))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    single = list(iter_routed_experts(src))
    sharded = list(iter_routed_experts(out))
    assert [w.name for w in sharded] == [w.name for w in single]
    for a, b in zip(single, sharded):
        assert torch.equal(a.data, b.data) and torch.equal(a.scales, b.scales) and a.scale_2 == b.scale_2
    assert len(RoutedExperts(out)) == len(single)


def test_missing_shard_and_unknown_architecture(checkpoint, tmp_path: Path) -> None:
    out = _copy(checkpoint("qwen3_moe", "bf16"), tmp_path / "m")
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-00009.safetensors"}}))
    with pytest.raises(CheckpointError, match="model-00009.safetensors is missing"):
        open_checkpoint(out)
    (out / "model.safetensors.index.json").unlink()
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(CheckpointError, match="LlamaForCausalLM.*not supported"):
        open_checkpoint(out)


def test_fp16_experts_are_read_as_float(checkpoint, tmp_path: Path) -> None:
    out = _copy(checkpoint("qwen3_moe", "bf16"), tmp_path / "fp16")
    tensors = load_file(out / "model.safetensors")
    save_file({n: t.to(torch.float16) for n, t in tensors.items()}, out / "model.safetensors")
    weights = list(iter_routed_experts(out))
    assert len(weights) == 24 and {w.kind for w in weights} == {"float"} and {w.data.dtype for w in weights} == {torch.float16}
    name = "model.layers.0.mlp.experts.1.down_proj.weight"
    assert torch.equal(next(w.data for w in weights if w.name == name), tensors[name].to(torch.float16))
