"""Run a script in a fresh Python under Triton's CPU interpreter (TRITON_INTERPRET=1), which must be set before
Triton is imported: the kernel tests that have no GPU check their Triton kernels this way."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.servers import ROOT


def run_interpreted(script: str, done: str, timeout: float = 600) -> str:
    """Run `script` from the repository root (importable there); it must exit 0 and print `done`. Returns its
    standard output."""
    pytest.importorskip("triton")
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0 and done in proc.stdout, proc.stdout + proc.stderr
    return proc.stdout
