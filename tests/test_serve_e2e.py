"""`moet serve` end to end: the real server on loopback, driven by the official `openai` client, found
by `moet status`, and stopped with Ctrl-C (SIGINT), as a person runs it. The server is the session's
shared one (tests/conftest.py `tiny_serve`; tests/test_requests.py sends it absurd requests first)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import psutil
import pytest

from moet.config.loader import DEFAULT_CONFIG
from tests.servers import SERVE_API_KEY, SharedServe, http_status, listening

pytestmark = pytest.mark.vllm
API_KEY = SERVE_API_KEY
LOOPBACK = {"127.0.0.1", "::1"}
Served = tuple[int, Path, str, subprocess.Popen, dict[str, str]]  # port, log, model name, `moet serve`, its environment


@pytest.fixture(scope="module")
def server(tiny_serve: SharedServe) -> Served:
    """The shared `moet serve` of the tiny NVFP4 Qwen3-MoE with 2-bit experts and an API key from a
    file, started without --host; its run folder in a runtime directory of its own (`moet status`
    finds it through the same environment)."""
    port, log, proc = tiny_serve.running()
    return port, log, "tiny", proc, tiny_serve.env


def test_openai_client_round_trip(server: Served) -> None:
    port, log, name, _, _ = server
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0)

    assert [m.id for m in client.models.list().data] == [name]

    completion = client.completions.create(model=name, prompt="def main():", max_tokens=6, temperature=0)
    assert completion.usage.completion_tokens == 6 and isinstance(completion.choices[0].text, str)
    assert completion.choices[0].finish_reason == "length"

    chat = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "Say hi"}], max_tokens=5, temperature=0
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 5

    chunks = list(
        client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "Count"}], max_tokens=5, temperature=0, stream=True
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(chunks) >= 2 and finish == ["length"] and isinstance(streamed, str)

    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=name, prompt="x", max_tokens=-1)
    assert bad.value.status_code == 400
    assert http_status(f"http://127.0.0.1:{port}/health") == 200
    again = client.completions.create(model=name, prompt="x", max_tokens=2, temperature=0)
    assert again.usage.completion_tokens == 2

    line = next(line for line in log.read_text().splitlines() if line.startswith("moet: experts"))
    assert "bits/weight" in line and "tensors" in line


def test_api_key_required(server: Served) -> None:
    port, *_ = server
    assert http_status(f"http://127.0.0.1:{port}/v1/models") == 401
    assert http_status(f"http://127.0.0.1:{port}/v1/models", {"Authorization": "Bearer wrong"}) == 401
    assert http_status(f"http://127.0.0.1:{port}/v1/models", {"Authorization": f"Bearer {API_KEY}"}) == 200


def test_api_key_not_on_the_command_line(server: Served) -> None:
    """`ps` shows argv to every user: the key must only travel in the environment."""
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert "vllm.entrypoints" in out and API_KEY not in out


def test_binds_loopback_by_default(server: Served) -> None:
    """Started without --host: every TCP listener of the whole tree (API server, engine) is on
    loopback, the API port on 127.0.0.1."""
    port, _, _, proc, _ = server
    tree = [proc.pid, *(p.pid for p in psutil.Process(proc.pid).children(recursive=True))]
    bound = listening(tree)
    assert ("127.0.0.1", port) in bound, bound
    assert {address for address, _ in bound} <= LOOPBACK, bound


def test_model_runs_in_the_engine_process_on_cpu(server: Served) -> None:
    """One rank on CPU: the model runs in vLLM's engine-core process, with no worker process beside it
    (whose reply queue the engine core would busy-wait on through every step, a core of two)."""
    _, _, _, proc, _ = server
    titles = [" ".join(p.cmdline()) for p in psutil.Process(proc.pid).children(recursive=True)]
    assert sum(t.startswith("VLLM::EngineCore") for t in titles) == 1, titles
    assert not any(t.startswith("VLLM::Worker") for t in titles), titles


def status(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moet.cli", "status", *args], env=env, capture_output=True, text=True, timeout=60)


def test_says_when_ready_is_found_by_status_and_stops_quietly_on_ctrl_c(server: Served) -> None:
    """Runs last in this module: it stops the server. Progress while loading, a ready line only after
    vLLM answered, none of vLLM's misleading warnings, `moet status` from another shell showing the
    engine's figures, and after Ctrl-C an orderly stop with no exit-time leak reports."""
    port, log, name, proc, env = server
    ready = f"moet: serving {name} on http://127.0.0.1:{port}/v1: ready after "
    deadline = time.monotonic() + 120  # /health answered; the warm-up completion may still be running
    while not any(line.startswith(ready) for line in log.read_text().splitlines()) and time.monotonic() < deadline:
        time.sleep(0.5)
    lines = log.read_text().splitlines()
    at_ready = next(i for i, line in enumerate(lines) if line.startswith(ready))
    assert any(line.startswith(f"moet: loading {name} (") for line in lines[:at_ready]), "no progress while loading"
    assert lines.index("INFO:     Application startup complete.") < at_ready
    for misleading in ("Unknown vLLM environment variable", "Triton is", "requires Triton"):
        assert not any(misleading in line for line in lines), misleading

    report = json.loads(status(env, name, "--json").stdout)[name]
    assert (report["state"], report["health"], report["supervisor"]["pid"]) == ("serving", "200", proc.pid)
    assert report["engine"]["expert_tensors"] > 0 and report["engine"]["base_bytes"] > 0
    text = status(env).stdout.splitlines()
    assert text[0] == f"{name}: serving at http://127.0.0.1:{port} (health: 200; started by moet serve, pid {proc.pid})"

    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0
    lines = log.read_text().splitlines()
    assert lines[-1] == f"moet: stopped {name}" and f"moet: stopping {name}: SIGTERM to vLLM, SIGKILL after 30 s" in lines
    vllm_lines = [line for line in lines if not line.startswith("moet: note: ")]
    assert not any(noise in line for line in vllm_lines for noise in ("nanobind", " - leaked ", "resource_tracker"))
    gone = status(env)
    assert name not in gone.stdout
    if not DEFAULT_CONFIG.exists():
        assert gone.returncode == 3 and gone.stdout.startswith("moet: nothing to report: no `moet serve` is running")
