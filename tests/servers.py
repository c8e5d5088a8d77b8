"""Helpers for tests that run real servers on loopback: ports, health, process groups, sockets.

Shared by every test that starts `moet serve` or `moet supervise`, so that they wait, stop and
inspect the servers the same way.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 420
# The shared `moet serve` of tests/conftest.py (tiny_serve): its API key and --max-model-len (small, so
# that a prompt longer than the window is cheap to send).
SERVE_API_KEY = "test-key-0123456789"
SERVE_WINDOW = 256


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_status(url: str, headers: dict[str, str] | None = None) -> int:
    """The HTTP status of a GET, 0 when nothing answers."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def completion_status(port: int, key: str | None, model: str = "tiny", timeout: float = 120) -> int:
    """The HTTP status of a one-token completion sent with API key `key` (None: no Authorization)."""
    body = json.dumps({"model": model, "prompt": "Hi", "max_tokens": 1}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def wait_healthy(proc: subprocess.Popen, port: int, log: Path, timeout: float = START_TIMEOUT_S) -> None:
    """Until /health answers 200; fails the test with the log's tail if the process exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        if http_status(f"http://127.0.0.1:{port}/health") == 200:
            return
        time.sleep(1)
    pytest.fail(f"server not healthy after {timeout} s:\n{log.read_text()[-4000:]}")


def moet(*args: str, env: dict[str, str] | None = None, log: Path) -> subprocess.Popen:
    """`moet ARGS` in its own session (so the whole tree can be signalled), output to `log`."""
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "moet.cli", *args], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def stop(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM to the process's session, SIGKILL if it outstays `timeout`."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextmanager
def serving(args: Sequence[str], port: int, log: Path, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """A healthy `moet serve ARGS --port PORT` for the duration of the block."""
    if env is None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_MOE_W2")}
    proc = moet("serve", "--port", str(port), *args, env=env, log=log)  # ARGS may end with `-- VLLM_ARGS`
    try:
        wait_healthy(proc, port, log)
        yield proc
    finally:
        stop(proc)


class SharedServe:
    """One `moet serve ARGS` for several test modules that only talk to it (each start costs ~40 s):
    `running()` starts it on first use, and again when a test has stopped it; `close()` stops it."""

    def __init__(self, args: Sequence[str], root: Path, env: dict[str, str]) -> None:
        self.args, self.root, self.env = list(args), root, env
        self.proc: subprocess.Popen | None = None
        self.port, self.log, self.starts = 0, root / "server.log", 0

    def running(self) -> tuple[int, Path, subprocess.Popen]:
        """(port, log, process) of a healthy server."""
        if self.proc is None or self.proc.poll() is not None:
            self.starts += 1
            self.port, self.log = free_port(), self.root / f"server-{self.starts}.log"
            self.proc = moet("serve", "--port", str(self.port), *self.args, env=self.env, log=self.log)
            try:
                wait_healthy(self.proc, self.port, self.log)
            except BaseException:
                stop(self.proc)
                raise
        return self.port, self.log, self.proc

    def close(self) -> None:
        if self.proc is not None:
            stop(self.proc)


def group_members(pgid: int) -> list[str]:
    """'pid comm' of every live (non-zombie) process in process group `pgid`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                found.append(f"{entry} {stat.split('(', 1)[1].rsplit(')', 1)[0]}")
    return found


def listening(pids: Sequence[int]) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state owned by one of `pids`."""
    import psutil

    wanted = set(pids)
    return {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.pid in wanted
    }


class NotifyListener:
    """The service manager's end of sd_notify: an AF_UNIX datagram socket, messages with arrival times."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.path = path
        self.messages: list[tuple[float, dict[str, str]]] = []
        self._done = False
        self._thread = threading.Thread(target=self._listen, daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        while not self._done:
            try:
                data = self.sock.recv(65536).decode()
            except socket.timeout:
                continue
            fields = dict(line.split("=", 1) for line in data.splitlines())
            self.messages.append((time.monotonic(), fields))

    def first(self, key: str, value: str | None = None, timeout: float = START_TIMEOUT_S, proc: subprocess.Popen | None = None) -> float:
        """When the first message with `key` (equal to `value`, if given) arrived; waits for it,
        but not for a sender `proc` that has exited."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for at, fields in list(self.messages):
                if key in fields and (value is None or fields[key] == value):
                    return at
            if proc is not None and proc.poll() is not None:
                raise AssertionError(f"exited with {proc.returncode} before {key}={value}; got {self.messages}")
            time.sleep(0.1)
        raise AssertionError(f"no {key}={value} within {timeout} s; got {self.messages}")

    def values(self, key: str) -> list[str]:
        return [fields[key] for _, fields in self.messages if key in fields]

    def close(self) -> None:
        self._done = True
        self._thread.join()
        self.sock.close()
