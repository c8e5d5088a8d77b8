"""`moet status [NAME]`: what each running server and each declared model is doing, from their status
files and /health.

Servers started by `moet serve` are found in their run folders (moet.status.serve_dirs); models of
the model list (--config, $MOET_CONFIG, or /etc/moet/models.yaml when it exists) in their state_dir,
or, when no supervisor runs one, in the `moet serve` folder of its port.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from moet.config import Located, load_config
from moet.config.loader import CONFIG_ENV, DEFAULT_CONFIG
from moet.errors import ConfigError
from moet.serving import health
from moet.status import ENGINE_FILE, PHASE_FILE, read_status, runtime_root, serve_dir, serve_dirs
from moet.supervisor import connect_url

NOTHING_RUNNING = 3  # exit status when there is nothing to report (the LSB code of `status` for "not running")
STOPPED = ("never started", "stopped", "failed", "not running")


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "status",
        help="state, tier sizes and counters of running servers and declared models",
        description="Report every server started by `moet serve` on this host and every model of the model list "
        "(--config FILE, else $MOET_CONFIG, else /etc/moet/models.yaml when it exists). Exit status 0 when "
        f"something was reported, {NOTHING_RUNNING} when there is nothing to report (no `moet serve` running "
        "and no model list), 1 for an unreadable model list or an unknown NAME.",
    )
    parser.add_argument("name", metavar="NAME", nargs="?", help="one model or server (default: all)")
    parser.add_argument("--config", type=Path, default=None, help="model list (default $MOET_CONFIG or /etc/moet/models.yaml)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=run)


def run_status(run_dir: Path, url: str) -> dict[str, Any]:
    """A run folder's phase (if its process lives), /health, and the engine's status file."""
    phase = read_status(run_dir / PHASE_FILE)
    state = phase.get("state", "never started")
    if state not in STOPPED and not _alive(phase.get("pid")):
        state = "not running"
    code = health(url)
    return {
        "state": state,
        "url": url,
        "health": str(code) if code else "unreachable",
        "supervisor": phase,
        "engine": read_status(run_dir / ENGINE_FILE),
    }


def served(run_dir: Path) -> dict[str, Any] | None:
    """The status of the `moet serve` whose run folder this is, None unless its process lives."""
    phase = read_status(run_dir / PHASE_FILE)
    if not _alive(phase.get("pid")) or "url" not in phase:
        return None
    return run_status(run_dir, phase["url"])


def model_status(located: Located, name: str) -> dict[str, Any]:
    """A declared model's status: its supervisor's, else that of a `moet serve` on its port."""
    spec = located.config.models[name]
    entry = run_status(located.config.model_dirs(name)["state"], connect_url(spec.host, spec.port))
    if entry["state"] in STOPPED:
        entry = served(serve_dir(spec.port)) or entry
    return entry


def report(located: Located | None) -> dict[str, dict[str, Any]]:
    """Name → status of every declared model, then of every other live `moet serve` (named
    NAME@PORT when its name is taken)."""
    entries = {name: model_status(located, name) for name in sorted(located.config.models)} if located else {}
    declared_ports = {spec.port for spec in located.config.models.values()} if located else set()
    for run_dir in serve_dirs():
        entry = served(run_dir) if int(run_dir.name) not in declared_ports else None
        if entry is not None:
            name = entry["supervisor"].get("name", run_dir.name)
            entries[name if name not in entries else f"{name}@{run_dir.name}"] = entry
    return entries


def model_list(path: Path | None) -> Located | None:
    """The model list if one is named or exists where it is looked for by default; None if not."""
    if path is None and CONFIG_ENV not in os.environ and not DEFAULT_CONFIG.exists():
        return None
    return load_config(path)


def run(args: argparse.Namespace) -> int:
    located = model_list(args.config)
    entries = report(located)
    if args.name:
        if args.name not in entries:
            where = f"{located.where('models')}: " if located else ""
            raise ConfigError(f"{where}no model named {args.name!r}; running or declared: {', '.join(entries) or 'none'}")
        entries = {args.name: entries[args.name]}
    if not entries:
        if args.json:
            print("{}")
            return NOTHING_RUNNING
        print(f"moet: nothing to report: no `moet serve` is running (none in {runtime_root()}) and there is no model "
              f"list ({DEFAULT_CONFIG}; --config FILE)")
        return NOTHING_RUNNING
    if args.json:
        print(json.dumps(entries, indent=1, sort_keys=True))
        return 0
    for name, entry in entries.items():
        phase = entry["supervisor"]
        by = f"; started by moet serve, pid {phase['pid']}" if phase.get("started_by") == "moet serve" else ""
        print(f"{name}: {entry['state']} at {entry['url']} (health: {entry['health']}{by})")
        if phase.get("status"):
            print(f"  {phase['status']}")
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
