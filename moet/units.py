"""The systemd units of the appliance, from the model list: one plan, rendered to unit files here and
mirrored key for key by nix/lib.nix (a test evaluates both on the same list and compares).

Plan: the `moet@.service` template (hardening, directories, sd_notify contract), one drop-in per
model, `moet.target` wanting every model, the NVMe swap service, and the tmpfiles rules that give
the `moet` user its pack, staging and state directories before any model starts.
"""

from __future__ import annotations

from typing import Any, Union

from moet.config.schema import Config

Section = dict[str, Union[str, list[str]]]
Unit = dict[str, Section]
USER = "moet"
LIBEXEC = "/usr/local/libexec/moet"
# Where the units read the model list (install-units copies it there; NixOS writes it there).
INSTALLED_CONFIG = "/etc/moet/models.yaml"
# systemd stops waiting for the supervisor this long after its own grace for vLLM ran out.
STOP_MARGIN_S = 15
# The nvidia character devices by /proc/devices name, as nixpkgs' ollama and llama-cpp modules
# allow them. systemd resolves a name to its major number and allows every minor, so
# char-nvidiactl (major 195) also opens /dev/nvidia0..N on drivers that name 195 "nvidia" +
# "nvidiactl" (the H200 host here, 2026-12-02) rather than "nvidia-frontend" (older drivers).
NVIDIA_DEVICES = ["char-nvidiactl rw", "char-nvidia-caps rw", "char-nvidia-frontend rw", "char-nvidia-uvm rw"]


def plan(config: Config, exe: str, config_path: str) -> dict[str, Any]:
    """Every unit and rule for `config`, as JSON-able data (the form nix/lib.nix also returns)."""
    s = config.settings
    result: dict[str, Any] = {
        "template": template(config, exe, config_path),
        "dropins": {name: dropin(config, name) for name in sorted(config.models)},
        "target": {
            "Unit": {
                "Description": "moet: every declared model",
                "Wants": [f"moet@{name}.service" for name in sorted(config.models)],
            },
            "Install": {"WantedBy": "multi-user.target"},
        },
        # state_dir stays root's (systemd's StateDirectory=moet/%i creates below it); the moet user
        # owns what it writes: each model's state and packs, and the shared staging directory.
        "tmpfiles": [f"d {s.state_dir} 0755 root root -"]
        + [f"d {d} 0750 {USER} {USER} -" for d in (s.pack_dir, s.staging_dir)]
        + [f"d {s.state_dir}/{name} 0750 {USER} {USER} -" for name in sorted(config.models)]
        + [f"d {s.pack_dir}/{name} 0750 {USER} {USER} -" for name in sorted(config.models)],
        "swap": None,
    }
    if s.swap.size_mib > 0:
        result["swap"] = {
            "Unit": {
                "Description": f"moet: NVMe swap file {s.swap.path}",
                "DefaultDependencies": "no",
                "RequiresMountsFor": str(s.swap.path.parent),
                "After": "local-fs.target",
                "Conflicts": "umount.target",
                "Before": ["swap.target", "umount.target"],
            },
            "Service": {
                "Type": "oneshot",
                "RemainAfterExit": "yes",
                "ExecStart": f"/bin/sh {LIBEXEC}/moet-swap {s.swap.path} {s.swap.size_mib}",
                "ExecStop": f"-swapoff {s.swap.path}",
            },
            "Install": {"WantedBy": "swap.target"},
        }
    return result


def template(config: Config, exe: str, config_path: str) -> Unit:
    """moet@.service: the supervisor as main process, sandboxed so that CUDA still works.

    Deliberately absent: MemoryDenyWriteExecute (PyTorch/Triton JIT), PrivateDevices (hides
    /dev/nvidia*), MemoryHigh (pinned memory cannot be reclaimed), and RemoveIPC (all models share
    the `moet` user, and stopping one would delete the shared memory of the others' vLLM)."""
    s = config.settings
    return {
        "Unit": {
            "Description": "moet: Mixture-of-Experts model server %i",
            "Documentation": "https://github.com/moet-project/moet",
            "Wants": "network-online.target",
            "After": ["network-online.target", "swap.target", "systemd-tmpfiles-setup.service"],
            "RequiresMountsFor": [str(s.state_dir), str(s.pack_dir), str(s.staging_dir)],
            "PartOf": "moet.target",
        },
        "Service": {
            "Type": "notify",
            "NotifyAccess": "main",
            "ExecStart": f"{exe} supervise %i --config {config_path}",
            "KillMode": "mixed",
            "TimeoutStartSec": "300",
            "TimeoutStopSec": str(int(s.stop_grace_s) + STOP_MARGIN_S),
            "WatchdogSec": "60",
            "Restart": "on-failure",
            "RestartSec": "10",
            "User": USER,
            "Group": USER,
            "StateDirectory": "moet/%i",
            "CacheDirectory": "moet/%i",
            "RuntimeDirectory": "moet/%i",
            # The moet user's home is read-only here: vLLM, Hugging Face and Triton write to the
            # instance's own state and cache directories instead; no usage reports leave the host.
            "Environment": [
                "PYTHONUNBUFFERED=1",
                "HOME=%S/moet/%i",
                "XDG_CACHE_HOME=%C/moet/%i",
                "TRITON_CACHE_DIR=%C/moet/%i/triton",
                "VLLM_NO_USAGE_STATS=1",
                # Set for the supervisor itself, so that it resolves Hugging Face ids where vLLM will.
                f"HF_HUB_CACHE={s.staging_dir}",
            ],
            "ReadWritePaths": [f"{s.state_dir}/%i", f"{s.pack_dir}/%i", str(s.staging_dir)],
            "ProtectSystem": "strict",
            "ProtectHome": "yes",
            "PrivateTmp": "yes",
            "NoNewPrivileges": "yes",
            "DevicePolicy": "closed",
            "DeviceAllow": NVIDIA_DEVICES,
            "ProcSubset": "all",
            "ProtectKernelTunables": "yes",
            "ProtectKernelModules": "yes",
            "ProtectKernelLogs": "yes",
            "ProtectControlGroups": "yes",
            "ProtectClock": "yes",
            "ProtectHostname": "yes",
            "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6 AF_NETLINK",
            "RestrictNamespaces": "yes",
            "RestrictRealtime": "yes",
            "RestrictSUIDSGID": "yes",
            "LockPersonality": "yes",
            "SystemCallArchitectures": "native",
            "SystemCallFilter": ["@system-service", "~@privileged"],
            "SystemCallErrorNumber": "EPERM",
            "PrivateMounts": "yes",
            "ProtectProc": "invisible",
            "CapabilityBoundingSet": "",
            "UMask": "0027",
            "LimitMEMLOCK": "infinity",
            "ManagedOOMPreference": "avoid",
        },
        "Install": {"WantedBy": "moet.target"},
    }


def dropin(config: Config, name: str) -> Unit:
    """moet@NAME.service.d/model.conf: what systemd itself must know about one model. A worker host of
    a multi-node model serves no API: no key credential (its file need not exist there)."""
    spec = config.models[name]
    nodes = spec.nodes
    where = f"on {spec.host}:{spec.port}"
    if nodes is not None:
        where = (
            f"{where}, head of {nodes.count} nodes (rendezvous port {nodes.port})" if nodes.is_head
            else f"node {nodes.rank} of {nodes.count}, head {nodes.head}:{nodes.port}"
        )
    unit: Unit = {"Unit": {"Description": f"moet: {name} ({spec.model}) {where}"}}
    if spec.api_key_file is not None and (nodes is None or nodes.is_head):
        unit["Service"] = {"LoadCredential": f"api-key:{spec.api_key_file}"}
    return unit


def render(unit: Unit) -> str:
    """Unit-file text: sections in order, a list value as repeated keys."""
    out = []
    for section, keys in unit.items():
        out.append(f"[{section}]")
        for key, value in keys.items():
            for item in value if isinstance(value, list) else [value]:
                out.append(f"{key}={item}")
        out.append("")
    return "\n".join(out)


SWAP_SCRIPT = """#!/bin/sh
# moet-swap PATH SIZE_MIB: create the NVMe swap file once (or again if its size changed), enable it.
set -eu
path=$1 mib=$2
if swapon --show=NAME --noheadings | grep -qxF "$path"; then exit 0; fi
if [ ! -f "$path" ] || [ "$(stat -c %s "$path")" -ne $((mib * 1048576)) ]; then
  mkdir -p "$(dirname "$path")"
  rm -f "$path.tmp"
  # dd, not fallocate: swapon refuses files with holes or unwritten extents on some filesystems.
  dd if=/dev/zero of="$path.tmp" bs=1M count="$mib" status=none
  chmod 600 "$path.tmp"
  mkswap "$path.tmp" >/dev/null
  mv "$path.tmp" "$path"
fi
swapon "$path"
"""


def files(config: Config, exe: str, config_path: str = INSTALLED_CONFIG) -> dict[str, str]:
    """Every unit file install-units writes, by path relative to the root."""
    p = plan(config, exe, config_path)
    out = {
        "etc/systemd/system/moet@.service": render(p["template"]),
        "etc/systemd/system/moet.target": render(p["target"]),
        "etc/tmpfiles.d/moet.conf": "\n".join(p["tmpfiles"]) + "\n",
        "etc/sysusers.d/moet.conf": f"u {USER} - \"moet model server\" {config.settings.state_dir}\n",
    }
    for name, unit in p["dropins"].items():
        out[f"etc/systemd/system/moet@{name}.service.d/model.conf"] = render(unit)
    if p["swap"] is not None:
        out["etc/systemd/system/moet-swap.service"] = render(p["swap"])
        out[f"{LIBEXEC.lstrip('/')}/moet-swap"] = SWAP_SCRIPT
    return out

