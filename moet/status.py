"""The status file: how the engine process tells the supervisor and `moet status` what it holds.

The plugin writes a JSON object (tier sizes, counters) atomically to $MOET_STATUS_FILE; readers
never see a half-written file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

STATUS_ENV = "MOET_STATUS_FILE"


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
