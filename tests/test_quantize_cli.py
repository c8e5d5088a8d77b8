"""`moet quantize --dump-dequant` as a real subprocess, against an independent float64 decode of each source.

The decode below is written from docs/FORMAT.md without moet's code: e4m3 through
PyTorch's float8 dtype, UE8M0 as 2^(b−127), the reference rule by nearest-magnitude search.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
PROJ_NAMES = {
    "qwen3_moe": ("mlp.experts", ("gate_proj", "up_proj", "down_proj")),
    "deepseek_v3": ("mlp.experts", ("gate_proj", "up_proj", "down_proj")),
    "gpt_oss": ("mlp.experts", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe.experts", ("w1", "w3", "w2")),
}
MOE_LAYERS = {"qwen3_moe": [0, 1], "mixtral": [0, 1], "deepseek_v3": [1, 2], "gpt_oss": [0, 1]}
EXPERTS = 4


def run_moet(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moet.cli", *args], capture_output=True, text=True, timeout=300)


def _nibbles(packed: torch.Tensor) -> np.ndarray:
    b = packed.numpy().astype(np.int64)
    return np.stack([b & 0xF, b >> 4], axis=-1).reshape(b.shape[0], -1)


def _reference_fp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Reference rule: (nibbles [N, K], per-element scale 2^e [N, K])."""
    n, k = w.shape
    blocks = w.reshape(n, k // 32, 32)
    amax = np.abs(blocks).max(-1)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.round(np.log2(amax / 6.0)), -127.0).clip(-127, 127)
    u = blocks / np.exp2(e)[..., None]
    magnitude = np.abs(np.abs(u)[..., None] - E2M1).argmin(-1)  # first minimum: ties go to the lower magnitude
    nibbles = magnitude | (np.signbit(blocks) * 8)
    return nibbles.reshape(n, k), np.repeat(np.exp2(e), 32, axis=1)


def _policy(nibbles: list[np.ndarray]) -> str:
    zeros = np.concatenate([(x & 7).ravel() == 0 for x in nibbles])
    negative = np.concatenate([((x & 7) == 0).ravel() & (x.ravel() >= 8) for x in nibbles])
    if zeros.sum() == 0:
        return "sign"
    share = max(negative.sum(), zeros.sum() - negative.sum()) / zeros.sum()
    return "parity" if share >= 0.95 else "sign"


def _expected(nibbles: np.ndarray, scale: np.ndarray, policy: str) -> tuple[np.ndarray, np.ndarray]:
    magnitude = nibbles & 7
    negative = nibbles >= 8
    fp4 = np.where(negative, -1.0, 1.0) * E2M1[magnitude] * scale
    if policy == "parity":
        odd = (np.arange(nibbles.shape[1]) % 2 == 1)[None, :]
        negative = np.where(magnitude == 0, odd, negative)
    base = np.where(negative, -1.0, 1.0) * np.where(magnitude >= 5, 4.0, 1.0) * scale
    return base, fp4


def _sources(arch: str, fmt: str, raw: dict[str, torch.Tensor]) -> dict[str, list[tuple[str, np.ndarray, np.ndarray]]]:
    """Group (policy scope) → [(HF per-expert name, nibbles, per-element scale)]."""
    prefix, projs = PROJ_NAMES[arch]
    groups: dict[str, list[tuple[str, np.ndarray, np.ndarray]]] = {}
    for layer in MOE_LAYERS[arch]:
        for e in range(EXPERTS):
            for i, proj in enumerate(projs):
                name = f"model.layers.{layer}.{prefix}.{e}.{proj}.weight"
                module = name.removesuffix(".weight")
                if arch == "gpt_oss":
                    fused = "gate_up_proj" if i < 2 else "down_proj"
                    scope = f"model.layers.{layer}.mlp.experts.{fused}"
                    rows = slice(i, None, 2) if i < 2 else slice(None)
                    if fmt == "mxfp4":
                        blocks, scales = raw[f"{scope}_blocks"][e], raw[f"{scope}_scales"][e]
                        nib = _nibbles(blocks.reshape(blocks.shape[0], -1)[rows])
                        scale = np.repeat(np.exp2(scales[rows].numpy().astype(np.float64) - 127), 32, axis=1)
                    else:
                        nib, scale = _reference_fp4(raw[scope][e].to(torch.float64).numpy().T[rows])
                else:
                    scope = name
                    if fmt == "nvfp4":
                        nib = _nibbles(raw[name])
                        block = raw[f"{module}.weight_scale"].to(torch.float64).numpy()
                        scale = np.repeat(block, 16, axis=1) * float(raw[f"{module}.weight_scale_2"])
                    elif fmt == "mxfp4":
                        nib = _nibbles(raw[name])
                        scale = np.repeat(np.exp2(raw[f"{module}.weight_scale"].numpy().astype(np.float64) - 127), 32, axis=1)
                    elif fmt == "fp8_block":
                        w = raw[name].to(torch.float64).numpy()
                        inv = raw[f"{module}.weight_scale_inv"].numpy().astype(np.float64)
                        full = np.repeat(np.repeat(inv, 128, axis=0), 128, axis=1)[: w.shape[0], : w.shape[1]]
                        nib, scale = _reference_fp4(w * full)
                    else:
                        nib, scale = _reference_fp4(raw[name].to(torch.float64).numpy())
                groups.setdefault(scope, []).append((name, nib, scale))
    return groups


MATRIX = [(a, f) for a in ("qwen3_moe", "mixtral", "deepseek_v3") for f in ("bf16", "nvfp4", "mxfp4", "fp8_block")]
MATRIX += [("gpt_oss", "bf16"), ("gpt_oss", "mxfp4")]


@pytest.mark.parametrize("arch, fmt", MATRIX)
def test_dump_dequant_matches_independent_decode(checkpoint, tmp_path: Path, arch: str, fmt: str) -> None:
    path = checkpoint(arch, fmt)
    tier = ("none", "planes", "refine")[MATRIX.index((arch, fmt)) % 3]
    out = tmp_path / "dump.safetensors"
    result = run_moet("quantize", str(path), "--tier", tier, "--dump-dequant", str(out))
    assert result.returncode == 0, result.stderr
    assert "routed-expert tensors" in result.stdout and "bits/weight" in result.stdout
    dump = load_file(out)
    raw = load_file(path / "model.safetensors")
    expected_names = set()
    for members in _sources(arch, fmt, raw).values():
        policy = _policy([nib for _, nib, _ in members])
        for name, nib, scale in members:
            base, fp4 = _expected(nib, scale, policy)
            assert torch.equal(dump[f"{name}@2bit"], torch.from_numpy(base).to(torch.float32)), name
            assert torch.equal(dump[f"{name}@fp4"], torch.from_numpy(fp4).to(torch.float32)), name
            expected_names |= {f"{name}@2bit", f"{name}@fp4"}
    assert set(dump) == expected_names


def _rewrite(path: Path, edit) -> None:
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def _patch_header(path: Path, edit) -> None:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    edit(header)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length :])


W = "model.layers.1.mlp.experts.2.up_proj"


def _set(name: str, value) -> callable:
    def edit(t: dict[str, torch.Tensor]) -> None:
        t[name] = value(t[name]) if callable(value) else value

    return edit


def _poke(name: str, index: tuple, value: float):
    def edit(t: dict[str, torch.Tensor]) -> None:
        x = t[name].clone()
        x[index] = value
        t[name] = x

    return edit


def _nan_e4m3(t: dict[str, torch.Tensor]) -> None:
    bits = t[f"{W}.weight_scale"].view(torch.uint8).clone()
    bits[0, 0] = 0x7F
    t[f"{W}.weight_scale"] = bits.view(torch.float8_e4m3fn)


def _claim_2tb(header: dict) -> None:
    entry = header[f"{W}.weight"]
    entry["shape"] = [2**40, 2]
    entry["data_offsets"] = [entry["data_offsets"][0], entry["data_offsets"][0] + 2**41]


BAD = {
    "truncated": ("nvfp4-experts", lambda p: p.write_bytes(p.read_bytes()[:-1000]), "beyond the end"),
    "corrupt header": ("nvfp4-experts", lambda p: p.write_bytes(p.read_bytes()[:8] + b"#" * 16 + p.read_bytes()[24:]), "not valid JSON"),
    "header claims 2 TB": ("nvfp4-experts", lambda p: _patch_header(p, _claim_2tb), f"{W}.weight"),
    "scale dtype": ("nvfp4-experts", lambda p: _rewrite(p, _set(f"{W}.weight_scale", lambda x: x.to(torch.float32))), f"{W}.weight_scale: is F32"),
    "scale shape": ("nvfp4-experts", lambda p: _rewrite(p, _set(f"{W}.weight_scale", lambda x: x[:, :2].contiguous())), f"{W}.weight_scale: is F8_E4M3"),
    "NaN scale": ("nvfp4-experts", lambda p: _rewrite(p, _nan_e4m3), f"{W}.weight_scale: 1 of"),
    "Inf weight_scale_2": ("nvfp4-experts", lambda p: _rewrite(p, _set(f"{W}.weight_scale_2", torch.tensor(float("inf")))), f"{W}.weight_scale_2: 1 of 1 values are NaN or Inf"),
    "missing weight_scale_2": ("nvfp4-experts", lambda p: _rewrite(p, lambda t: t.pop(f"{W}.weight_scale_2")), "no weight_scale_2"),
    "NaN weight": ("bf16", lambda p: _rewrite(p, _poke(f"{W}.weight", (3, 4), float("nan"))), f"{W}.weight: 1 of 2048 values are NaN or Inf"),
    "Inf weight": ("bf16", lambda p: _rewrite(p, _poke(f"{W}.weight", (0, 0), float("-inf"))), f"{W}.weight: 1 of"),
    "NaN fp8 weight": ("fp8_block", lambda p: _rewrite(p, _poke(f"{W}.weight", (1, 1), float("nan"))), f"{W}.weight: 1 of"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_fails_cleanly(checkpoint, tmp_path: Path, case: str) -> None:
    fmt, corrupt, expected = BAD[case]
    model = shutil.copytree(checkpoint("qwen3_moe", fmt), tmp_path / "model")
    shard = model / "model.safetensors"
    corrupt(shard)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    result = run_moet("quantize", str(model), "--dump-dequant", str(out_dir / "dump.safetensors"))
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moet: error:"), result.stderr
    assert str(shard) in lines[0] and expected in lines[0], lines[0]
    assert list(out_dir.iterdir()) == []


def test_unknown_architecture_fails_cleanly(checkpoint, tmp_path: Path) -> None:
    model = shutil.copytree(checkpoint("mixtral", "bf16"), tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "architectures": ["MysteryMoeForCausalLM"]}))
    result = run_moet("quantize", str(model), "--dump-dequant", str(tmp_path / "dump.safetensors"))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1
    assert "MysteryMoeForCausalLM" in lines[0] and str(model / "config.json") in lines[0]
    assert not (tmp_path / "dump.safetensors").exists()


def test_store_pack_rows_match_the_dump(checkpoint, tmp_path: Path) -> None:
    from moet.quant.codebook import dequantize_base, dequantize_fp4
    from moet.store.build import write_pack_from_checkpoint

    model = checkpoint("qwen3_moe", "nvfp4-experts")
    store, out = tmp_path / "store", tmp_path / "dump.safetensors"
    result = run_moet("quantize", str(model), "--tier", "refine", "--store", str(store), "--dump-dequant", str(out))
    assert result.returncode == 0, result.stderr
    pack_file = next(store.glob("*.pack"))
    assert f"pack {pack_file} written:" in result.stdout
    written = pack_file.stat().st_mtime_ns
    again = run_moet("quantize", str(model), "--tier", "refine", "--store", str(store))
    assert again.returncode == 0 and f"pack {pack_file} reused (complete and current):" in again.stdout, again.stdout
    dump = load_file(out)
    with write_pack_from_checkpoint(model, store, tier="refine") as pack:  # complete and current: reused
        assert pack_file.stat().st_mtime_ns == written
        w13, w2 = pack.read_weights(1, 3)
    prefix = "model.layers.1.mlp.experts.3"
    for tag, decode in (("2bit", dequantize_base), ("fp4", dequantize_fp4)):
        gate_up = torch.cat([dump[f"{prefix}.gate_proj.weight@{tag}"], dump[f"{prefix}.up_proj.weight@{tag}"]])
        assert torch.equal(decode(w13).to(torch.float32), gate_up)
        assert torch.equal(decode(w2).to(torch.float32), dump[f"{prefix}.down_proj.weight@{tag}"])
