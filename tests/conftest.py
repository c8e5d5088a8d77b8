"""Shared fixtures: one cache of tiny real checkpoints per test session (tests/ckpt.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.ckpt import make_checkpoint


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`checkpoint(arch, fmt, seed=0, deep=False)` → directory of a tiny (or deep) checkpoint, built once per session."""
    root = tmp_path_factory.mktemp("checkpoints")
    return lambda arch, fmt, seed=0, deep=False: make_checkpoint(arch, fmt, root, seed, deep)


@pytest.fixture
def single_thread():
    """One intra-op thread: on a shared 2-core box, tiny float64 ops run ~100x faster without thread contention."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
