"""`moet serve [MODEL]`: vLLM's OpenAI-compatible server with the moet plugin, in the foreground."""

from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path

from moet.errors import ConfigError
from moet.knobs import Knobs
from moet.serving import DEFAULT_HOST, DEFAULT_PORT, resolve_model, server_argv, server_env


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "serve",
        help="serve a model (default: the embedded one) over an OpenAI-compatible API",
        description=(
            "Start vLLM's OpenAI-compatible server with 2-bit routed experts (VLLM_MOE_W2=1 unless set). "
            "MODEL is a checkpoint directory or a cached Hugging Face id; without it, the small MoE "
            "model embedded in moet. Arguments after `--` go to vLLM unchanged, e.g. "
            "`moet serve -- --tensor-parallel-size 2`."
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
    knobs = Knobs.from_env(environ)
    if "VLLM_MOE_W2" not in environ:
        knobs = knobs.model_copy(update={"w2": True})
    return knobs


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


def build_command(args: argparse.Namespace, environ: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The vLLM command line and environment for these arguments."""
    model_dir = resolve_model(args.model)
    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"{model_dir}: no config.json; is the embedded model installed? (pip install -e .)")
    knobs = serve_knobs(environ)
    argv = server_argv(model_dir, args.host, args.port, args.passthrough, served_name=args.name, w2=knobs.w2)
    env = server_env(knobs, environ)
    key = read_api_key(args.api_key_file, environ)
    if key is not None:
        env["VLLM_API_KEY"] = key
    return argv, env


def run(args: argparse.Namespace) -> int:
    environ = dict(os.environ)
    argv, env = build_command(args, environ)
    check_port_free(args.host, args.port)
    print(f"moet: serving {argv[argv.index('--model') + 1]} on http://{args.host}:{args.port}/v1", flush=True)
    os.execvpe(argv[0], argv, env)
