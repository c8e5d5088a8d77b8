"""What a running model exposes: only loopback sockets unless told otherwise, the API key never on a
command line, and 401 without the key under `moet supervise` with a systemd credential. (`moet serve`
without --host binding loopback only is checked on the session's shared server, tests/test_serve_e2e.py.)"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import psutil
import pytest

from tests.servers import completion_status, free_port, listening, moet, stop, wait_healthy

pytestmark = pytest.mark.vllm
KEY = "sk-exposure-credential-5f0e"
LOOPBACK = {"127.0.0.1", "::1"}


def tree(pid: int) -> list[int]:
    root = psutil.Process(pid)
    return [pid, *(p.pid for p in root.children(recursive=True))]


@pytest.fixture(scope="module")
def supervised(checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen, int]]:
    """`moet supervise tiny` as systemd runs it: no host in the YAML, the key as credential `api-key`."""
    tmp = tmp_path_factory.mktemp("exposure")
    creds = tmp / "credentials"
    creds.mkdir(mode=0o700)
    (creds / "api-key").write_text(KEY + "\n")
    port = free_port()
    cfg = tmp / "models.yaml"
    cfg.write_text(
        f"settings: {{state_dir: {tmp}/state, pack_dir: {tmp}/packs, staging_dir: {tmp}/staging}}\n"
        f"models:\n  tiny: {{model: {checkpoint('qwen3_moe', 'nvfp4')}, port: {port}, w2: true, args: [--max-model-len, '512']}}\n"
    )
    env = {**os.environ, "CREDENTIALS_DIRECTORY": str(creds)}
    env.pop("NOTIFY_SOCKET", None)
    log = tmp / "supervise.log"
    proc = moet("supervise", "tiny", "--config", str(cfg), env=env, log=log)
    try:
        wait_healthy(proc, port, log)
        yield proc, port
    finally:
        stop(proc)


def test_supervised_model_listens_on_loopback_only(supervised: tuple[subprocess.Popen, int]) -> None:
    """Every TCP listener of the whole tree (API server, engine, workers) is on loopback."""
    proc, port = supervised
    bound = listening(tree(proc.pid))
    assert ("127.0.0.1", port) in bound and {address for address, _ in bound} <= LOOPBACK, bound


def test_credential_key_is_enforced_and_never_on_a_command_line(supervised: tuple[subprocess.Popen, int]) -> None:
    proc, port = supervised
    assert completion_status(port, None) == 401
    assert completion_status(port, "sk-wrong") == 401
    assert completion_status(port, KEY) == 200
    for pid in tree(proc.pid):
        assert KEY not in " ".join(psutil.Process(pid).cmdline())
    everything = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    assert "vllm.entrypoints" in everything and KEY not in everything
