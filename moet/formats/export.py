"""Writers that turn a BF16/FP16/FP32 HF checkpoint into modelopt NVFP4, MXFP4 or FP8-block checkpoints.

They make the real-format checkpoints the tests read and the embedded default model ships as.
Each works shard by shard, writes into a temporary directory beside `out_dir` and renames it into
place, so a failure never leaves a half-written checkpoint. Nothing is calibrated: `input_scale`
is a constant, which only matters to W4A4 GPU kernels.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from moet.errors import CheckpointError
from moet.formats.checkpoint import INDEX, Checkpoint, open_checkpoint
from moet.formats.safetensors_io import SafetensorsFile
from moet.quant.codebook import decode_fp4, pack_nibbles
from moet.quant.reference import MX_BLOCK, e2m1_nibbles, fp4_from_float
from moet.quant.scales import expand_blocks, scale_values

E4M3_MAX = 448.0
E2M1_MAX = 6.0
NV_BLOCK = 16
FP8_BLOCK = 128
# Never quantized, whatever the format: embeddings, the LM head and MoE routers.
ALWAYS_FLOAT = ("embed_tokens.", "lm_head.")
ROUTERS = (".mlp.gate.weight", ".block_sparse_moe.gate.weight", ".mlp.router.weight", ".shared_expert_gate.weight")

Converter = Callable[[str, torch.Tensor], dict[str, torch.Tensor]]


def nvfp4_from_float(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float [N, K] → modelopt NVFP4 (packed e2m1 uint8 [N, K/2], e4m3 [N, K/16], float32 scalar weight_scale_2).

    weight_scale_2 = amax / (6·448) (1.0 for an all-zero tensor); each 16-block's e4m3 scale is its
    amax / 6 / weight_scale_2 rounded to nearest e4m3; nibbles are the nearest e2m1 of w / (scale ·
    weight_scale_2) with ties to the lower magnitude (moet.quant.reference.e2m1_nibbles), in float64.
    """
    w = weight.to(torch.float64)
    amax = float(w.abs().max()) if w.numel() else 0.0
    scale_2 = torch.tensor(amax / (E2M1_MAX * E4M3_MAX) if amax > 0 else 1.0, dtype=torch.float32)
    blocks = w.unflatten(-1, (-1, NV_BLOCK))
    ratio = blocks.abs().amax(-1) / E2M1_MAX / float(scale_2)
    block_scale = ratio.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    denom = (block_scale.to(torch.float64) * float(scale_2)).unsqueeze(-1)
    u = torch.where(denom > 0, blocks / denom.clamp(min=torch.finfo(torch.float64).tiny), blocks * 0)
    return pack_nibbles(e2m1_nibbles(u).flatten(-2)), block_scale, scale_2


def fp8_block_from_float(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float [N, K] → (float8_e4m3fn [N, K], float32 weight_scale_inv [ceil(N/128), ceil(K/128)] = block amax / 448)."""
    n, k = weight.shape
    w = weight.to(torch.float64)
    padded = torch.nn.functional.pad(w, (0, -k % FP8_BLOCK, 0, -n % FP8_BLOCK))
    grid = padded.unflatten(0, (-1, FP8_BLOCK)).unflatten(2, (-1, FP8_BLOCK))
    amax = grid.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax)).to(torch.float32)
    full = scale_inv.to(torch.float64).repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:n, :k]
    return (w / full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale_inv


def _is_quantizable(name: str, tensor: torch.Tensor, experts_only: bool, ckpt: Checkpoint, block: int) -> bool:
    """A 2-D linear weight that the export quantizes."""
    if not name.endswith(".weight") or tensor.dim() != 2 or tensor.shape[1] % block:
        return False
    if ckpt.scheme.match_per_expert(name) is not None:
        return True
    return not experts_only and not any(token in name for token in ALWAYS_FLOAT) and not name.endswith(ROUTERS)


@contextmanager
def _atomic_directory(out: Path) -> Iterator[Path]:
    """A temporary sibling of `out` that becomes `out` only when the block completes (no partial output)."""
    if out.exists():
        raise CheckpointError(f"{out}: already exists; remove it or pick another output directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _finish_directory(src: Path, tmp: Path, weight_map: dict[str, str], config: dict[str, Any]) -> None:
    """Copy the side files (tokenizer, generation config, …), write the index if the source has one,
    and the new config.json, into the temporary output directory."""
    for item in src.iterdir():
        if item.is_file() and item.suffix != ".safetensors" and item.name not in ("config.json", INDEX, "hf_quant_config.json"):
            shutil.copy2(item, tmp / item.name)
    if (src / INDEX).exists():
        total = sum((tmp / f).stat().st_size for f in set(weight_map.values()))
        (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (tmp / "config.json").write_text(json.dumps(config, indent=2))


def _export(
    src_dir: str | Path,
    out_dir: str | Path,
    convert: Converter,
    quantized: Callable[[Checkpoint, str, torch.Tensor], bool],
    config_for: Callable[[list[str]], dict[str, Any]],
    legacy: dict[str, Any] | None = None,
) -> Path:
    """Copy `src_dir` to `out_dir` shard by shard, converting the tensors `quantized` selects; atomic."""
    src, out = Path(src_dir), Path(out_dir)
    ckpt = open_checkpoint(src)
    if ckpt.quant != "float":
        raise CheckpointError(f"{src}: is already {ckpt.quant}; export starts from a BF16/FP16/FP32 checkpoint")
    with _atomic_directory(out) as tmp:
        unquantized: list[str] = []
        weight_map: dict[str, str] = {}
        for path in ckpt.shards:
            tensors: dict[str, torch.Tensor] = {}
            with SafetensorsFile(path) as shard:
                for name in shard.tensors:
                    tensor = shard.read(name)
                    if quantized(ckpt, name, tensor):
                        tensors.update(convert(name, tensor))
                    else:
                        tensors[name] = tensor
                        if name.endswith(".weight") and tensor.dim() == 2:
                            unquantized.append(name.removesuffix(".weight"))
            save_file(tensors, tmp / path.name, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, path.name))
        _finish_directory(src, tmp, weight_map, dict(ckpt.config, quantization_config=config_for(unquantized)))
        if legacy is not None:
            legacy_cfg = {"producer": {"name": "moet", "version": "0.1.0"}, "quantization": dict(legacy, exclude_modules=unquantized)}
            (tmp / "hf_quant_config.json").write_text(json.dumps(legacy_cfg, indent=2))
    return out


def _refuse_fused(ckpt: Checkpoint, fmt: str) -> None:
    if ckpt.scheme.fused:
        raise CheckpointError(f"{ckpt.root}: {ckpt.architecture} stores fused experts; only MXFP4 export supports it, not {fmt}")


def export_nvfp4(src_dir: str | Path, out_dir: str | Path, *, experts_only: bool = True, input_scale: float = 1.0) -> Path:
    """Write a modelopt NVFP4 checkpoint of `src_dir` (BF16 HF checkpoint) to `out_dir`; returns out_dir.

    Quantized linears get `weight` uint8 [N, K/2], `weight_scale` float8_e4m3fn [N, K/16],
    `weight_scale_2` and `input_scale` float32 scalars (nvfp4_from_float). `experts_only=True`
    quantizes only routed experts (attention, dense MLPs, shared experts stay as they are);
    otherwise every 2-D linear with K % 16 == 0 except embeddings, LM head and routers. Writes
    config.json `quantization_config` (flat modelopt form: quant_method, quant_algo NVFP4,
    group_size 16, ignore) and hf_quant_config.json (legacy form, exclude_modules); both list every
    module left unquantized.
    """
    _refuse_fused(open_checkpoint(src_dir), "NVFP4")

    def convert(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        packed, scale, scale_2 = nvfp4_from_float(tensor)
        module = name.removesuffix(".weight")
        return {
            name: packed,
            f"{module}.weight_scale": scale,
            f"{module}.weight_scale_2": scale_2,
            f"{module}.input_scale": torch.tensor(input_scale, dtype=torch.float32),
        }

    algo = {"quant_algo": "NVFP4", "group_size": NV_BLOCK}
    return _export(
        src_dir,
        out_dir,
        convert,
        lambda ckpt, name, t: _is_quantizable(name, t, experts_only, ckpt, NV_BLOCK),
        lambda ignore: {"quant_method": "modelopt", **algo, "ignore": ignore},
        legacy={**algo, "kv_cache_quant_algo": None},
    )


def export_mxfp4(src_dir: str | Path, out_dir: str | Path) -> Path:
    """Write an MXFP4 checkpoint (routed experts only, by the FP4 reference rule) to `out_dir`.

    Per-expert architectures get `weight` uint8 [N, K/2] + `weight_scale` uint8 UE8M0 [N, K/32];
    gpt-oss gets its fused naming: `{gate_up,down}_proj_blocks` uint8 [E, N, K/32, 16] and
    `_scales` [E, N, K/32], in HF linear orientation (the bf16 [E, K, N] tensor transposed), gate/up
    rows interleaved as in the source; biases stay float. config.json gets
    `{"quant_method": "mxfp4", "modules_to_not_convert": [...]}`.
    """

    def convert(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        if tensor.dim() == 3:
            e, k, n = tensor.shape
            packed, scales = fp4_from_float(tensor.transpose(1, 2).reshape(e * n, k))
            groups = k // MX_BLOCK
            return {f"{name}_blocks": packed.reshape(e, n, groups, MX_BLOCK // 2), f"{name}_scales": scales.reshape(e, n, groups)}
        packed, scales = fp4_from_float(tensor)
        return {name: packed, f"{name.removesuffix('.weight')}.weight_scale": scales}

    def quantized(ckpt: Checkpoint, name: str, tensor: torch.Tensor) -> bool:
        fused = ckpt.scheme.match_fused(name)
        if fused is not None:
            return fused[2] == ""
        return _is_quantizable(name, tensor, True, ckpt, MX_BLOCK)

    return _export(src_dir, out_dir, convert, quantized, lambda ignore: {"quant_method": "mxfp4", "modules_to_not_convert": ignore})


def export_fp8_block(src_dir: str | Path, out_dir: str | Path, *, experts_only: bool = True) -> Path:
    """Write a DeepSeek-style FP8 block checkpoint: `weight` float8_e4m3fn + float32 `weight_scale_inv` per 128×128.

    `experts_only` as in export_nvfp4. config.json gets `{"quant_method": "fp8", "fmt": "e4m3",
    "activation_scheme": "dynamic", "weight_block_size": [128, 128], "ignored_layers": [...]}`.
    """
    _refuse_fused(open_checkpoint(src_dir), "FP8 block")

    def convert(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        weight, scale_inv = fp8_block_from_float(tensor)
        return {name: weight, f"{name.removesuffix('.weight')}.weight_scale_inv": scale_inv}

    return _export(
        src_dir,
        out_dir,
        convert,
        lambda ckpt, name, t: _is_quantizable(name, t, experts_only, ckpt, 1),
        lambda ignore: {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
            "ignored_layers": ignore,
        },
    )


def export_dequantized(src_dir: str | Path, out_dir: str | Path) -> Path:
    """Write a BF16 checkpoint whose NVFP4 linears are the source's values rounded once to bf16.

    The reference the serving benchmark compares 2-bit experts with, where a checkpoint ships as
    NVFP4 only (the embedded default model): same architecture, every weight in bf16.
    """
    src, out = Path(src_dir), Path(out_dir)
    ckpt = open_checkpoint(src)
    if ckpt.quant != "nvfp4":
        raise CheckpointError(f"{src}: is {ckpt.quant}, not NVFP4; nothing to dequantize")
    with _atomic_directory(out) as tmp:
        weight_map: dict[str, str] = {}
        for path in ckpt.shards:
            with SafetensorsFile(path) as shard:
                raw = {name: shard.read(name) for name in shard.tensors}
            tensors = {}
            for name, tensor in raw.items():
                module = name.removesuffix(".weight")
                if name.endswith((".weight_scale", ".weight_scale_2", ".input_scale")):
                    continue
                if f"{module}.weight_scale_2" in raw:
                    scale = expand_blocks(scale_values(raw[f"{module}.weight_scale"].view(torch.uint8), "nv16"), NV_BLOCK)
                    tensor = (decode_fp4(tensor) * scale * raw[f"{module}.weight_scale_2"].double()).to(torch.bfloat16)
                tensors[name] = tensor
            save_file(tensors, tmp / path.name, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, path.name))
        _finish_directory(src, tmp, weight_map, {k: v for k, v in ckpt.config.items() if k != "quantization_config"})
    return out
