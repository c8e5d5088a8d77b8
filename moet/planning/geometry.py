"""What a checkpoint holds, from its config.json and safetensors headers alone: no tensor byte is read.

Routed experts are found with the architecture's naming scheme (moet.formats.naming), the one the
loader streams. Everything else is dense and is served in the model dtype (the plugin dequantizes
NVFP4 and FP8-block dense linears at load, moet.vllm.linear), so it is counted at that size and its
scale tensors are not. Layers at or past num_hidden_layers are MTP heads, which vLLM does not load
unless asked to: they are reported, not counted.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moet.errors import CheckpointError
from moet.formats.checkpoint import open_checkpoint, open_shards
from moet.formats.safetensors_io import TensorInfo
from moet.quant.codebook import Tier
from moet.store.layout import RowLayout

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
SCALE_SUFFIXES = ("weight_scale", "weight_scale_2", "weight_scale_inv", "input_scale", "k_scale", "v_scale")
BASE_FIELDS = ("codes", "scales", "row_scale")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class Geometry:
    """Sizes that decide where a model's parts can live (bytes unless named otherwise)."""

    root: str
    architecture: str
    quant: str  # the routed experts' checkpoint format
    scale_kind: str  # the base's block scales: nv16 (an NVFP4 source keeps e4m3/16) or mx32 (UE8M0/32)
    hidden: int
    inter: int
    experts: int  # routed experts per MoE layer
    top_k: int
    layers: int  # num_hidden_layers: every one has attention and a KV cache
    moe_layers: int
    vocab: int
    dtype_bytes: int
    context: int  # max_position_embeddings
    dense_bytes: int  # as served: model dtype, scales dropped
    expert_source_bytes: int
    skipped_layers: tuple[int, ...]  # MTP layers in the checkpoint, not loaded
    skipped_bytes: int
    attention: str  # "MLA" (one latent per token and layer) or "GQA"
    kv_heads: int  # GQA key/value heads (MLA: 1 latent)
    kv_head_bytes: int  # bytes per token, layer and KV head (GQA: K and V)

    def layout(self, tier: Tier = Tier.NONE) -> RowLayout:
        """The pack row of one expert (w13 [2I, H], w2 [H, I]); its fields count the tiers' bytes."""
        return RowLayout.for_moe(self.hidden, self.inter, self.scale_kind, tier)

    @property
    def routed_experts(self) -> int:
        return self.moe_layers * self.experts

    @property
    def base_bytes_per_expert(self) -> int:
        """The 2-bit base as the GPU and the host hold it: codes, block scales and f32 row scales."""
        return sum(f.nbytes for f in self.layout().fields if f.name in BASE_FIELDS)

    def tier_bytes_per_expert(self, tier: Tier) -> int:
        """One expert's FP4 tier: PLANES (4 bits/weight: a GPU pool slot, its host copy) or REFINE (2.5)."""
        return sum(f.nbytes for f in self.layout(tier).fields if f.name not in BASE_FIELDS)

    @property
    def base_bits_per_weight(self) -> float:
        return 8 * self.base_bytes_per_expert / (3 * self.hidden * self.inter)

    def kv_bytes(self, tokens: int, gpus: int = 1) -> int:
        """KV cache of `tokens` tokens on one of `gpus` tensor-parallel ranks: GQA heads are split (at
        least one per rank), an MLA latent is replicated on every rank."""
        heads = self.kv_heads if self.attention == "MLA" else max(1, self.kv_heads // gpus)
        return tokens * self.layers * heads * self.kv_head_bytes


def _int(config: dict[str, Any], where: Path, *keys: str) -> int:
    for key in keys:
        if isinstance(config.get(key), int):
            return config[key]
    raise CheckpointError(f"{where}: no {' or '.join(keys)}; is this the model's own config.json?")


def _attention(config: dict[str, Any], where: Path, hidden: int, dtype_bytes: int) -> tuple[str, int, int]:
    if config.get("kv_lora_rank"):
        return "MLA", 1, (config["kv_lora_rank"] + _int(config, where, "qk_rope_head_dim")) * dtype_bytes
    heads = _int(config, where, "num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    return "GQA", kv_heads, 2 * head_dim * dtype_bytes


def _expert_matrix(info: TensorInfo) -> tuple[int, int]:
    """Logical [N, K] of a per-expert weight: packed FP4 holds two weights per byte."""
    n, cols = info.shape
    return (n, 2 * cols) if info.dtype == "U8" else (n, cols)


def _fused_matrix(info: TensorInfo, suffix: str) -> tuple[int, int, int]:
    """(E, N, K) of a gpt-oss fused tensor: MXFP4 blocks [E, N, K/32, 16] or float [E, K, N]."""
    if suffix == "_blocks":
        e, n, groups, _ = info.shape
        return e, n, groups * 32
    e, k, n = info.shape
    return e, n, k


def read_geometry(model_dir: str | Path) -> Geometry:
    """The geometry of a checkpoint directory; CheckpointError (naming the file) when it cannot be planned."""
    ckpt = open_checkpoint(model_dir)
    cfg, where = ckpt.config, ckpt.root / "config.json"
    layers = _int(cfg, where, "num_hidden_layers")
    hidden = _int(cfg, where, "hidden_size")
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    if dtype not in DTYPE_BYTES:
        raise CheckpointError(f"{where}: torch_dtype {dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    dtype_bytes = DTYPE_BYTES[dtype]
    tensors = {name: info for f in open_shards(ckpt) for name, info in f.tensors.items()}
    scheme = ckpt.scheme
    dense = expert_source = skipped = 0
    skipped_layers: set[int] = set()
    moe_layers: set[int] = set()
    experts = 0
    shapes: dict[str, set[tuple[int, int]]] = {"gate": set(), "up": set(), "down": set()}
    for name, info in tensors.items():
        m = _LAYER.match(name)
        if m and int(m[1]) >= layers:
            skipped += info.nbytes
            skipped_layers.add(int(m[1]))
            continue
        if (hit := scheme.match_per_expert(name)) is not None:
            layer, expert, proj, suffix = hit
            expert_source += info.nbytes
            moe_layers.add(layer)
            experts = max(experts, expert + 1)
            if suffix == "weight":
                shapes[proj].add(_expert_matrix(info))
        elif (fused := scheme.match_fused(name)) is not None:
            layer, proj, suffix = fused
            expert_source += info.nbytes
            moe_layers.add(layer)
            if suffix in ("_blocks", ""):
                e, n, k = _fused_matrix(info, suffix)
                experts = max(experts, e)
                if proj == "gate_up_proj":
                    shapes["gate"].add((n // 2, k))
                    shapes["up"].add((n // 2, k))
                else:
                    shapes["down"].add((n, k))
        elif name.rsplit(".", 1)[-1] not in SCALE_SUFFIXES:
            packed = info.dtype == "U8" and f"{name.rsplit('.', 1)[0]}.weight_scale" in tensors
            dense += math.prod(info.shape) * (2 if packed else 1) * dtype_bytes
    if not moe_layers:
        raise CheckpointError(f"{ckpt.root}: no routed experts found ({ckpt.architecture} naming); nothing for moet to plan")
    if any(len(s) != 1 for s in shapes.values()):
        raise CheckpointError(f"{ckpt.root}: routed experts of several shapes {shapes}; moet serves one expert shape per model")
    (inter, k_gate), (hidden_down, inter_down) = next(iter(shapes["gate"])), next(iter(shapes["down"]))
    if (k_gate, hidden_down, inter_down) != (hidden, hidden, inter) or shapes["up"] != shapes["gate"]:
        raise CheckpointError(f"{ckpt.root}: expert shapes {shapes} do not match hidden_size {hidden}; the checkpoint is inconsistent")
    attention, kv_heads, kv_head_bytes = _attention(cfg, where, hidden, dtype_bytes)
    return Geometry(
        root=str(ckpt.root), architecture=ckpt.architecture, quant=ckpt.quant,
        scale_kind="nv16" if ckpt.quant == "nvfp4" else "mx32",
        hidden=hidden, inter=inter, experts=experts,
        top_k=_int(cfg, where, "num_experts_per_tok", "experts_per_token"),
        layers=layers, moe_layers=len(moe_layers), vocab=_int(cfg, where, "vocab_size"), dtype_bytes=dtype_bytes,
        context=int(cfg.get("max_position_embeddings") or 0), dense_bytes=dense, expert_source_bytes=expert_source,
        skipped_layers=tuple(sorted(skipped_layers)), skipped_bytes=skipped,
        attention=attention, kv_heads=kv_heads, kv_head_bytes=kv_head_bytes,
    )
