"""`moet install-units`: write the appliance's systemd units for a non-Nix distribution."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from moet.config import load_config
from moet.units import INSTALLED_CONFIG, files


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "install-units",
        help="render moet@.service, one drop-in per model, moet.target, swap and tmpfiles",
        description="Write the units for the model list under ROOT (default /). Then: systemd-sysusers, "
        "systemd-tmpfiles --create, systemctl daemon-reload, systemctl enable --now moet.target.",
    )
    parser.add_argument("--config", type=Path, default=None, help="model list (default $MOET_CONFIG or /etc/moet/models.yaml)")
    parser.add_argument("--root", type=Path, default=Path("/"), help="install under this directory (default /)")
    parser.add_argument("--exe", default=None, help="the moet executable in ExecStart (default: this one)")
    parser.set_defaults(func=run)


def moet_executable() -> str:
    """The `moet` script beside this interpreter (a venv or /usr/bin), else the one on PATH."""
    beside = Path(sys.executable).parent / "moet"
    return str(beside) if beside.is_file() else (shutil.which("moet") or "/usr/bin/moet")


def run(args: argparse.Namespace) -> int:
    """Validate the list, copy it to /etc/moet/models.yaml (the path the units read, readable under
    ProtectHome=), and write the units beside it."""
    located = load_config(args.config)
    written = files(located.config, args.exe or moet_executable())
    written[INSTALLED_CONFIG.lstrip("/")] = located.source.read_text()
    for rel, text in written.items():
        path = args.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if rel.endswith("/moet-swap"):
            path.chmod(0o755)
        print(path)
    return 0
