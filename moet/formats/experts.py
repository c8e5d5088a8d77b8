"""Stream a checkpoint's routed-expert matrices as SourceWeights, layer by layer, validating each tensor.

Every header is validated first (moet.formats.safetensors_io); then each expert's tensors are read
one projection at a time (a gpt-oss fused tensor: one per layer), so memory stays at one layer's
transients whatever the checkpoint's size. Any defect is a CheckpointError naming tensor and file.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import torch

from moet.errors import CheckpointError
from moet.formats.checkpoint import Checkpoint, open_checkpoint, open_shards
from moet.formats.naming import Scheme
from moet.formats.safetensors_io import SafetensorsFile
from moet.formats.source import ExpertKey, Projection, SourceKind, SourceWeight
from moet.knobs import Knobs
from moet.quant.codebook import unpack_nibbles, zero_counts, zero_policy_from_counts
from moet.quant.reference import MX_BLOCK, fp4_from_float
from moet.quant.scales import scale_values

FLOAT_TAGS = ("BF16", "F16", "F32")
FP8_BLOCK = 128
NV_BLOCK = 16
PROJ_ORDER: dict[Projection, int] = {"gate": 0, "up": 1, "down": 2}


class _Tensors:
    """Name → shard lookup with checks that name the tensor and its file."""

    def __init__(self, files: list[SafetensorsFile]) -> None:
        self.where = {name: f for f in files for name in f.tensors}

    def fail(self, name: str, problem: str) -> CheckpointError:
        return CheckpointError(f"{self.where[name].path}: tensor {name}: {problem}")

    def expect(self, name: str, tags: tuple[str, ...], shapes: list[tuple[int, ...]], what: str) -> None:
        info = self.where[name].tensors[name]
        if info.dtype not in tags or info.shape not in shapes:
            wanted = " or ".join(f"{'/'.join(tags)}{list(s)}" for s in shapes)
            raise self.fail(name, f"is {info.dtype}{list(info.shape)}, expected {wanted} ({what}); re-export the checkpoint")

    def require(self, parts: dict[str, str], suffix: str, beside: str, what: str) -> str:
        if suffix not in parts:
            raise self.fail(beside, f"has no {suffix} beside it ({what}); the checkpoint is incomplete")
        return parts[suffix]

    def read(self, name: str) -> torch.Tensor:
        return self.where[name].read(name)

    def finite(self, name: str, values: torch.Tensor) -> None:
        bad = int((~torch.isfinite(values)).sum())
        if bad:
            raise self.fail(name, f"{bad} of {values.numel()} values are NaN or Inf; the checkpoint is corrupt")

    def file(self, name: str) -> str:
        return str(self.where[name].path)


def _k_multiple(t: _Tensors, name: str, k: int, block: int, what: str) -> None:
    if k % block:
        raise t.fail(name, f"K={k} is not a multiple of {block} ({what})")


def _per_expert(t: _Tensors, ckpt: Checkpoint, key: ExpertKey, parts: dict[str, str]) -> SourceWeight:
    module = ckpt.scheme.module(key.layer, key.expert, key.proj)
    if "weight" not in parts:
        raise t.fail(next(iter(parts.values())), f"expert {module} has {sorted(parts)} but no weight")
    name = parts["weight"]
    info = t.where[name].tensors[name]
    if len(info.shape) != 2:
        raise t.fail(name, f"is {info.dtype}{list(info.shape)}, expected a 2-D [N, K] expert matrix")
    n, cols = info.shape
    if info.dtype in FLOAT_TAGS:
        _k_multiple(t, name, cols, MX_BLOCK, "the FP4 reference rule works on blocks of 32 along K")
        data = t.read(name)
        t.finite(name, data)
        return SourceWeight(name, key, "float", data, None, None, t.file(name))
    if ckpt.quant == "nvfp4":
        k = 2 * cols
        t.expect(name, ("U8",), [(n, cols)], "NVFP4 packed e2m1")
        _k_multiple(t, name, k, NV_BLOCK, "NVFP4 scales cover 16 weights")
        scale = t.require(parts, "weight_scale", name, "NVFP4 per-16 e4m3 block scales")
        t.expect(scale, ("F8_E4M3",), [(n, k // NV_BLOCK)], "NVFP4 per-16 e4m3 block scales")
        scale_2 = t.require(parts, "weight_scale_2", name, "NVFP4 per-tensor float32 weight_scale_2")
        t.expect(scale_2, ("F32",), [(), (1,)], "NVFP4 per-tensor float32 weight_scale_2")
        bits = t.read(scale).view(torch.uint8)
        t.finite(scale, scale_values(bits, "nv16"))
        s2 = t.read(scale_2).reshape(())
        t.finite(scale_2, s2)
        return SourceWeight(name, key, "nvfp4", t.read(name), bits, float(s2), t.file(name))
    if ckpt.quant == "mxfp4":
        k = 2 * cols
        t.expect(name, ("U8",), [(n, cols)], "MXFP4 packed e2m1")
        _k_multiple(t, name, k, MX_BLOCK, "MXFP4 scales cover 32 weights")
        scale = t.require(parts, "weight_scale", name, "MXFP4 per-32 UE8M0 scales")
        t.expect(scale, ("U8", "F8_E8M0"), [(n, k // MX_BLOCK)], "MXFP4 per-32 UE8M0 scales")
        bits = t.read(scale).view(torch.uint8)
        t.finite(scale, scale_values(bits, "mx32"))
        return SourceWeight(name, key, "mxfp4", t.read(name), bits, None, t.file(name))
    if ckpt.quant == "fp8_block":
        t.expect(name, ("F8_E4M3",), [(n, cols)], "FP8 block weight")
        _k_multiple(t, name, cols, MX_BLOCK, "the FP4 reference rule works on blocks of 32 along K")
        scale = t.require(parts, "weight_scale_inv", name, "FP8 per-128x128 float32 weight_scale_inv")
        grid = (math.ceil(n / FP8_BLOCK), math.ceil(cols / FP8_BLOCK))
        t.expect(scale, ("F32",), [grid], "FP8 per-128x128 float32 weight_scale_inv")
        data = t.read(name)
        t.finite(name, data.to(torch.float32))
        scales = t.read(scale)
        t.finite(scale, scales)
        return SourceWeight(name, key, "fp8_block", data, scales, None, t.file(name))
    raise t.fail(name, f"is {info.dtype} but {ckpt.root} declares no quantization format for it; add its quantization config")


def _fused_mxfp4(t: _Tensors, scheme: Scheme, layer: int, proj: str, parts: dict[str, str]) -> Iterator[SourceWeight]:
    name = parts["_blocks"]
    info = t.where[name].tensors[name]
    if info.dtype != "U8" or len(info.shape) != 4 or info.shape[-1] != MX_BLOCK // 2:
        raise t.fail(name, f"is {info.dtype}{list(info.shape)}, expected U8[E, N, K/32, 16] (gpt-oss MXFP4 blocks)")
    e, n, groups, _ = info.shape
    scale = t.require(parts, "_scales", name, "gpt-oss MXFP4 UE8M0 scales")
    t.expect(scale, ("U8", "F8_E8M0"), [(e, n, groups)], "gpt-oss MXFP4 per-32 UE8M0 scales")
    blocks = t.read(name).reshape(e, n, groups * MX_BLOCK // 2)
    scales = t.read(scale).view(torch.uint8)
    t.finite(scale, scale_values(scales, "mx32"))
    nibbles = (unpack_nibbles(blocks[i]) for i in range(e))
    yield from _fused_slices(scheme, layer, proj, "mxfp4", blocks, scales, t.file(name), nibbles)


def _fused_float(t: _Tensors, scheme: Scheme, layer: int, proj: str, parts: dict[str, str]) -> Iterator[SourceWeight]:
    name = parts[""]
    info = t.where[name].tensors[name]
    if info.dtype not in FLOAT_TAGS or len(info.shape) != 3:
        raise t.fail(name, f"is {info.dtype}{list(info.shape)}, expected a float [E, K, N] gpt-oss expert tensor")
    _k_multiple(t, name, info.shape[1], MX_BLOCK, "the FP4 reference rule works on blocks of 32 along K")
    # gpt-oss stores x @ W layouts [E, K, N]: the HF linear weight [N, K] of expert e is the transpose.
    weights = t.read(name).transpose(1, 2)
    t.finite(name, weights)
    nibbles = (unpack_nibbles(fp4_from_float(w)[0]) for w in weights)
    yield from _fused_slices(scheme, layer, proj, "float", weights, None, t.file(name), nibbles)


def _fused_slices(
    scheme: Scheme,
    layer: int,
    proj: str,
    kind: SourceKind,
    data: torch.Tensor,
    scales: torch.Tensor | None,
    file: str,
    nibbles: Iterator[torch.Tensor],
) -> Iterator[SourceWeight]:
    """Per-expert slices of a fused [E, N, ...] tensor, sharing the zero policy of all its FP4 `nibbles`.

    gpt-oss gate_up rows interleave gate (even) and up (odd); down is whole.
    """
    counts = [zero_counts(chunk) for chunk in nibbles]
    policy = zero_policy_from_counts(sum(c[0] for c in counts), sum(c[1] for c in counts))
    n = data.shape[1]
    views: list[tuple[slice, Projection]] = [(slice(0, n, 2), "gate"), (slice(1, n, 2), "up")] if proj == "gate_up_proj" else [(slice(0, n), "down")]
    for expert in range(data.shape[0]):
        for rows, p in views:
            part_scales = None if scales is None else scales[expert, rows].contiguous()
            yield SourceWeight(scheme.module(layer, expert, p) + ".weight", ExpertKey(layer, expert, p), kind, data[expert, rows].contiguous(), part_scales, None, file, policy)


class RoutedExperts:
    """A checkpoint's routed-expert matrices: headers validated on open, `len()` known, tensors streamed on iteration.

    With `drop_pages` (default: VLLM_MOE_W2_DROP_SOURCE_PAGES) the shards' pages read for a layer leave
    the page cache once the consumer asks for the next layer, so the cache holds about one layer.
    """

    def __init__(self, model_dir: str | Path, drop_pages: bool | None = None) -> None:
        self.drop_pages = Knobs.from_env().drop_source_pages if drop_pages is None else drop_pages
        self.checkpoint = open_checkpoint(model_dir)
        self._files = open_shards(self.checkpoint)
        self._t = _Tensors(self._files)
        scheme = self.checkpoint.scheme
        self._per_expert: dict[int, dict[ExpertKey, dict[str, str]]] = defaultdict(lambda: defaultdict(dict))
        self._fused: dict[int, dict[str, dict[str, str]]] = defaultdict(lambda: defaultdict(dict))
        for name in self._t.where:
            if (m := scheme.match_per_expert(name)) is not None:
                layer, expert, proj, suffix = m
                self._per_expert[layer][ExpertKey(layer, expert, proj)][suffix] = name
            elif (f := scheme.match_fused(name)) is not None:
                layer, fused_proj, suffix = f
                self._fused[layer][fused_proj][suffix] = name

    def __len__(self) -> int:
        total = sum(len(keys) for keys in self._per_expert.values())
        for layer in self._fused.values():
            for proj, parts in layer.items():
                main = parts.get("_blocks", parts.get(""))
                if main is not None:
                    experts = self._t.where[main].tensors[main].shape[0]
                    total += experts * (2 if proj == "gate_up_proj" else 1)
        return total

    def __iter__(self) -> Iterator[SourceWeight]:
        t, ckpt = self._t, self.checkpoint
        for layer in sorted(self._per_expert.keys() | self._fused.keys()):
            for key in sorted(self._per_expert[layer], key=lambda k: (k.expert, PROJ_ORDER[k.proj])):
                yield _per_expert(t, ckpt, key, self._per_expert[layer][key])
            for proj in ("gate_up_proj", "down_proj"):
                parts = self._fused[layer].get(proj, {})
                if "_blocks" in parts:
                    yield from _fused_mxfp4(t, ckpt.scheme, layer, proj, parts)
                elif "" in parts:
                    yield from _fused_float(t, ckpt.scheme, layer, proj, parts)
            if self.drop_pages:
                for f in self._files:
                    f.drop_read_pages()

    def close(self) -> None:
        for f in self._files:
            f.close()

    def __enter__(self) -> RoutedExperts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def iter_routed_experts(model_dir: str | Path) -> Iterator[SourceWeight]:
    """Every routed-expert matrix of a checkpoint, in layer order; dense layers and shared experts are skipped."""
    with RoutedExperts(model_dir) as experts:
        yield from experts
