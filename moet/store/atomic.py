"""Durable file updates for the store directory, and one-line errors when it cannot take them.

A file is replaced by writing a temp name, fdatasync, rename, then fsync of the directory: a crash
leaves either the old or the new contents, never a torn file.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from moet.errors import ConfigError, MoetError

KNOB = "VLLM_MOE_W2_STORE_DIR"


def directory_error(directory: Path, exc: OSError, need: int = 0) -> MoetError:
    """The user-facing error for a store directory that refused a write."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        free = free_bytes(directory)
        return MoetError(
            f"store directory {directory} is full ({free / 2**30:.2f} GiB free, the pack needs "
            f"{need / 2**30:.2f} GiB more): free space there or point {KNOB} at a larger disk"
        )
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return ConfigError(
            f"store directory {directory} is not writable ({os.strerror(exc.errno)}): make it writable "
            f"by the serving user or point {KNOB} at a writable directory"
        )
    return MoetError(f"store directory {directory}: {exc.strerror or exc}")


def free_bytes(directory: Path) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def ensure_writable_dir(directory: Path) -> None:
    """Create the directory and prove it takes a durable write, or raise directory_error."""
    probe = directory / f".probe.{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, b"x")
            os.fdatasync(fd)
        finally:
            os.close(fd)
        probe.unlink()
    except OSError as exc:
        raise directory_error(directory, exc) from None


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(path: Path, data: bytes) -> None:
    """Atomically and durably make `path` hold `data`."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fdatasync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise directory_error(path.parent, exc, len(data)) from None
