"""Checkpoint → pack: stream the routed experts, quantize them layer by layer, write the rank's pack.

This is what `moet quantize --store DIR` and the plugin's first load call; a later load finds the
pack complete (same checkpoint identity and quantizer ABI) and skips quantization altogether.
"""

from __future__ import annotations

import hashlib
import struct
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch

from moet.errors import CheckpointError
from moet.formats.checkpoint import open_checkpoint
from moet.formats.experts import RoutedExperts
from moet.formats.source import SourceWeight, shard_for_rank
from moet.quant.codebook import QuantizedWeight, Tier, fp4_nibbles, refinement_from_fp4, unpack_nibbles
from moet.quant.requant import dequantize_fp8_block, requantize
from moet.quant.scales import ScaleKind
from moet.store.layout import RowLayout
from moet.store.pack import Pack, PackWriter, open_pack


def checkpoint_identity(model_dir: str | Path) -> str:
    """A hash of config.json and every shard's name, size and safetensors header (no tensor bytes read)."""
    ckpt = open_checkpoint(model_dir)
    digest = hashlib.sha256((Path(model_dir) / "config.json").read_bytes())
    for shard in ckpt.shards:
        with open(shard, "rb") as f:
            head = f.read(8)
            header = f.read(struct.unpack("<Q", head)[0]) if len(head) == 8 else b""
        digest.update(f"{shard.name}\0{shard.stat().st_size}\0".encode() + header)
    return digest.hexdigest()


def fuse_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack matrices along N (gate rows then up rows → w13), keeping the FP4 tier exact.

    Halves quantized under different zero policies are re-expressed as one `parity` policy whose
    flips list every −0 (the refinement reconstructs zeros from the policy, not from the codes).
    """
    first = parts[0]
    cat = lambda name: None if getattr(first, name) is None else torch.cat([getattr(p, name) for p in parts])  # noqa: E731
    fused = QuantizedWeight(cat("codes"), cat("scales"), first.scale_kind, cat("row_scale"), first.zero_policy,
                            fp4=cat("fp4"), refine=cat("refine"), zero_sign=first.zero_sign)
    if first.refine is None:
        return fused
    if all((p.zero_policy, p.zero_sign) == (first.zero_policy, first.zero_sign) for p in parts):
        offsets, flips = 0, []
        for p in parts:
            flips.append(p.zero_flips + offsets)
            offsets += p.codes.shape[0] * p.shape[1]
        fused.zero_flips = torch.cat(flips)
        return fused
    nibbles = torch.cat([unpack_nibbles(fp4_nibbles(p)) for p in parts])
    fused.zero_policy, fused.zero_sign = "parity", 0
    fused.zero_flips = refinement_from_fp4(nibbles, "parity", 0)[1]
    return fused


def _layers(sources: Iterable[SourceWeight]) -> Iterator[tuple[int, dict[int, dict[str, SourceWeight]]]]:
    """Group the stream by layer (it arrives in layer order): layer → expert → projection."""
    current, group = None, defaultdict(dict)
    for src in sources:
        if current is not None and src.key.layer != current:
            yield current, group
            group = defaultdict(dict)
        current = src.key.layer
        group[src.key.expert][src.key.proj] = src
    if current is not None:
        yield current, group


def rank_slice(src: SourceWeight, rank: int, ranks: int) -> SourceWeight:
    """The slice of `src` that tensor-parallel rank `rank` of `ranks` serves (FP8 blocks are decoded
    first: their 128×128 scales do not split along a rank boundary), as the plugin slices it."""
    if ranks > 1 and src.kind == "fp8_block":
        src = SourceWeight(src.name, src.key, "float", dequantize_fp8_block(src.data, src.scales), None, None, src.file, src.zero_policy)
    return shard_for_rank(src, rank, ranks)


def write_pack_from_checkpoint(
    model_dir: str | Path, store_dir: str | Path, rank: int = 0, tier: Tier = Tier.NONE, ranks: int = 1,
    experts: Sequence[int] | None = None,
) -> Pack:
    """Write (or finish, or reuse) the pack of a checkpoint's routed experts; returns it opened.

    Rows hold w13 (gate then up) and w2 (down); pack layer i is the model's i-th MoE layer (dense
    layers have no row). Every expert is in every rank's pack, unless `experts` names the global ids
    of the experts rank `rank` holds under expert parallelism: then its rows are those, in that order.
    Under tensor parallelism (`ranks` > 1) rank `rank`'s pack holds its slice of each expert (rank_slice).
    """
    identity = checkpoint_identity(model_dir)
    writer: PackWriter | None = None
    quantize = lambda src: requantize(rank_slice(src, rank, ranks), tier)  # noqa: E731
    try:
        with RoutedExperts(model_dir) as stream:
            total = len(stream)
            for index, (layer, group) in enumerate(_layers(stream)):
                if experts is not None and not set(experts) <= group.keys():
                    raise CheckpointError(f"{model_dir}: layer {layer} has experts {sorted(group)}, not all of {list(experts)}")
                held = [group[e] for e in (sorted(group) if experts is None else experts)]
                if writer is None:
                    gate, down = held[0]["gate"], held[0]["down"]
                    if down.shape != (gate.shape[1], gate.shape[0]):
                        raise CheckpointError(f"{down.file}: {down.name} is {down.shape}, expected {(gate.shape[1], gate.shape[0])}")
                    inter = gate.shape[0] // ranks
                    layout = RowLayout.for_moe(gate.shape[1], inter, ScaleKind.of_source(gate.kind), tier)
                    layers = total // (3 * len(group))
                    pack = open_pack(store_dir, rank, identity, layout, len(held), layers, experts)
                    if pack is not None:
                        return pack
                    writer = PackWriter(store_dir, rank, identity, layout, len(held), layers, experts)
                if index in writer.pending:
                    writer.write_layer(index, ([fuse_rows([quantize(p["gate"]), quantize(p["up"])]), quantize(p["down"])]
                                               for p in held))
        if writer is None:
            raise CheckpointError(f"{model_dir}: no routed experts found")
        return writer.finish()
    finally:
        if writer is not None:
            writer.close()
