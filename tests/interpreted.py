"""Run a script in a fresh Python under Triton's CPU interpreter (TRITON_INTERPRET=1), which must be set before
Triton is imported: the kernel tests that have no GPU check their Triton kernels this way."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap

import pytest

from tests.servers import ROOT


_TENSOR_LOOP_BOUND = textwrap.dedent(
    """
    import torch, triton, triton.language as tl

    @triton.jit
    def count(p):
        for i in range(tl.load(p), 2):
            tl.store(p, i + 1)

    p = torch.zeros(1, dtype=torch.int32)
    count[(1,)](p)
    assert int(p) == 2
    """
)
NUMPY_SCALAR_ERROR = "only 0-dimensional arrays can be converted to Python scalars"


def _interpret(script: str, timeout: float) -> subprocess.CompletedProcess:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@functools.cache
def interpreter_fault() -> str | None:
    """Why this Triton's interpreter cannot run a loop whose bound is a tensor, or None. Triton 3.6's (the GPU image's)
    turns the bound's 1-element array into an int with int(), which numpy 2.5 refuses (Triton 3.9 squeezes it first):
    there every interpreted kernel with such a loop fails before it computes anything."""
    proc = _interpret(_TENSOR_LOOP_BOUND, timeout=120)
    if proc.returncode != 0 and NUMPY_SCALAR_ERROR in proc.stderr:
        import numpy
        import triton

        return f"Triton {triton.__version__}'s interpreter with numpy {numpy.__version__}: {NUMPY_SCALAR_ERROR}"
    return None


def run_interpreted(script: str, done: str, timeout: float = 600, tensor_loops: bool = True) -> str:
    """Run `script` from the repository root (importable there); it must exit 0 and print `done`. Returns its
    standard output. `tensor_loops`: its kernels have a loop whose bound is a tensor, so it is skipped where the
    interpreter cannot run one (interpreter_fault)."""
    pytest.importorskip("triton")
    fault = interpreter_fault() if tensor_loops else None
    if fault:
        pytest.skip(fault)
    proc = _interpret(script, timeout)
    assert proc.returncode == 0 and done in proc.stdout, proc.stdout + proc.stderr
    return proc.stdout
