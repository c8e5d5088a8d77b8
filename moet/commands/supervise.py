"""`moet supervise NAME`: run one model of the list as the main process of moet@NAME.service."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moet.errors import MoetError
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


def plan_line(args: argparse.Namespace) -> str | None:
    """The plan's one-line summary for model NAME; None where the list or the model is invalid (supervise says why).
    Raises MoetError when the model certainly cannot fit this host."""
    from moet.commands.plan import startup_check
    from moet.config import load_config
    from moet.models import resolve_model

    try:
        located = load_config(args.config)
        spec = located.config.models[args.name]
        model_dir = resolve_model(None if spec.model == "default" else spec.model)
    except (MoetError, KeyError):
        return None
    ranks = len(spec.gpus) if spec.gpus else None
    if spec.nodes is not None:  # the weights are shared by every host's ranks (pipeline stages planned as tensor shards)
        ranks = spec.ranks_per_node() * spec.nodes.count
    return startup_check(model_dir, located.config.knobs_for(args.name), spec.args, ranks)


def run(args: argparse.Namespace) -> int:
    from moet.supervisor import supervise

    notifier = Notifier()
    try:
        try:
            line = plan_line(args)
        except MoetError as exc:
            notifier.send(echo=False, STATUS=f"plan: {exc}")  # the CLI prints it once
            raise
        if line is not None:
            print(line, file=sys.stderr, flush=True)
        return supervise(args.config, args.name, notifier)
    finally:
        notifier.close()
