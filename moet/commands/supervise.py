"""`moet supervise NAME`: run one model of the list as the main process of moet@NAME.service."""

from __future__ import annotations

import argparse
from pathlib import Path

from moet.sdnotify import Notifier


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "supervise",
        help="serve one model of the list under systemd (sd_notify, watchdog, clean stop)",
        description="Start vLLM for model NAME and report to systemd over $NOTIFY_SOCKET. Exits 0 after "
        "SIGTERM, non-zero when vLLM dies or the configuration is invalid.",
    )
    parser.add_argument("name", metavar="NAME", help="a key of `models:` in the model list")
    parser.add_argument("--config", type=Path, default=None, help="model list (default $MOET_CONFIG or /etc/moet/models.yaml)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moet.supervisor import supervise

    notifier = Notifier()
    try:
        return supervise(args.config, args.name, notifier)
    finally:
        notifier.close()
