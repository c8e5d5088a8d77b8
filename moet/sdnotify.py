"""sd_notify(3) over the stdlib: the supervisor's messages to systemd on $NOTIFY_SOCKET.

Outside systemd (no NOTIFY_SOCKET) every call is a no-op, so `moet supervise` runs by hand too.
STATUS lines are also logged to stderr, which journald keeps next to vLLM's own output.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
import socket
import sys


class Notifier:
    """One datagram per message, as sd_notify sends them; takes the socket out of the environment
    so that no child can speak for the service (NotifyAccess=main)."""

    def __init__(self, environ: MutableMapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        address = env.pop("NOTIFY_SOCKET", None)
        self._address = "\0" + address[1:] if address and address.startswith("@") else address
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) if self._address else None
        self.watchdog_interval_s = _watchdog_interval(env)

    def send(self, echo: bool = True, **fields: object) -> None:
        """Send `KEY=value` lines, e.g. send(READY=1, STATUS="serving"); `echo` logs STATUS too."""
        if echo and "STATUS" in fields:
            print(f"moet: {fields['STATUS']}", file=sys.stderr, flush=True)
        if self._sock is None:
            return
        message = "\n".join(f"{key}={value}" for key, value in fields.items())
        try:
            self._sock.sendto(message.encode(), self._address)
        except OSError as exc:  # systemd gone or socket not ours: logging is all that is left
            print(f"moet: sd_notify failed: {exc}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()


def _watchdog_interval(env: MutableMapping[str, str]) -> float | None:
    """Half of WatchdogSec= (as sd_watchdog_enabled(3) advises), or None when no watchdog is armed
    for this process."""
    usec = env.pop("WATCHDOG_USEC", None)
    pid = env.pop("WATCHDOG_PID", None)
    if not usec or (pid and int(pid) != os.getpid()):
        return None
    return int(usec) / 2e6
