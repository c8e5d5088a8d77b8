"""Per-rank pack files: the 2-bit base (and FP4 tier) of every (layer, expert) at a fixed offset.

A pack is `rank<R>.pack` (rows at (layer·E + expert)·stride, then each layer's refinement zero flips)
and its sidecar `rank<R>.json`. The sidecar is the commit record: it is replaced atomically after a
layer's bytes are fdatasync'ed, so a crash at any point leaves a pack that either resumes (same
identity and ABI) or rebuilds, and a layer is never read before it was completely written.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from moet.errors import MoetError
from moet.quant.codebook import QuantizedWeight, Tier
from moet.store.atomic import directory_error, ensure_writable_dir, free_bytes, replace_file
from moet.store.layout import PAGE, RowLayout, round_up

log = logging.getLogger("moet.store")

FORMAT_VERSION = 1
WRITE_CHUNK = 64 << 20  # bytes of rows serialized per write while a layer is written

ExpertWeights = Sequence[QuantizedWeight]  # one expert's matrices, in the layout's order


def pack_path(store_dir: Path | str, rank: int) -> Path:
    return Path(store_dir) / f"rank{rank}.pack"


def sidecar_path(store_dir: Path | str, rank: int) -> Path:
    return Path(store_dir) / f"rank{rank}.json"


@dataclass
class Sidecar:
    """What a pack holds and which layers of it are durable."""

    format_version: int
    tier: str
    experts: int
    layers: int
    slot_bytes: int
    base_span: int
    stride: int
    identity: str
    abi: str
    scale_kind: str
    matrices: list[list]  # [name, N, K]
    layers_written: list[int] = field(default_factory=list)
    layer_crc: dict[str, int] = field(default_factory=dict)  # crc32 of the layer's rows then its flips
    flips: dict[str, list[int]] = field(default_factory=dict)  # layer → [file offset, bytes]
    # Under expert parallelism the global ids of the rank's experts, in row order; None: every expert, in order.
    expert_ids: list[int] | None = None

    @classmethod
    def new(cls, layout: RowLayout, experts: int, layers: int, identity: str, expert_ids: Sequence[int] | None = None) -> "Sidecar":
        return cls(FORMAT_VERSION, layout.tier, experts, layers, layout.slot_bytes, layout.base_span,
                   layout.stride, identity, layout.abi(), layout.scale_kind,
                   [list(m) for m in layout.matrices], expert_ids=None if expert_ids is None else list(expert_ids))

    @classmethod
    def load(cls, path: Path) -> "Sidecar | None":
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def layout(self) -> RowLayout:
        return RowLayout(tuple((str(n), int(r), int(c)) for n, r, c in self.matrices), self.scale_kind, self.tier)

    @property
    def rows_end(self) -> int:
        return self.layers * self.experts * self.stride

    @property
    def complete(self) -> bool:
        return sorted(self.layers_written) == list(range(self.layers))

    def mismatch(self, identity: str, layout: RowLayout | None, experts: int | None, layers: int | None,
                 expert_ids: Sequence[int] | None = None) -> str | None:
        """Why this pack cannot serve the asked checkpoint and quantizer, or None. With `experts` given, the
        pack must also hold exactly the experts `expert_ids` (None: all of them)."""
        if self.format_version != FORMAT_VERSION:
            return f"format version {self.format_version} != {FORMAT_VERSION}"
        if self.identity != identity:
            return "checkpoint identity differs"
        try:
            own = self.layout()
        except ValueError as exc:
            return f"bad layout: {exc}"
        if self.abi != own.abi() or (self.slot_bytes, self.base_span, self.stride) != (own.slot_bytes, own.base_span, own.stride):
            return "quantizer ABI or row layout changed"
        if layout is not None and layout.abi() != self.abi:
            return "a different row layout or FP4 tier was asked for"
        if (experts is not None and experts != self.experts) or (layers is not None and layers != self.layers):
            return f"shape {self.layers}x{self.experts} != {layers}x{experts}"
        if experts is not None and self.expert_ids != (None if expert_ids is None else list(expert_ids)):
            return f"experts {self.expert_ids or 'all'} != {expert_ids or 'all'}"
        return None


class Pack:
    """A complete pack opened for reading (rows by offset; the reader pool does batched reads)."""

    def __init__(self, path: Path, sidecar: Sidecar) -> None:
        self.path = path
        self.sidecar = sidecar
        self.layout = sidecar.layout()
        self.experts = sidecar.experts
        self.layers = sidecar.layers
        self.stride = sidecar.stride
        self.fd = os.open(path, os.O_RDONLY)

    def offset(self, layer: int, expert: int) -> int:
        if not (0 <= layer < self.layers and 0 <= expert < self.experts):
            raise IndexError(f"(layer {layer}, expert {expert}) outside {self.layers}x{self.experts}")
        return (layer * self.experts + expert) * self.stride

    def read_row(self, layer: int, expert: int, nbytes: int | None = None) -> torch.Tensor:
        """One row as a fresh uint8 tensor (buffered read)."""
        nbytes = self.stride if nbytes is None else nbytes
        data = os.pread(self.fd, nbytes, self.offset(layer, expert))
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    def flips(self, layer: int, expert: int) -> list[torch.Tensor]:
        """The refinement zero flips of one expert's matrices (empty unless tier is refine)."""
        m = len(self.layout.matrices)
        place = self.sidecar.flips.get(str(layer))
        if place is None:
            return [torch.zeros(0, dtype=torch.int64) for _ in range(m)]
        blob = torch.frombuffer(bytearray(os.pread(self.fd, place[1], place[0])), dtype=torch.int64)
        counts = blob[: self.experts * m]
        starts = torch.cumsum(counts, 0) - counts + self.experts * m
        first = expert * m
        return [blob[int(starts[first + j]) : int(starts[first + j] + counts[first + j])].clone() for j in range(m)]

    def read_weights(self, layer: int, expert: int) -> list[QuantizedWeight]:
        """One expert's matrices with everything the FP4 tier needs (skips re-quantization)."""
        row = self.read_row(layer, expert)
        self.layout.header(row)
        return self.layout.read_row(row, self.flips(layer, expert))

    def verify(self) -> list[int]:
        """Written layers whose bytes no longer match the crc32 recorded when they were written."""
        bad = []
        for layer in self.sidecar.layers_written:
            crc = _crc_range(self.fd, layer * self.experts * self.stride, self.experts * self.stride)
            place = self.sidecar.flips.get(str(layer))
            if place is not None:
                crc = zlib.crc32(os.pread(self.fd, place[1], place[0]), crc)
            if crc != self.sidecar.layer_crc.get(str(layer)):
                bad.append(layer)
        return bad

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "Pack":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _crc_range(fd: int, offset: int, nbytes: int) -> int:
    crc = 0
    end = offset + nbytes
    while offset < end:
        chunk = os.pread(fd, min(WRITE_CHUNK, end - offset), offset)
        if not chunk:
            break
        crc = zlib.crc32(chunk, crc)
        offset += len(chunk)
    return crc


def open_pack(
    store_dir: Path | str,
    rank: int,
    identity: str,
    layout: RowLayout | None = None,
    experts: int | None = None,
    layers: int | None = None,
    expert_ids: Sequence[int] | None = None,
) -> Pack | None:
    """The rank's pack if it is complete and matches the checkpoint and quantizer (and, with `experts`
    given, holds the experts `expert_ids`; None: all); else None (rebuild)."""
    path, side = pack_path(store_dir, rank), sidecar_path(store_dir, rank)
    sidecar = Sidecar.load(side)
    if sidecar is None:
        log.info("pack %s: no valid sidecar, it will be (re)built", path)
        return None
    reason = sidecar.mismatch(identity, layout, experts, layers, expert_ids)
    if reason is None and not sidecar.complete:
        reason = f"{len(sidecar.layers_written)}/{sidecar.layers} layers written"
    if reason is None and (not path.exists() or path.stat().st_size < sidecar.rows_end):
        reason = "pack file shorter than its rows"
    if reason is not None:
        log.info("pack %s not used: %s", path, reason)
        return None
    return Pack(path, sidecar)


class PackWriter:
    """Writes a rank's pack layer by layer, resuming a compatible partial pack, rebuilding any other."""

    def __init__(self, store_dir: Path | str, rank: int, identity: str, layout: RowLayout, experts: int, layers: int,
                 expert_ids: Sequence[int] | None = None) -> None:
        self.dir = Path(store_dir)
        ensure_writable_dir(self.dir)
        self.path, self.side = pack_path(self.dir, rank), sidecar_path(self.dir, rank)
        self.layout = layout
        self.fd = self._open_locked()
        old = Sidecar.load(self.side)
        intact = old is not None and os.fstat(self.fd).st_size >= old.rows_end  # a replaced or truncated file rebuilds
        if intact and old.mismatch(identity, layout, experts, layers, expert_ids) is None:
            self.sidecar = old
            log.info("pack %s: resuming, %d/%d layers written", self.path, len(old.layers_written), layers)
        else:
            self.sidecar = Sidecar.new(layout, experts, layers, identity, expert_ids)
            self._commit()  # the old sidecar stops vouching for the old bytes before they are overwritten
            os.ftruncate(self.fd, 0)
        self._reserve(self.sidecar.rows_end)
        ends = [off + n for off, n in self.sidecar.flips.values()]
        self.flips_end = round_up(max(ends, default=self.sidecar.rows_end), PAGE)

    @property
    def pending(self) -> list[int]:
        """Layers still to write, in order."""
        done = set(self.sidecar.layers_written)
        return [layer for layer in range(self.sidecar.layers) if layer not in done]

    def write_layer(self, layer: int, experts: Iterable[ExpertWeights]) -> None:
        """Write all E experts of one layer, make them durable, then record the layer in the sidecar."""
        if layer not in self.pending:
            raise ValueError(f"layer {layer} is already written or out of range")
        stride, n_exp = self.layout.stride, self.sidecar.experts
        per_chunk = max(1, WRITE_CHUNK // stride)
        buffer = torch.zeros(min(per_chunk, n_exp), stride, dtype=torch.uint8)
        flips: list[torch.Tensor] = []
        crc, count, base = 0, 0, layer * n_exp * stride
        for expert, weights in enumerate(experts):
            if expert >= n_exp:
                raise ValueError(f"layer {layer}: more than {n_exp} experts")
            self.layout.write_row(buffer[expert % per_chunk], layer, expert, weights)
            if self.layout.tier == Tier.REFINE:
                flips += [w.zero_flips.to(torch.int64) for w in weights]
            count = expert + 1
            if count % per_chunk == 0 or count == n_exp:
                chunk = buffer[: (count - 1) % per_chunk + 1].numpy().tobytes()
                crc = zlib.crc32(chunk, crc)
                self._pwrite(chunk, base + (count - len(chunk) // stride) * stride)
        if count != n_exp:
            raise ValueError(f"layer {layer}: {count} experts, the pack has {n_exp}")
        if any(f.numel() for f in flips):
            counts = torch.tensor([f.numel() for f in flips], dtype=torch.int64)
            blob = torch.cat([counts, *flips]).numpy().tobytes()
            crc = zlib.crc32(blob, crc)
            self._pwrite(blob, self.flips_end)
            self.sidecar.flips[str(layer)] = [self.flips_end, len(blob)]
            self.flips_end = round_up(self.flips_end + len(blob), PAGE)
        try:
            os.fdatasync(self.fd)
        except OSError as exc:
            raise directory_error(self.dir, exc) from None
        self.sidecar.layer_crc[str(layer)] = crc
        self.sidecar.layers_written = sorted([*self.sidecar.layers_written, layer])
        self._commit()

    def finish(self) -> Pack:
        """Close the writer and open the finished pack."""
        if self.pending:
            raise MoetError(f"pack {self.path}: layers {self.pending} were never written")
        self.close()
        return Pack(self.path, self.sidecar)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # also drops the flock
            self.fd = -1

    def _open_locked(self) -> int:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise directory_error(self.dir, exc) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise MoetError(f"pack {self.path} is being written by another process; wait for it or use another store directory") from None
        return fd

    def _reserve(self, nbytes: int) -> None:
        have = os.fstat(self.fd).st_blocks * 512
        need = max(0, nbytes - have)
        if need > free_bytes(self.dir):
            raise directory_error(self.dir, OSError(errno.ENOSPC, "no space"), need)
        try:
            os.posix_fallocate(self.fd, 0, nbytes)
        except OSError as exc:
            raise directory_error(self.dir, exc, need) from None

    def _pwrite(self, data: bytes, offset: int) -> None:
        view = memoryview(data)
        try:
            while view:
                done = os.pwrite(self.fd, view, offset)
                view, offset = view[done:], offset + done
        except OSError as exc:
            raise directory_error(self.dir, exc, len(view)) from None

    def _commit(self) -> None:
        replace_file(self.side, json.dumps(asdict(self.sidecar), indent=1).encode())


def build_pack(
    store_dir: Path | str,
    rank: int,
    identity: str,
    layout: RowLayout,
    experts: int,
    layers: int,
    quantize_layer: Callable[[int], Iterable[ExpertWeights]],
) -> Pack:
    """Open the rank's pack, writing (or finishing) it first: quantize_layer(layer) is called only for layers not on disk."""
    pack = open_pack(store_dir, rank, identity, layout, experts, layers)
    if pack is not None:
        return pack
    writer = PackWriter(store_dir, rank, identity, layout, experts, layers)
    try:
        for layer in writer.pending:
            writer.write_layer(layer, quantize_layer(layer))
        return writer.finish()
    finally:
        writer.close()
