"""`moet serve` end to end: the real server on loopback, driven by the official `openai` client."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.servers import free_port, http_status, serving

pytestmark = pytest.mark.vllm
API_KEY = "test-key-0123456789"


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path, str]]:
    """A `moet serve` of the tiny NVFP4 Qwen3-MoE with 2-bit experts and an API key from a file."""
    model = checkpoint("qwen3_moe", "nvfp4")
    tmp = tmp_path_factory.mktemp("serve")
    key_file = tmp / "api-key"
    key_file.write_text(API_KEY + "\n")
    port = free_port()
    log = tmp / "server.log"
    with serving([str(model), "--name", "tiny", "--api-key-file", str(key_file)], port, log):
        yield port, log, "tiny"


def test_openai_client_round_trip(server: tuple[int, Path, str]) -> None:
    port, log, name = server
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


def test_api_key_required(server: tuple[int, Path, str]) -> None:
    port, _, _ = server
    assert http_status(f"http://127.0.0.1:{port}/v1/models") == 401
    assert http_status(f"http://127.0.0.1:{port}/v1/models", {"Authorization": "Bearer wrong"}) == 401
    assert http_status(f"http://127.0.0.1:{port}/v1/models", {"Authorization": f"Bearer {API_KEY}"}) == 200


def test_api_key_not_on_the_command_line(server: tuple[int, Path, str]) -> None:
    """`ps` shows argv to every user: the key must only travel in the environment."""
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert "vllm.entrypoints" in out and API_KEY not in out
