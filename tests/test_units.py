"""The rendered units: systemd-analyze verify accepts them, the hardening of docs/SECURITY.md is there, no
secret reaches a unit file or ExecStart, and services/ is exactly what the renderer writes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from moet.config import load_config
from moet.units import files

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "config" / "models.yaml"
SERVICES = REPO / "services"
# services/ holds the units for the example list as a distribution would install them.
REFERENCE_EXE, REFERENCE_CONFIG = "/usr/bin/moet", "/etc/moet/models.yaml"
SECRET = "sk-never-in-a-unit-file"


def services_layout(rel: str) -> str:
    """Where services/ keeps a file that install-units writes to `rel` under the root."""
    for prefix, into in (("etc/systemd/system/", ""), ("etc/", ""), ("usr/local/libexec/moet/", "")):
        if rel.startswith(prefix):
            return into + rel[len(prefix):]
    raise AssertionError(rel)


def write_services() -> None:
    """Regenerate services/ from config/models.yaml (run after changing moet/units.py)."""
    for rel, text in files(load_config(EXAMPLE).config, REFERENCE_EXE, REFERENCE_CONFIG).items():
        path = SERVICES / services_layout(rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`moet install-units` for a two-model list with an API key file and swap, into a temp root."""
    tmp = tmp_path_factory.mktemp("units")
    key = tmp / "chat.key"
    key.write_text(SECRET)
    cfg = tmp / "models.yaml"
    cfg.write_text(
        "settings:\n  pack_dir: /srv/moet/packs\n  staging_dir: /srv/moet/staging\n  stop_grace_s: 20\n"
        "  swap: {path: /srv/swap/moet, size_mib: 1024}\n"
        f"models:\n  chat:\n    port: 8200\n    api_key_file: {key}\n    gpus: [0, 1]\n    w2: true\n    delta_gb: 4\n"
        "  code-2:\n    model: default\n    port: 8201\n"
    )
    root = tmp / "root"
    subprocess.run([sys.executable, "-m", "moet.cli", "install-units", "--config", str(cfg), "--root", str(root)], check=True, capture_output=True)
    return root


def keys(text: str, section: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("["):
            current = line.strip("[]")
        elif "=" in line and current == section:
            key, value = line.split("=", 1)
            out.setdefault(key, []).append(value)
    return out


def test_systemd_analyze_verify_accepts_every_unit_and_dropin(installed: Path) -> None:
    units = installed / "etc/systemd/system"
    assert sorted(p.parent.name for p in units.glob("moet@*.service.d/model.conf")) == ["moet@chat.service.d", "moet@code-2.service.d"]
    env = {**os.environ, "SYSTEMD_UNIT_PATH": f"{units}:"}  # trailing ':' keeps the default search path
    proc = subprocess.run(
        ["systemd-analyze", "verify", "moet@chat.service", "moet@code-2.service", "moet.target", "moet-swap.service"],
        cwd=units, env=env, capture_output=True, text=True,
    )
    # verify only warns (rc 0) on unknown keys, so its output must be empty too.
    assert (proc.returncode, proc.stdout + proc.stderr) == (0, "")


def test_verify_would_catch_an_unknown_key(installed: Path, tmp_path: Path) -> None:
    units = installed / "etc/systemd/system"
    bad = units / "moet@chat.service.d" / "zz-test.conf"
    bad.write_text("[Service]\nMemoryDenyWriteExecutable=yes\n")
    try:
        proc = subprocess.run(["systemd-analyze", "verify", "moet@chat.service"], cwd=units, env={**os.environ, "SYSTEMD_UNIT_PATH": f"{units}:"}, capture_output=True, text=True)
    finally:
        bad.unlink()
    assert "Unknown key 'MemoryDenyWriteExecutable'" in proc.stderr


def test_template_keeps_the_notify_contract_and_cuda_safe_hardening(installed: Path) -> None:
    text = (installed / "etc/systemd/system/moet@.service").read_text()
    unit, service = keys(text, "Unit"), keys(text, "Service")
    expect = {
        "Type": "notify", "NotifyAccess": "main", "KillMode": "mixed", "Restart": "on-failure", "User": "moet",
        "DevicePolicy": "closed", "ProcSubset": "all", "ProtectSystem": "strict", "ProtectHome": "yes",
        "PrivateTmp": "yes", "NoNewPrivileges": "yes", "ManagedOOMPreference": "avoid",
        "StateDirectory": "moet/%i", "CacheDirectory": "moet/%i", "RuntimeDirectory": "moet/%i",
    }
    assert {k: service[k] for k in expect} == {k: [v] for k, v in expect.items()}
    assert {"char-nvidiactl rw", "char-nvidia-frontend rw", "char-nvidia-uvm rw"} <= set(service["DeviceAllow"])
    assert "MemoryDenyWriteExecute" not in service and "MemoryHigh" not in service  # JIT and pinned memory
    assert "RemoveIPC" not in service and "PrivateDevices" not in service  # shared vLLM memory, /dev/nvidia*
    assert service["SystemCallFilter"] == ["@system-service", "~@privileged"] and service["CapabilityBoundingSet"] == [""]
    assert int(service["TimeoutStopSec"][0]) > 20  # longer than the supervisor's stop_grace_s
    assert int(service["WatchdogSec"][0]) > 0
    assert service["ExecStart"][0].endswith("supervise %i --config /etc/moet/models.yaml")
    assert (installed / "etc/moet/models.yaml").read_text() == (installed.parent / "models.yaml").read_text()
    assert {"/srv/moet/packs/%i", "/srv/moet/staging"} <= set(service["ReadWritePaths"])
    assert {"network-online.target", "swap.target", "systemd-tmpfiles-setup.service"} <= set(unit["After"])
    assert {"/srv/moet/packs", "/srv/moet/staging"} <= set(unit["RequiresMountsFor"])


def test_api_key_is_a_credential_and_no_secret_is_rendered(installed: Path) -> None:
    chat = (installed / "etc/systemd/system/moet@chat.service.d/model.conf").read_text()
    assert keys(chat, "Service")["LoadCredential"] == [f"api-key:{installed.parent / 'chat.key'}"]
    assert "LoadCredential" not in (installed / "etc/systemd/system/moet@code-2.service.d/model.conf").read_text()
    for path in installed.rglob("*"):
        if path.is_file():
            assert SECRET not in path.read_text(), path
    exec_start = keys((installed / "etc/systemd/system/moet@.service").read_text(), "Service")["ExecStart"][0]
    assert "key" not in exec_start.lower()


def test_tmpfiles_give_moet_its_directories_and_the_target_wants_every_model(installed: Path) -> None:
    rules = (installed / "etc/tmpfiles.d/moet.conf").read_text().splitlines()
    assert "d /srv/moet/packs/chat 0750 moet moet -" in rules and "d /srv/moet/staging 0750 moet moet -" in rules
    target = keys((installed / "etc/systemd/system/moet.target").read_text(), "Unit")
    assert target["Wants"] == ["moet@chat.service", "moet@code-2.service"]
    swap = (installed / "etc/systemd/system/moet-swap.service").read_text()
    assert "/srv/swap/moet 1024" in swap and "Before=swap.target" in swap
    script = installed / "usr/local/libexec/moet/moet-swap"
    assert subprocess.run(["sh", "-n", str(script)]).returncode == 0


def test_services_dir_is_the_rendering_of_the_example() -> None:
    rendered = files(load_config(EXAMPLE).config, REFERENCE_EXE, REFERENCE_CONFIG)
    for rel, text in rendered.items():
        path = SERVICES / services_layout(rel)
        assert path.is_file() and path.read_text() == text, (
            f"{path} is stale: run .venv/bin/python -c 'from tests.test_units import write_services; write_services()'"
        )


def test_sysusers_and_tmpfiles_create_the_user_and_its_directories(installed: Path) -> None:
    """The real systemd-sysusers and systemd-tmpfiles, run on the install root."""
    subprocess.run(["systemd-sysusers", f"--root={installed}"], check=True, capture_output=True)
    entry = next(line for line in (installed / "etc/passwd").read_text().splitlines() if line.startswith("moet:"))
    uid = int(entry.split(":")[2])
    assert entry.endswith(":/usr/sbin/nologin") and uid < 1000  # a static system user
    subprocess.run(["systemd-tmpfiles", "--create", f"--root={installed}", str(installed / "etc/tmpfiles.d/moet.conf")], check=True)
    for rel, owner, mode in [
        ("var/lib/moet", 0, 0o755),
        ("srv/moet/packs", uid, 0o750),
        ("srv/moet/packs/chat", uid, 0o750),
        ("srv/moet/packs/code-2", uid, 0o750),
        ("srv/moet/staging", uid, 0o750),
        ("var/lib/moet/chat", uid, 0o750),
    ]:
        st = (installed / rel).stat()
        assert (st.st_uid, st.st_mode & 0o777) == (owner, mode), rel
