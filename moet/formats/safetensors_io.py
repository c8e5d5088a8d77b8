"""Safetensors files whose header is validated before any tensor memory is allocated.

A hostile or truncated file must fail with one CheckpointError naming the file, never with an
allocation of whatever size the header claims. Tensors are then read with positioned reads of
exactly their validated byte range: unlike `safe_open`'s memory map, whose touched pages count
towards the process's RSS for as long as the file is open, this keeps resident memory at one
tensor however large the shard. The page cache still keeps what was read; `drop_read_pages` hands
those pages back (POSIX_FADV_DONTNEED), since on unified-memory machines (DGX Spark class) cached
checkpoint pages count against the GPU's memory.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from moet.errors import CheckpointError

MAX_HEADER_BYTES = 100 * 1024 * 1024

# safetensors dtype tag → (torch dtype, bytes per element)
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "BOOL": (torch.bool, 1),
    "U8": (torch.uint8, 1),
    "I8": (torch.int8, 1),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
    "F8_E8M0": (torch.float8_e8m0fnu, 1),
    "U16": (torch.uint16, 2),
    "I16": (torch.int16, 2),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "U32": (torch.uint32, 4),
    "I32": (torch.int32, 4),
    "F32": (torch.float32, 4),
    "U64": (torch.uint64, 8),
    "I64": (torch.int64, 8),
    "F64": (torch.float64, 8),
}
TAGS: dict[torch.dtype, str] = {dtype: tag for tag, (dtype, _) in DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    """One header entry, already checked against the file."""

    name: str
    dtype: str  # safetensors tag, e.g. "F8_E4M3"
    shape: tuple[int, ...]
    begin: int  # absolute file offsets
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def _entry(path: Path, name: str, raw: object, data_start: int, file_size: int) -> TensorInfo:
    where = f"{path}: tensor {name}"
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where}: header entry is not an object; the file is corrupt")
    dtype, shape, offsets = raw.get("dtype"), raw.get("shape"), raw.get("data_offsets")
    if dtype not in DTYPES:
        raise CheckpointError(f"{where}: unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise CheckpointError(f"{where}: shape {shape!r} is not a list of non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise CheckpointError(f"{where}: data_offsets {offsets!r} are not [begin, end] with begin <= end")
    expected = math.prod(shape) * DTYPES[dtype][1]
    if offsets[1] - offsets[0] != expected:
        raise CheckpointError(
            f"{where}: header claims {offsets[1] - offsets[0]} bytes but {dtype}{shape} needs {expected}; the header is corrupt"
        )
    begin, end = data_start + offsets[0], data_start + offsets[1]
    if end > file_size:
        raise CheckpointError(
            f"{where}: bytes {begin}..{end} lie beyond the end of the file ({file_size} bytes); the file is truncated or its header lies"
        )
    return TensorInfo(name, dtype, tuple(shape), begin, end)


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate a safetensors header; raises CheckpointError naming the file on any defect."""
    try:
        file_size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: {file_size} bytes is too short for a safetensors file (truncated?)")
            (length,) = struct.unpack("<Q", prefix)
            if length > MAX_HEADER_BYTES or 8 + length > file_size:
                raise CheckpointError(
                    f"{path}: header length {length} bytes exceeds the file ({file_size} bytes) or the {MAX_HEADER_BYTES}-byte limit; the file is truncated or corrupt"
                )
            raw = f.read(length)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror})") from exc
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: header is not valid JSON ({exc}); the file is corrupt") from exc
    except RecursionError:
        raise CheckpointError(f"{path}: header nests too deeply to be a safetensors header; the file is corrupt") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object; the file is corrupt")
    header.pop("__metadata__", None)
    data_start = 8 + length
    entries = {name: _entry(path, name, raw_entry, data_start, file_size) for name, raw_entry in header.items()}
    spans = sorted(entries.values(), key=lambda t: (t.begin, t.end))
    for prev, cur in zip(spans, spans[1:]):
        if cur.begin < prev.end:
            raise CheckpointError(f"{path}: tensors {prev.name} and {cur.name} overlap in the file; the header is corrupt")
    return entries


class SafetensorsFile:
    """A validated safetensors file; `read` returns one tensor by a positioned read."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.tensors = read_header(self.path)
        self._fd: int | None = None
        self._read_span: tuple[int, int] | None = None  # bytes read since the last drop_read_pages

    def read(self, name: str) -> torch.Tensor:
        info = self.tensors[name]
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        buf = torch.empty(info.nbytes, dtype=torch.uint8)
        view = memoryview(buf.numpy())
        done = 0
        while done < info.nbytes:
            n = os.preadv(self._fd, [view[done:]], info.begin + done)
            if n == 0:
                raise CheckpointError(f"{self.path}: tensor {name}: file ended early (truncated while reading?)")
            done += n
        span = self._read_span or (info.begin, info.end)
        self._read_span = (min(span[0], info.begin), max(span[1], info.end))
        return buf.view(DTYPES[info.dtype][0]).reshape(info.shape)

    def drop_read_pages(self) -> None:
        """Drop the page-cache pages of the bytes read since the last call: `read` copied them out, so
        keeping them only grows the cache. The range is widened to whole pages (a neighbour's partial
        page is re-read if needed, never lost); dirty pages are left to writeback."""
        if self._fd is None or self._read_span is None:
            return
        begin, end = self._read_span
        begin -= begin % mmap.PAGESIZE
        end += -end % mmap.PAGESIZE
        os.posix_fadvise(self._fd, begin, end - begin, os.POSIX_FADV_DONTNEED)
        self._read_span = None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_streaming(path: Path, specs: list[tuple[str, torch.dtype, tuple[int, ...]]], produce) -> None:
    """Write a safetensors file tensor by tensor: `produce(name)` returns each tensor in `specs` order.

    Only one tensor is in memory at a time, so files larger than RAM can be generated. The file is
    written under a temporary name and renamed, so a failure leaves nothing behind.
    """
    header: dict[str, object] = {}
    offset = 0
    for name, dtype, shape in specs:
        size = math.prod(shape) * DTYPES[TAGS[dtype]][1]
        header[name] = {"dtype": TAGS[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for name, dtype, shape in specs:
                tensor = produce(name)
                if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
                    raise ValueError(f"{name}: produced {tensor.dtype}{list(tensor.shape)}, declared {dtype}{list(shape)}")
                f.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
