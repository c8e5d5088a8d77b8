"""The `moet` quantization config: claims the routed experts of FP4/FP8/BF16 MoE checkpoints.

With VLLM_MOE_W2=1, `override_quantization_method` takes NVFP4 (modelopt), MXFP4 and FP8-block
checkpoints before vLLM's own methods; a BF16 checkpoint is claimed with `--quantization moet`
(what `moet serve` passes). Routed experts get `MoetMoEMethod`; dense linears keep vLLM's
unquantized method, or are dequantized at load where the checkpoint quantized them
(`DequantLinearMethod`: vLLM's CPU build has no NVFP4 or FP8-block linear kernel).
"""

from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase

from moet.errors import CheckpointError
from moet.formats.checkpoint import modelopt_format, quantization_config_format
from moet.knobs import Knobs

if TYPE_CHECKING:
    from moet.vllm.engine import MoetEngine

NAME = "moet"
# vLLM renames a gpt-oss checkpoint's `quant_method: mxfp4` to this before `from_config` sees it.
VLLM_GPT_OSS_MXFP4 = "gpt_oss_mxfp4"


def source_kind(quant_config: dict[str, Any] | None) -> tuple[str, list[str]]:
    """(source kind, unquantized module patterns) of the quantization config dict vLLM passes:
    modelopt NVFP4 (flat or legacy `quantization` form), MXFP4, FP8 128×128 blocks, or none."""
    if not quant_config:
        return "float", []
    where = Path("config.json")
    legacy = quant_config.get("quantization")
    if isinstance(legacy, dict):
        kind, ignore = modelopt_format(legacy, where)
    elif quant_config.get("quant_method") == VLLM_GPT_OSS_MXFP4:
        kind, ignore = quantization_config_format({**quant_config, "quant_method": "mxfp4"}, where)
    else:
        kind, ignore = quantization_config_format(quant_config, where)
    return kind, list(ignore)


def is_ignored(prefix: str, patterns: list[str], fused: dict[str, list[str]]) -> bool:
    """Whether a module is in the checkpoint's unquantized list (names, prefixes or globs).

    A fused vLLM module (qkv_proj, gate_up_proj) is matched through the checkpoint names of its
    parts, which must all agree.
    """
    proj = prefix.rsplit(".", 1)[-1]
    names = [prefix[: -len(proj)] + part for part in fused[proj]] if proj in fused else [prefix]
    hits = [any(fnmatch.fnmatch(n, p) or n == p or n.startswith(p + ".") for p in patterns) for n in names]
    if any(hits) and not all(hits):
        raise CheckpointError(f"{prefix}: the parts {names} of this fused layer are not all quantized the same way")
    return all(hits)


class MoetConfig(QuantizationConfig):
    """2-bit routed experts (plus the FP4 tier and tiers per the knobs) over a checkpoint's source format."""

    def __init__(self, kind: str = "float", ignore: list[str] | None = None) -> None:
        super().__init__()
        self.kind = kind
        self.ignore = ignore or []
        self.knobs = Knobs.from_env()
        self.engine: "MoetEngine | None" = None  # the model's engine state, made by its first MoE layer

    def __getstate__(self) -> dict[str, Any]:
        """The config travels to vLLM's engine processes before any model is built; an engine never does."""
        return {**self.__dict__, "engine": None}

    def __repr__(self) -> str:
        return f"MoetConfig(kind={self.kind}, ignore={self.ignore})"

    @classmethod
    def get_name(cls) -> str:
        return NAME

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 80

    @classmethod
    def get_config_filenames(cls) -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "MoetConfig":
        kind, ignore = source_kind({k: v for k, v in config.items() if not k.startswith("_")})
        return cls(kind, ignore)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: dict[str, Any], user_quant: str | None, hf_config: Any = None) -> str | None:
        if user_quant not in (None, NAME) or not Knobs.from_env().w2:
            return None
        try:
            source_kind(hf_quant_cfg)
        except CheckpointError:
            return None
        return NAME

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, RoutedExperts):
            from moet.vllm.moe import MoetMoEMethod

            return MoetMoEMethod(layer.moe_config, self)
        if isinstance(layer, LinearBase):
            # MXFP4 checkpoints (gpt-oss) quantize the routed experts only, as vLLM's own MXFP4 config assumes.
            if self.kind in ("float", "mxfp4") or is_ignored(prefix, self.ignore, dict(self.packed_modules_mapping)):
                return UnquantizedLinearMethod()
            from moet.vllm.linear import DequantLinearMethod

            return DequantLinearMethod(self.kind)
        return None
