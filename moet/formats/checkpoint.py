"""Checkpoint discovery: shards, architecture and quantization format of a HF model directory.

Only headers and JSON are read here; tensors are read later, one at a time (moet.formats.experts).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from moet.errors import CheckpointError
from moet.formats.naming import SCHEMES, Scheme
from moet.formats.safetensors_io import SafetensorsFile

QuantFormat = Literal["nvfp4", "mxfp4", "fp8_block", "float"]
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
FP8_BLOCK = [128, 128]


@dataclass
class Checkpoint:
    root: Path
    config: dict[str, Any]
    architecture: str
    scheme: Scheme
    quant: QuantFormat
    ignore: tuple[str, ...]  # modules the quantization config leaves unquantized
    shards: list[Path]


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror})") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc


def modelopt_format(cfg: dict[str, Any], where: Path) -> tuple[QuantFormat, tuple[str, ...]]:
    algo = cfg.get("quant_algo")
    if algo != "NVFP4":
        raise CheckpointError(f"{where}: modelopt quant_algo {algo!r} is not supported; only NVFP4 is")
    if cfg.get("group_size", 16) != 16:
        raise CheckpointError(f"{where}: NVFP4 group_size {cfg['group_size']} is not supported; it must be 16")
    return "nvfp4", tuple(cfg.get("exclude_modules") or cfg.get("ignore") or ())


def quantization_config_format(cfg: dict[str, Any], where: Path) -> tuple[QuantFormat, tuple[str, ...]]:
    """Format and unquantized modules named by a `quantization_config` (flat form); also what the
    vLLM plugin reads from the dict vLLM hands it."""
    method = cfg.get("quant_method")
    if method == "modelopt":
        return modelopt_format(cfg, where)
    if method == "mxfp4":
        return "mxfp4", tuple(cfg.get("modules_to_not_convert") or ())
    if method == "fp8":
        block = cfg.get("weight_block_size")
        if block != FP8_BLOCK:
            raise CheckpointError(f"{where}: fp8 weight_block_size {block!r} is not supported; only {FP8_BLOCK} blocks are")
        return "fp8_block", tuple(cfg.get("ignored_layers") or cfg.get("modules_to_not_convert") or ())
    raise CheckpointError(f"{where}: quantization_config quant_method {method!r} is not supported (modelopt NVFP4, mxfp4, fp8 block)")


def quant_format(root: Path, config: dict[str, Any]) -> tuple[QuantFormat, tuple[str, ...]]:
    """The checkpoint's weight format from hf_quant_config.json and/or config.json quantization_config."""
    found: list[tuple[QuantFormat, tuple[str, ...]]] = []
    legacy = root / "hf_quant_config.json"
    if legacy.exists():
        raw = _load_json(legacy)
        if not isinstance(raw, dict) or not isinstance(raw.get("quantization"), dict):
            raise CheckpointError(f"{legacy}: expected {{'quantization': {{'quant_algo': ...}}}}")
        found.append(modelopt_format(raw["quantization"], legacy))
    if isinstance(config.get("quantization_config"), dict):
        found.append(quantization_config_format(config["quantization_config"], root / "config.json"))
    if not found:
        return "float", ()
    if len({fmt for fmt, _ in found}) > 1:
        raise CheckpointError(f"{root}: hf_quant_config.json and config.json name different formats {[f for f, _ in found]}; remove one")
    return found[0][0], tuple(dict.fromkeys(m for _, mods in found for m in mods))


def _inside(name: object) -> bool:
    """A shard name the index may use: a relative path below the checkpoint directory (no `..`)."""
    if not isinstance(name, str) or not name or "\0" in name:
        return False
    path = Path(name)
    return not path.is_absolute() and ".." not in path.parts and path.parts != ()


def shard_paths(root: Path) -> list[Path]:
    """The safetensors files of a checkpoint, from its index or the single model.safetensors."""
    index = root / INDEX
    if index.exists():
        raw = _load_json(index)
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no weight_map; the index is corrupt")
        for name in weight_map.values():
            if not _inside(name):
                raise CheckpointError(f"{index}: shard name {name!r} is not a file name inside {root}; the index is corrupt or hostile")
        files = sorted(set(weight_map.values()))
        for name in files:
            if not (root / name).is_file():
                raise CheckpointError(f"{index}: shard {name} is missing from {root}")
        return [root / name for name in files]
    if (root / SINGLE).is_file():
        return [root / SINGLE]
    raise CheckpointError(f"{root}: neither {INDEX} nor {SINGLE} found; point at a HF safetensors checkpoint directory")


def open_checkpoint(model_dir: str | Path) -> Checkpoint:
    """Discover a checkpoint: config, architecture, format and shard list (headers are not read yet)."""
    root = Path(model_dir)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a directory; pass a HF checkpoint directory")
    config = _load_json(root / "config.json")
    archs = config.get("architectures") if isinstance(config, dict) else None
    arch = archs[0] if isinstance(archs, list) and archs else None
    if arch not in SCHEMES:
        raise CheckpointError(f"{root / 'config.json'}: architecture {arch!r} is not supported; supported: {', '.join(SCHEMES)}")
    quant, ignore = quant_format(root, config)
    return Checkpoint(root, config, arch, SCHEMES[arch], quant, ignore, shard_paths(root))


def open_shards(ckpt: Checkpoint) -> list[SafetensorsFile]:
    """Every shard with its header validated, before any tensor is read."""
    return [SafetensorsFile(path) for path in ckpt.shards]
