"""moet.sdnotify against a datagram socket bound by the test: path and abstract addresses, the
environment scrubbed so no child can speak for the service, and sd_watchdog_enabled's rules."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from moet.sdnotify import Notifier


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_messages_arrive_and_the_socket_leaves_the_environment(tmp_path: Path, abstract: bool) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        if abstract:
            name = f"moet-test-{os.getpid()}"
            sock.bind("\0" + name)
            address = "@" + name
        else:
            address = str(tmp_path / "notify")
            sock.bind(address)
        sock.settimeout(5)
        env = {"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "3000000", "WATCHDOG_PID": str(os.getpid()), "KEEP": "1"}
        notifier = Notifier(env)
        notifier.send(READY=1, STATUS="serving x")
        notifier.send(WATCHDOG=1)
        assert sock.recv(4096) == b"READY=1\nSTATUS=serving x"
        assert sock.recv(4096) == b"WATCHDOG=1"
        notifier.close()
    assert env == {"KEEP": "1"}
    assert notifier.watchdog_interval_s == 1.5


def test_watchdog_for_another_pid_and_no_socket_are_off(capsys: pytest.CaptureFixture[str]) -> None:
    other = Notifier({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "1"})
    assert other.watchdog_interval_s is None
    other.send(STATUS="loading y")  # no NOTIFY_SOCKET: only logged
    other.send(echo=False, STATUS="quiet")
    assert capsys.readouterr().err == "moet: loading y\n"
