"""Faults under `moet supervise` while a streamed completion runs, reported to a notify socket bound
by the test: vLLM's engine killed (the client gets an error, the supervisor says so and exits
non-zero, a restarted supervisor answers again), and SIGTERM mid-stream (a clean stop within the
grace period, no process left)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import psutil
import pytest

from tests.servers import NotifyListener, free_port, group_members, moet

pytestmark = pytest.mark.vllm
GRACE_S = 20


class Stream(threading.Thread):
    """A streamed completion consumed on a thread: when chunks arrived, how it ended."""

    def __init__(self, port: int, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
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


@pytest.fixture(scope="module")
def setup(checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, int, Path]]:
    """One model list for every supervisor of the module (the restart reuses it)."""
    tmp = tmp_path_factory.mktemp("faults")
    port = free_port()
    cfg = tmp / "models.yaml"
    cfg.write_text(
        f"settings: {{state_dir: {tmp}/state, pack_dir: {tmp}/packs, staging_dir: {tmp}/staging, stop_grace_s: {GRACE_S}}}\n"
        f"models:\n  tiny: {{model: {checkpoint('qwen3_moe', 'nvfp4')}, port: {port}, w2: true}}\n"
    )
    yield cfg, port, tmp


@pytest.fixture
def supervisor(setup: tuple[Path, int, Path], tmp_path: Path) -> Iterator[tuple[subprocess.Popen, NotifyListener, int]]:
    """A `moet supervise tiny` that has sent READY=1 to the test's notify socket."""
    cfg, port, _ = setup
    listener = NotifyListener(tmp_path / "notify.sock")
    env = {**os.environ, "NOTIFY_SOCKET": str(listener.path)}
    proc = moet("supervise", "tiny", "--config", str(cfg), env=env, log=tmp_path / "supervise.log")
    try:
        listener.first("READY", "1", proc=proc)
        yield proc, listener, port
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        listener.close()


def vllm_tree(supervisor: subprocess.Popen) -> list[psutil.Process]:
    return psutil.Process(supervisor.pid).children(recursive=True)


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


def test_engine_killed_mid_stream(supervisor: tuple[subprocess.Popen, NotifyListener, int]) -> None:
    proc, listener, port = supervisor
    tree = vllm_tree(proc)
    engine = next(p for p in tree if "EngineCor" in p.name())
    stream = Stream(port, max_tokens=400)
    stream.wait_first_chunks()
    engine.send_signal(signal.SIGKILL)

    stream.join(timeout=120)
    assert not stream.is_alive(), "the client still waits after the engine died"
    assert stream.error is not None or stream.finish != "length", f"complete after {len(stream.chunks)} chunks: the kill came too late"
    assert proc.wait(timeout=120) != 0
    statuses = listener.values("STATUS")
    assert any(s.startswith("vLLM ") and "exiting so systemd restarts tiny" in s for s in statuses), statuses
    assert not alive(tree), "vLLM processes outlived the supervisor"


def test_restarted_supervisor_answers_then_stops_cleanly_mid_stream(supervisor: tuple[subprocess.Popen, NotifyListener, int]) -> None:
    """Runs after the engine was killed: the same model list comes back (as Restart=on-failure would).

    Observed with vLLM 0.32: on SIGTERM it aborts the request and stops its engine at once, but
    uvicorn then waits for the aborted stream's connection to close, which never happens; the
    supervisor's SIGKILL after stop_grace_s is what ends it. The stop is therefore bounded by the
    grace period, not shorter, whenever a stream is open."""
    proc, listener, port = supervisor
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=300)
    assert client.completions.create(model="tiny", prompt="x = ", max_tokens=2).usage.completion_tokens == 2

    tree = vllm_tree(proc)
    pgid = psutil.Process(proc.pid).children()[0].pid  # vLLM's API server leads its process group
    stream = Stream(port, max_tokens=400)
    stream.wait_first_chunks()
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=GRACE_S + 15) == 0
    took = time.monotonic() - sent
    assert took < GRACE_S + 5, f"stop took {took:.1f} s"
    assert listener.first("STOPPING", "1", timeout=1) >= sent
    statuses = listener.values("STATUS")
    assert statuses[-1] == "stopped tiny", statuses
    assert group_members(pgid) == [] and not alive(tree)
    stream.join(timeout=30)
    assert not stream.is_alive() and (stream.error is not None or stream.finish != "length")
