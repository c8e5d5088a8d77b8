"""`moet supervise` against real vLLM on loopback, reporting to a notify socket bound by the test.

One clean life (STATUS, EXTEND while loading, READY=1 only after /health, WATCHDOG pings, the API
key enforced, STOPPING=1 on SIGTERM sent during a long stream, exit 0 within the grace without
SIGKILL, nothing of vLLM left) and one death (vLLM's engine killed mid-stream: the client gets an
error, the supervisor says so over sd_notify and exits non-zero so that systemd restarts it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from moet.models import DEFAULT_MODEL_DIR

from tests.servers import NotifyListener, completion_status, free_port, group_members

pytestmark = pytest.mark.vllm
GRACE_S = 15
KEY = "sk-test-supervisor-key"


class HealthWatcher:
    """Polls /health from outside and remembers when it first answered 200."""

    def __init__(self, url: str) -> None:
        self.url, self.first_ok, self._done = url, None, False
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._done and self.first_ok is None:
            try:
                with urllib.request.urlopen(self.url, timeout=1) as response:
                    if response.status == 200:
                        self.first_ok = time.monotonic()
            except OSError:
                pass
            time.sleep(0.05)

    def close(self) -> None:
        self._done = True
        self._thread.join()


@pytest.fixture
def supervised(tmp_path: Path, checkpoint):
    """Start `moet supervise tiny` (2-bit experts through the moet plugin) with a notify socket and a
    2 s watchdog, on the embedded default model once the package carries it, else a tiny one."""
    model = "default" if (DEFAULT_MODEL_DIR / "config.json").is_file() else checkpoint("qwen3_moe", "bf16")
    port = free_port()
    key_file = tmp_path / "api.key"
    key_file.write_text(KEY + "\n")
    cfg = tmp_path / "models.yaml"
    cfg.write_text(
        f"settings:\n  state_dir: {tmp_path}/state\n  pack_dir: {tmp_path}/packs\n  staging_dir: {tmp_path}/staging\n"
        f"  stop_grace_s: {GRACE_S}\n"
        f"models:\n  tiny:\n    model: {model}\n    port: {port}\n    w2: true\n"
        f"    api_key_file: {key_file}\n    args: ['--max-model-len', '512']\n"
    )
    listener = NotifyListener(tmp_path / "notify.sock")
    env = {**os.environ, "NOTIFY_SOCKET": str(listener.path), "WATCHDOG_USEC": "2000000"}
    env.pop("CREDENTIALS_DIRECTORY", None)
    health = HealthWatcher(f"http://127.0.0.1:{port}/health")
    proc = subprocess.Popen([sys.executable, "-m", "moet.cli", "supervise", "tiny", "--config", str(cfg)], env=env)
    yield proc, listener, health, cfg, port, tmp_path / "state" / "tiny"
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    health.close()
    listener.close()


class StreamingClient:
    """A long streamed completion on a thread: when its first chunk arrived, and how it ended."""

    def __init__(self, port: int, max_tokens: int = 400) -> None:
        body = json.dumps({"model": "tiny", "prompt": "Once", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}).encode()
        self.request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", data=body,
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
        )
        self.first_chunk = threading.Event()
        self.ended = threading.Event()
        self.chunks, self.outcome = 0, ""
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            with urllib.request.urlopen(self.request, timeout=120) as response:
                for line in response:
                    if line.startswith(b"data: {"):
                        event = json.loads(line[len(b"data: "):])
                        if "error" in event:  # vLLM reports a dead engine inside the stream
                            self.outcome = f"error event: {event['error']}"
                        self.chunks += 1
                        self.first_chunk.set()
                    elif line.startswith(b"data: [DONE]") and not self.outcome:
                        self.outcome = "done"
            self.outcome = self.outcome or "cut"
        except (OSError, ValueError) as exc:  # connection reset, incomplete read
            self.outcome = f"error: {exc}"
        finally:
            self.first_chunk.set()
            self.ended.set()


def test_clean_life_under_sd_notify(supervised) -> None:
    proc, listener, health, cfg, port, state = supervised
    ready = listener.first("READY", "1")
    assert health.first_ok is not None and health.first_ok <= ready, "READY=1 before /health answered"
    statuses = listener.values("STATUS")
    assert statuses[0] == "checking tiny" and any(s.startswith("loading ") for s in statuses)
    assert any(s.startswith("warming up tiny") for s in statuses) and any(s.startswith("serving tiny") for s in statuses)
    assert listener.values("EXTEND_TIMEOUT_USEC"), "no EXTEND_TIMEOUT_USEC while loading"
    assert all(at < ready for at, f in listener.messages if "EXTEND_TIMEOUT_USEC" in f)
    pings_after = [at for at, f in listener.messages if "WATCHDOG" in f]
    assert all(at >= ready for at in pings_after), "WATCHDOG=1 before the server was healthy"

    assert completion_status(port, None) == 401 and completion_status(port, "wrong") == 401
    assert completion_status(port, KEY) == 200
    pgid = json.loads((state / "supervisor.json").read_text())["vllm_pid"]
    for member in group_members(pgid):
        cmdline = Path(f"/proc/{member.split()[0]}/cmdline").read_bytes().decode(errors="replace")
        assert KEY not in cmdline, f"API key visible to ps in {member}"

    status = subprocess.run([sys.executable, "-m", "moet.cli", "status", "tiny", "--config", str(cfg), "--json"], capture_output=True, text=True, check=True)
    report = json.loads(status.stdout)["tiny"]
    assert (report["state"], report["health"]) == ("serving", "200")
    # The engine's own status file (the plugin's tier sizes), read through the same command.
    assert report["engine"] and report["engine"] == json.loads((state / "status.json").read_text())

    deadline = time.monotonic() + 30
    while len(listener.values("WATCHDOG")) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(listener.values("WATCHDOG")) >= 2 and set(listener.values("WATCHDOG")) == {"1"}

    # SIGTERM in the middle of a long streamed response: the stop is clean and bounded by the grace.
    # (vLLM's uvicorn may wait for the aborted stream's connection: then the grace's SIGKILL ends it,
    # tests/test_faults.py and docs/SECURITY.md; the bound is what systemd relies on.)
    stream = StreamingClient(port)
    assert stream.first_chunk.wait(60) and stream.chunks > 0, stream.outcome
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=GRACE_S + 10) == 0
    assert time.monotonic() - sent < GRACE_S + 10
    assert stream.ended.wait(10), "the client still hangs after the server stopped"
    assert listener.first("STOPPING", "1", timeout=1) >= sent
    assert listener.values("STATUS")[-1] == "stopped tiny"
    assert group_members(pgid) == [], "vLLM processes outlived the supervisor"
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)


def test_engine_death_is_reported_and_fails_the_unit(supervised) -> None:
    proc, listener, _health, _cfg, port, state = supervised
    listener.first("READY", "1")
    pgid = json.loads((state / "supervisor.json").read_text())["vllm_pid"]
    engines = [m for m in group_members(pgid) if "EngineCor" in m]
    assert engines, group_members(pgid)
    stream = StreamingClient(port)  # a request in flight when the engine dies
    assert stream.first_chunk.wait(60) and stream.chunks > 0, stream.outcome
    os.kill(int(engines[0].split()[0]), signal.SIGKILL)
    assert proc.wait(timeout=120) != 0
    assert stream.ended.wait(10) and stream.outcome.startswith(("error", "cut")), stream.outcome  # the client sees it
    final = listener.values("STATUS")[-1]
    assert final.startswith("vLLM ") and "exiting so systemd restarts tiny" in final, final
    assert "READY" not in listener.messages[-1][1]
    assert group_members(pgid) == []
    assert json.loads((state / "supervisor.json").read_text())["state"] == "failed"
