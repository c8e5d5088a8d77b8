"""The status files: how a running server tells `moet status` its phase and what its engine holds.

A run directory holds `supervisor.json` (the phase, written by `moet supervise` or `moet serve`) and
`status.json` (tier sizes and counters, written by the plugin to $MOET_STATUS_FILE). Writes are
atomic; readers never see a half-written file. `moet supervise` keeps its run directory in the
model list's state_dir; `moet serve` in one folder per port under `runtime_root()`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

STATUS_ENV = "MOET_STATUS_FILE"
PHASE_FILE = "supervisor.json"
ENGINE_FILE = "status.json"


def runtime_root() -> Path:
    """Where `moet serve` keeps its run directories: $XDG_RUNTIME_DIR/moet, else ~/.cache/moet/run."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return Path(xdg) / "moet" if xdg else Path.home() / ".cache" / "moet" / "run"


def serve_dir(port: int) -> Path:
    """The run directory of `moet serve --port PORT` (one server per port, so the port names it)."""
    return runtime_root() / str(port)


def serve_dirs() -> list[Path]:
    """Every `moet serve` run directory left on this host, by port; live or not, readers check."""
    root = runtime_root()
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.name.isdigit() and p.is_dir()), key=lambda p: int(p.name))


def status_path() -> Path | None:
    value = os.environ.get(STATUS_ENV)
    return Path(value) if value else None


def write_status(update: dict[str, Any], path: Path | None = None) -> None:
    """Merge `update` into the status file (no-op when no status file is configured)."""
    path = path or status_path()
    if path is None:
        return
    current = read_status(path)
    current.update(update)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(current, indent=1, sort_keys=True))
    tmp.replace(path)


def read_status(path: Path | None = None) -> dict[str, Any]:
    path = path or status_path()
    if path is None:
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
