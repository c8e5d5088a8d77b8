"""The Nix side: every .nix file parses, and nix/lib.nix's pure plan equals moet/units.py's plan
on the same model list (evaluated by nix-instantiate alone; no nixpkgs needed)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from moet.config import load_config
from moet.units import plan

REPO = Path(__file__).resolve().parents[1]
NIX_FILES = sorted([REPO / "flake.nix", *(REPO / "nix").glob("*.nix")])
EXE, CONFIG = "/nix/store/x-moet/bin/moet", "/etc/moet/models.yaml"


def nix_plan(config_json: Path) -> dict:
    expr = (
        f"(import {REPO / 'nix/lib.nix'}).plan {{ config = builtins.fromJSON (builtins.readFile {config_json}); "
        f'exe = "{EXE}"; configPath = "{CONFIG}"; }}'
    )
    out = subprocess.run(["nix-instantiate", "--eval", "--strict", "--json", "--expr", expr], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("path", NIX_FILES, ids=lambda p: p.name)
def test_every_nix_file_parses(path: Path) -> None:
    out = subprocess.run(["nix-instantiate", "--parse", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_module_files_are_all_there() -> None:
    assert {p.name for p in NIX_FILES} >= {"flake.nix", "lib.nix", "module.nix", "package.nix", "kernels.nix", "image.nix", "vm-test.nix"}


LISTS = {
    "example": (REPO / "config" / "models.yaml").read_text(),
    "two-models": (
        "settings:\n  pack_dir: /srv/moet/packs\n  staging_dir: /srv/moet/staging\n  stop_grace_s: 20.5\n"
        "  swap: {path: /srv/swap/moet, size_mib: 1024}\n"
        "models:\n  chat:\n    port: 8200\n    api_key_file: /etc/moet/chat.key\n    gpus: [0, 1]\n    delta_gb: 4\n"
        "  code-2:\n    model: /srv/models/coder\n    host: 0.0.0.0\n    port: 8201\n"
    ),
    "no-swap": "settings:\n  swap: {size_mib: 0}\nmodels:\n  a:\n    port: 8000\n",
    "multi-node": (
        "models:\n  head:\n    port: 8300\n    gpus: [0, 1]\n    api_key_file: /etc/moet/h.key\n"
        "    nodes: {count: 2, rank: 0, head: 10.0.0.1}\n"
        "  worker:\n    port: 8301\n    api_key_file: /etc/moet/w.key\n"
        "    nodes: {count: 3, rank: 2, head: 10.0.0.5, port: 29600, address: 10.0.0.7, split: tensor}\n"
    ),
}


@pytest.mark.parametrize("name", sorted(LISTS))
def test_nix_helpers_agree_with_the_python_renderer(tmp_path: Path, name: str) -> None:
    cfg = tmp_path / "models.yaml"
    cfg.write_text(LISTS[name])
    config = load_config(cfg).config
    as_json = tmp_path / "models.json"
    as_json.write_text(json.dumps(config.model_dump(mode="json")))
    assert nix_plan(as_json) == plan(config, EXE, CONFIG)


def nix_eval(expr: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["nix-instantiate", "--eval", "--strict", "--json", "--expr", expr], capture_output=True, text=True)


def test_nix_helpers_refuse_a_duplicate_port(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    config = load_config(REPO / "config" / "models.yaml").config.model_dump(mode="json")
    config["models"]["twin"] = {**config["models"]["default"]}
    bad.write_text(json.dumps(config))
    out = nix_eval(f'(import {REPO / "nix/lib.nix"}).plan {{ config = builtins.fromJSON (builtins.readFile {bad}); exe = "x"; configPath = "y"; }}')
    assert out.returncode != 0 and "duplicate ports [8000,8000]" in out.stderr


def test_module_options_write_the_list_the_supervisor_reads(tmp_path: Path) -> None:
    """services.moet option values (as the module system fills them in) -> /etc/moet/models.yaml
    -> moet.config: the same list as config/models.yaml."""
    options = """{
      stateDir = "/var/lib/moet"; packDir = "/var/lib/moet/packs"; stagingDir = "/var/lib/moet/staging";
      stopGraceSec = 30; swap = { path = "/var/swap/moet"; sizeMiB = 16384; };
      models.default = { model = "default"; host = "127.0.0.1"; port = 8000; gpus = null; env = { };
                         args = [ ]; apiKeyFile = null; w2 = true; };
    }"""
    out = nix_eval(f"(import {REPO / 'nix/lib.nix'}).configFromOptions {options}")
    assert out.returncode == 0, out.stderr
    written = tmp_path / "models.yaml"
    written.write_text(out.stdout)
    assert load_config(written).config == load_config(REPO / "config" / "models.yaml").config
    keyed = nix_eval(f'(import {REPO / "nix/lib.nix"}).configFromOptions ({options} // {{ models.k = {{ port = 9; apiKeyFile = "/run/keys/k"; gate = true; delta_gb = 8; }}; }})')
    assert json.loads(keyed.stdout)["models"]["k"] == {"port": 9, "api_key_file": "/run/keys/k", "gate": True, "delta_gb": 8}


def test_module_nodes_option_writes_the_nodes_the_supervisor_reads(tmp_path: Path) -> None:
    """services.moet.models.<name>.nodes (as the module fills in its defaults) -> the YAML list -> moet.config."""
    options = """{
      stateDir = "/var/lib/moet"; packDir = "/var/lib/moet/packs"; stagingDir = "/var/lib/moet/staging";
      stopGraceSec = 30; swap = { path = "/var/swap/moet"; sizeMiB = 0; };
      models.glm = { model = "/srv/models/glm"; host = "127.0.0.1"; port = 8001; gpus = [ 0 1 ]; env = { }; args = [ ];
                     apiKeyFile = null; w2 = true;
                     nodes = { count = 2; rank = 1; head = "10.0.0.1"; port = 29501; address = null; split = "tensor"; }; };
    }"""
    out = nix_eval(f"(import {REPO / 'nix/lib.nix'}).configFromOptions {options}")
    assert out.returncode == 0, out.stderr
    written = tmp_path / "models.yaml"
    written.write_text(out.stdout)
    nodes = load_config(written).config.models["glm"].nodes
    assert nodes is not None and (nodes.count, nodes.rank, nodes.head, nodes.port, nodes.split) == (2, 1, "10.0.0.1", 29501, "tensor")
