"""`moet status [NAME]`: what each declared model is doing, from its status files and /health."""

from __future__ import annotations

import argparse
import json
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from moet.config import Located, load_config
from moet.errors import ConfigError
from moet.status import read_status
from moet.supervisor import connect_url


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("status", help="state, tier sizes and counters of the declared models")
    parser.add_argument("name", metavar="NAME", nargs="?", help="one model (default: all)")
    parser.add_argument("--config", type=Path, default=None, help="model list (default $MOET_CONFIG or /etc/moet/models.yaml)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=run)


def model_status(located: Located, name: str) -> dict[str, Any]:
    """The supervisor's phase (if its process lives), /health, and the engine's status file."""
    spec = located.config.models[name]
    state_dir = located.config.model_dirs(name)["state"]
    supervisor = read_status(state_dir / "supervisor.json")
    url = connect_url(spec.host, spec.port)
    state = supervisor.get("state", "never started")
    if state not in ("never started", "stopped", "failed") and not _alive(supervisor.get("pid")):
        state = "not running"
    return {
        "state": state,
        "url": url,
        "health": _health(url),
        "supervisor": supervisor,
        "engine": read_status(state_dir / "status.json"),
    }


def run(args: argparse.Namespace) -> int:
    located = load_config(args.config)
    names = [args.name] if args.name else sorted(located.config.models)
    for name in names:
        if name not in located.config.models:
            raise ConfigError(f"{located.where('models')}: no model named {name!r}")
    report = {name: model_status(located, name) for name in names}
    if args.json:
        print(json.dumps(report, indent=1, sort_keys=True))
        return 0
    for name, entry in report.items():
        print(f"{name}: {entry['state']} at {entry['url']} (health: {entry['health']})")
        if entry["supervisor"].get("status"):
            print(f"  {entry['supervisor']['status']}")
        for key, value in sorted(entry["engine"].items()):
            print(f"  {key}: {json.dumps(value) if isinstance(value, (dict, list)) else value}")
    return 0


def _alive(pid: object) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _health(url: str) -> str:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return str(response.status)
    except urllib.error.HTTPError as exc:
        return str(exc.code)
    except OSError:
        return "unreachable"
