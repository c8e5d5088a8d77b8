"""`moet supervise` against real vLLM on loopback, reporting to a notify socket bound by the test.

One model list, two lives (two vLLM starts), as systemd's Restart=on-failure runs them:

* a death: vLLM's engine killed while two streamed completions run (the official `openai` client and
  plain HTTP): both clients get an error, the supervisor says so over sd_notify and exits non-zero so
  that systemd restarts it, and nothing of vLLM is left;
* the restarted supervisor's clean life: STATUS, EXTEND while loading, READY=1 only after /health,
  WATCHDOG pings, the API key enforced and never on a command line, `moet status`, an answer, then
  STOPPING=1 on SIGTERM sent during two long streams, exit 0 within the grace period plus 5 s, and
  nothing of vLLM left.

Observed with vLLM 0.32: on SIGTERM it aborts the requests and stops its engine at once, but uvicorn
then waits for the aborted streams' connections to close, which never happens; the supervisor's
SIGTERM to the group and SIGKILL after stop_grace_s are what end it. The stop is therefore bounded by
the grace period, not shorter, whenever a stream is open (docs/SECURITY.md).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import psutil
import pytest

from moet.models import DEFAULT_MODEL_DIR

from tests.servers import NotifyListener, completion_status, free_port, group_members, moet

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


# Tokens of the streams that must still be running when the engine is killed or the server stopped: at the
# embedded model's ~110 tok/s on two cores (2026-12-05), 400 could finish first.
LONG_STREAM = 2000


class StreamingClient:
    """A long streamed completion over plain HTTP on a thread: when its first chunk arrived, and how it ended."""

    def __init__(self, port: int, max_tokens: int = LONG_STREAM) -> None:
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


class Stream(threading.Thread):
    """A streamed completion through the official `openai` client on a thread: when chunks arrived, how it ended."""

    def __init__(self, port: int, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=600)
        self.max_tokens = max_tokens
        self.chunks: list[float] = []
        self.finish: str | None = None
        self.error: Exception | None = None
        self.start()

    def run(self) -> None:
        try:
            stream = self.client.completions.create(model="tiny", prompt="def main():", max_tokens=self.max_tokens,
                                                    temperature=0, stream=True, extra_body={"ignore_eos": True})
            for chunk in stream:
                self.chunks.append(time.monotonic())
                if chunk.choices and chunk.choices[0].finish_reason:
                    self.finish = chunk.choices[0].finish_reason
        except Exception as exc:  # what the client saw is the test's subject
            self.error = exc

    def wait_first_chunks(self, count: int = 2, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while len(self.chunks) < count and self.is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(self.chunks) >= count, f"no streamed tokens (error: {self.error!r})"


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    """The processes still running (zombies and vanished ones are not)."""
    found = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


@pytest.fixture(scope="module")
def model_list(checkpoint, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, Path]:
    """One model list for both supervisors of the module (the restart reuses it, with its state and
    packs): `tiny` (2-bit experts through the moet plugin) on the embedded default model once the
    package carries it, else a tiny one, with an API key file."""
    tmp = tmp_path_factory.mktemp("supervise")
    model = "default" if (DEFAULT_MODEL_DIR / "config.json").is_file() else checkpoint("qwen3_moe", "bf16")
    port = free_port()
    key_file = tmp / "api.key"
    key_file.write_text(KEY + "\n")
    cfg = tmp / "models.yaml"
    cfg.write_text(
        f"settings:\n  state_dir: {tmp}/state\n  pack_dir: {tmp}/packs\n  staging_dir: {tmp}/staging\n"
        f"  stop_grace_s: {GRACE_S}\n"
        f"models:\n  tiny:\n    model: {model}\n    port: {port}\n    w2: true\n"
        f"    api_key_file: {key_file}\n    args: ['--max-model-len', '2048']\n"
    )
    return cfg, port, tmp / "state" / "tiny"


@pytest.fixture
def supervised(model_list: tuple[Path, int, Path], tmp_path: Path) -> Iterator[tuple]:
    """Start `moet supervise tiny` with a notify socket and a 2 s watchdog."""
    cfg, port, state = model_list
    listener = NotifyListener(tmp_path / "notify.sock")
    env = {**os.environ, "NOTIFY_SOCKET": str(listener.path), "WATCHDOG_USEC": "2000000"}
    env.pop("CREDENTIALS_DIRECTORY", None)
    health = HealthWatcher(f"http://127.0.0.1:{port}/health")
    proc = moet("supervise", "tiny", "--config", str(cfg), env=env, log=tmp_path / "supervise.log")
    yield proc, listener, health, cfg, port, state
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    health.close()
    listener.close()


def test_engine_death_is_reported_and_fails_the_unit(supervised) -> None:
    proc, listener, _health, _cfg, port, state = supervised
    listener.first("READY", "1", proc=proc)
    pgid = json.loads((state / "supervisor.json").read_text())["vllm_pid"]
    tree = psutil.Process(proc.pid).children(recursive=True)
    engine = next(p for p in tree if "EngineCor" in p.name())
    engines = [m for m in group_members(pgid) if "EngineCor" in m]
    assert [int(m.split()[0]) for m in engines] == [engine.pid], group_members(pgid)
    http = StreamingClient(port)  # requests in flight when the engine dies, one per client
    sdk = Stream(port, max_tokens=LONG_STREAM)
    assert http.first_chunk.wait(60) and http.chunks > 0, http.outcome
    sdk.wait_first_chunks()
    engine.send_signal(signal.SIGKILL)
    killed = time.monotonic()

    assert proc.wait(timeout=120) != 0
    assert http.ended.wait(10) and http.outcome.startswith(("error", "cut")), http.outcome  # the client sees it
    sdk.join(timeout=max(0.0, killed + 120 - time.monotonic()))
    assert not sdk.is_alive(), "the client still waits after the engine died"
    assert sdk.error is not None or sdk.finish != "length", f"complete after {len(sdk.chunks)} chunks: the kill came too late"
    final = listener.values("STATUS")[-1]
    assert final.startswith("vLLM ") and "exiting so systemd restarts tiny" in final, final
    assert "READY" not in listener.messages[-1][1]
    assert group_members(pgid) == []
    assert not alive(tree), "vLLM processes outlived the supervisor"
    assert json.loads((state / "supervisor.json").read_text())["state"] == "failed"


def test_restarted_supervisor_clean_life_under_sd_notify(supervised) -> None:
    """Runs after the engine was killed: the same model list comes back (as Restart=on-failure would)."""
    proc, listener, health, cfg, port, state = supervised
    ready = listener.first("READY", "1", proc=proc)
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
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=300)
    assert client.completions.create(model="tiny", prompt="x = ", max_tokens=2).usage.completion_tokens == 2
    pgid = json.loads((state / "supervisor.json").read_text())["vllm_pid"]
    assert psutil.Process(proc.pid).children()[0].pid == pgid  # vLLM's API server leads its process group
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

    # SIGTERM in the middle of long streamed responses: the stop is clean and bounded by the grace.
    tree = psutil.Process(proc.pid).children(recursive=True)
    http = StreamingClient(port)
    sdk = Stream(port, max_tokens=LONG_STREAM)
    assert http.first_chunk.wait(60) and http.chunks > 0, http.outcome
    sdk.wait_first_chunks()
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=GRACE_S + 10) == 0
    took = time.monotonic() - sent
    assert took < GRACE_S + 5, f"stop took {took:.1f} s"
    assert http.ended.wait(10), "the client still hangs after the server stopped"
    assert listener.first("STOPPING", "1", timeout=1) >= sent
    assert listener.values("STATUS")[-1] == "stopped tiny"
    assert group_members(pgid) == [] and not alive(tree), "vLLM processes outlived the supervisor"
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)
    sdk.join(timeout=30)
    assert not sdk.is_alive() and (sdk.error is not None or sdk.finish != "length")
