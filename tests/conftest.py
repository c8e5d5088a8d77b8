"""Shared fixtures: one cache of tiny real checkpoints per test session (tests/ckpt.py), and one
`moet serve` of the tiny model for the modules that only send it requests."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.ckpt import make_checkpoint
from tests.servers import SERVE_API_KEY, SERVE_WINDOW, SharedServe


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


@pytest.fixture(scope="session")
def tiny_serve(checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedServe]:
    """`moet serve` of the tiny NVFP4 Qwen3-MoE with 2-bit experts (named `tiny`), an API key from a
    file and a window of SERVE_WINDOW tokens, for tests/test_requests.py and tests/test_serve_e2e.py;
    its run folder in a runtime directory of its own (`moet status` finds it through `.env`)."""
    tmp = tmp_path_factory.mktemp("serve")
    key_file = tmp / "api-key"
    key_file.write_text(SERVE_API_KEY + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_MOE_W2") and k != "MOET_CONFIG"}
    env["XDG_RUNTIME_DIR"] = str(tmp / "run")
    args = [str(checkpoint("qwen3_moe", "nvfp4")), "--name", "tiny", "--api-key-file", str(key_file)]
    shared = SharedServe([*args, "--", "--max-model-len", str(SERVE_WINDOW)], tmp, env)
    yield shared
    shared.close()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """vLLM runs started ahead that no test waited for (a stopped or failed session) are not started."""
    runs = sys.modules.get("tests.test_vllm_plugin")
    if runs is not None:
        runs.cancel_pending_runs()
