"""The confidence gate inside the engine process (filled in with the FP4 pool)."""

from __future__ import annotations

from typing import Any

_GATE: Any | None = None


def current_gate() -> Any | None:
    return _GATE
