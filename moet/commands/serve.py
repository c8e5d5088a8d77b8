"""`moet serve [MODEL]`: vLLM's OpenAI-compatible server with the moet plugin, in the foreground.

vLLM runs as a child (moet.supervisor.ServerRun, as under `moet supervise`): `moet:` lines say what
it is doing while it loads, one says when it is ready (after /health answered and a first completion
came back), and Ctrl-C stops it in order. Its phase and its engine's status go to `serve_dir(PORT)`,
where `moet status` finds them; the folder is removed on exit.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
from pathlib import Path

from moet.commands.plan import startup_check
from moet.config.schema import DEFAULT_HOST, DEFAULT_PORT, Settings
from moet.errors import ConfigError
from moet.knobs import Knobs
from moet.sdnotify import Notifier
from moet.models import resolve_model
from moet.serving import check_placement, server_argv, server_env
from moet.status import ENGINE_FILE, PHASE_FILE, STATUS_ENV, read_status, serve_dir
from moet.supervisor import Launch, ServerRun, connect_url


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "serve",
        help="serve a model (default: the embedded one) over an OpenAI-compatible API",
        description=(
            "Start vLLM's OpenAI-compatible server with 2-bit routed experts (VLLM_MOE_W2=1 unless set). "
            "MODEL is a checkpoint directory or a cached Hugging Face id; without it, the small MoE "
            "model embedded in moet. Arguments after `--` go to vLLM unchanged, e.g. "
            "`moet serve -- --tensor-parallel-size 2`. A `moet: serving … ready` line says when it "
            "answers; `moet status` shows it from another shell; Ctrl-C stops it."
        ),
    )
    parser.add_argument("model", nargs="?", help="checkpoint directory or cached hub id (default: embedded model)")
    parser.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST}: this machine only)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    parser.add_argument("--name", help="model name clients use (default: the directory name)")
    parser.add_argument(
        "--api-key-file",
        type=Path,
        help="file holding the API key clients must send (kept off the command line; "
        "also read from $CREDENTIALS_DIRECTORY/api-key under systemd)",
    )
    parser.set_defaults(func=run)


def serve_knobs(environ: dict[str, str]) -> Knobs:
    """The knobs from the environment, with 2-bit experts on unless VLLM_MOE_W2 says otherwise."""
    return Knobs.from_env({"VLLM_MOE_W2": "1", **environ})


def read_api_key(path: Path | None, environ: dict[str, str]) -> str | None:
    """The API key from --api-key-file, else from the systemd credential `api-key`, else none."""
    if path is None and environ.get("CREDENTIALS_DIRECTORY"):
        candidate = Path(environ["CREDENTIALS_DIRECTORY"]) / "api-key"
        path = candidate if candidate.is_file() else None
    if path is None:
        return None
    try:
        key = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the API key ({exc.strerror}); check the path and its permissions") from None
    if not key:
        raise ConfigError(f"{path}: the API key file is empty")
    return key


def check_port_free(host: str, port: int) -> None:
    """Fail before loading anything when the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ConfigError(f"{host}:{port} is not available ({exc.strerror}); choose another --port") from None


def build_launch(args: argparse.Namespace, environ: dict[str, str]) -> Launch:
    """The vLLM command line and environment for these arguments, and where the run reports."""
    model_dir = resolve_model(args.model)
    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"{model_dir}: no config.json; is the embedded model installed? (pip install -e .)")
    knobs = serve_knobs(environ)
    check_placement(knobs)
    name = args.name or model_dir.name
    argv = server_argv(model_dir, args.host, args.port, args.passthrough, served_name=name, w2=knobs.w2)
    env = server_env(knobs, environ)
    key = read_api_key(args.api_key_file, environ)
    if key is not None:
        env["VLLM_API_KEY"] = key
    run_dir = serve_dir(args.port)
    env[STATUS_ENV] = str(run_dir / ENGINE_FILE)
    env.setdefault("PYTHONUNBUFFERED", "1")  # vLLM's lines reach the terminal as they are written, not in blocks
    return Launch(name, model_dir, argv, env, connect_url(args.host, args.port), run_dir, Settings().stop_grace_s)


def run(args: argparse.Namespace) -> int:
    launch = build_launch(args, dict(os.environ))
    check_port_free(args.host, args.port)
    print(startup_check(launch.model_dir, serve_knobs(dict(os.environ)), launch.argv), file=sys.stderr, flush=True)
    try:
        launch.run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{launch.run_dir}: cannot create the status folder ({exc.strerror}); set XDG_RUNTIME_DIR to a writable folder") from None
    notifier = Notifier()
    try:
        return ServerRun(launch, notifier, console=True).run()
    finally:
        notifier.close()
        if read_status(launch.run_dir / PHASE_FILE).get("pid") == os.getpid():  # not a later server's on this port
            shutil.rmtree(launch.run_dir, ignore_errors=True)
