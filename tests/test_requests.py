"""Absurd and malformed requests to a real `moet serve`: each one gets a 4xx other than 401 (the
request carries the server's API key), and the server stays healthy and keeps answering. The server
is the session's shared one (tests/conftest.py `tiny_serve`, also serving tests/test_serve_e2e.py)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from tests.servers import SERVE_API_KEY, SERVE_WINDOW, SharedServe, http_status

pytestmark = pytest.mark.vllm
WINDOW = SERVE_WINDOW  # --max-model-len: small, so that a prompt longer than the window is cheap to send


@pytest.fixture(scope="module")
def base_url(tiny_serve: SharedServe) -> str:
    port, _, _ = tiny_serve.running()
    return f"http://127.0.0.1:{port}"


def post(url: str, body: bytes, timeout: float = 120) -> tuple[int, str]:
    request = urllib.request.Request(
        url, data=body, headers={"Content-Type": "application/json", "Authorization": f"Bearer {SERVE_API_KEY}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def completion(**fields: object) -> bytes:
    return json.dumps({"model": "tiny", "prompt": "def f(x):", "max_tokens": 2, **fields}).encode()


ABSURD = {
    "max_tokens-huge": completion(max_tokens=10**9),
    "max_tokens-int64-overflow": completion(max_tokens=2**64),
    "n-huge": completion(n=10**6),
    "prompt-longer-than-window": completion(prompt=list(range(1, 4 * WINDOW))),
    "max_tokens-negative": completion(max_tokens=-5),
    "n-negative": completion(n=-1),
    "temperature-negative": completion(temperature=-1.0),
    "top_p-negative": completion(top_p=-0.5),
    "logprobs-negative": completion(logprobs=-3),
    "prompt-token-out-of-vocab": completion(prompt=[10**9]),
    "invalid-utf8": b'{"model": "tiny", "prompt": "\xff\xfe\xc3(", "max_tokens": 2}',
    "not-json": b"\x00\x01 not json {",
    "wrong-types": completion(max_tokens="many", temperature=[1]),
}


@pytest.mark.parametrize("body", list(ABSURD.values()), ids=list(ABSURD))
def test_absurd_request_is_a_4xx_and_the_server_stays_healthy(base_url: str, body: bytes) -> None:
    status, text = post(f"{base_url}/v1/completions", body)
    assert 400 <= status < 500 and status != 401, f"{status}: {text[:500]}"
    assert http_status(f"{base_url}/health") == 200
    status, text = post(f"{base_url}/v1/completions", completion(temperature=0))
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 2
