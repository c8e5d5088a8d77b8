"""Batched pack reads on a thread pool, optionally with O_DIRECT, straight into caller buffers.

Rows that sit next to each other in the file and in the destination become one preadv, so a boot
scan reads in large sequential requests; several requests run at once because NVMe needs queue
depth. O_DIRECT keeps the page cache from doubling the host footprint (the arena is the cache).
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from moet.store.layout import PAGE
from moet.store.pack import Pack

log = logging.getLogger("moet.store")

MAX_REQUEST = 16 << 20  # bytes per preadv: large enough to stream, small enough to spread over threads


def aligned_empty(rows: int, width: int, pin: bool = False) -> torch.Tensor:
    """uint8 [rows, width] on the host whose start is 4 KiB aligned (O_DIRECT); pinned when asked."""
    if pin:
        return torch.empty(rows, width, dtype=torch.uint8, pin_memory=True)  # cudaHostAlloc: page aligned
    raw = torch.empty(rows * width + PAGE, dtype=torch.uint8)
    start = (-raw.data_ptr()) % PAGE
    return raw[start : start + rows * width].view(rows, width)


class RowReader:
    """Reads pack rows (the first `span` bytes of each) into host buffers."""

    def __init__(self, pack: Pack, threads: int = 4, direct: bool = False) -> None:
        self.pack = pack
        self.direct = False
        self.fd = pack.fd
        if direct:
            try:
                self.fd = os.open(pack.path, os.O_RDONLY | os.O_DIRECT)
                self.direct = True
            except OSError as exc:
                log.warning("pack %s: O_DIRECT unavailable (%s); using buffered reads", pack.path, exc.strerror)
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="moet-pack")

    def read(self, keys: Sequence[tuple[int, int]], dests: Sequence[torch.Tensor]) -> int:
        """Fill each dest (a contiguous host uint8 row, alive until this returns) with the first len(dest)
        bytes of its row; returns bytes read."""
        requests = self._requests(keys, dests)
        total = sum(n for _, _, n in requests)
        for done in self.pool.map(self._run, requests):
            pass
        return total

    def _requests(self, keys: Sequence[tuple[int, int]], dests: Sequence[torch.Tensor]) -> list[tuple[int, list, int]]:
        """(file offset, [(address, bytes)], bytes) per preadv; adjacent full-stride rows merge up to MAX_REQUEST."""
        stride = self.pack.stride
        out: list[tuple[int, list, int]] = []
        last_end, last_ptr = -1, -1
        for (layer, expert), dest in zip(keys, dests, strict=True):
            offset, span, ptr = self.pack.offset(layer, expert), dest.numel(), dest.data_ptr()
            if self.direct and (span % PAGE or ptr % PAGE):
                raise ValueError("O_DIRECT reads need 4 KiB aligned buffers of whole pages")
            if span == stride and offset == last_end and out and out[-1][2] < MAX_REQUEST:
                buffers = out[-1][1]
                if ptr == last_ptr:  # contiguous in memory too: grow the last buffer (one iovec streams best)
                    buffers[-1] = (buffers[-1][0], buffers[-1][1] + span)
                else:
                    buffers.append((ptr, span))
                out[-1] = (out[-1][0], buffers, out[-1][2] + span)
            else:
                out.append((offset, [(ptr, span)], span))
            last_end, last_ptr = offset + span, ptr + span
        return out

    def _run(self, request: tuple[int, list, int]) -> None:
        offset, buffers, nbytes = request
        views = [memoryview((ctypes.c_char * size).from_address(ptr)).cast("B") for ptr, size in buffers]
        done = os.preadv(self.fd, views, offset)
        if done != nbytes:
            raise OSError(f"short read of {self.pack.path} at {offset}: {done} of {nbytes} bytes")

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        if self.direct:
            os.close(self.fd)
            self.direct = False
