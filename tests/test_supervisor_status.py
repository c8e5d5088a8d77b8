"""`moet status` without a server: it reads the supervisor's and the engine's status files and
says plainly when nothing answers (the live case is in test_supervisor.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from moet.status import write_status


def test_status_reports_files_and_an_unreachable_server(tmp_path: Path) -> None:
    cfg = tmp_path / "models.yaml"
    cfg.write_text(f"settings:\n  state_dir: {tmp_path}/state\nmodels:\n  a:\n    port: 8301\n  b:\n    port: 8302\n")
    state = tmp_path / "state" / "a"
    state.mkdir(parents=True)
    # A supervisor that is gone (no pid exceeds the kernel's 2**22 limit) and an engine's counters.
    write_status({"state": "serving", "status": "serving a", "pid": 2**22 + 1}, state / "supervisor.json")
    write_status({"delta_gb": 1.5, "base_cache_hits": 10, "base_cache_misses": 2}, state / "status.json")
    out = subprocess.run([sys.executable, "-m", "moet.cli", "status", "--config", str(cfg), "--json"], capture_output=True, text=True, check=True)
    report = json.loads(out.stdout)
    assert report["a"]["state"] == "not running" and report["a"]["health"] == "unreachable"
    assert report["a"]["engine"] == {"delta_gb": 1.5, "base_cache_hits": 10, "base_cache_misses": 2}
    assert report["b"]["state"] == "never started" and report["b"]["url"] == "http://127.0.0.1:8302"
    text = subprocess.run([sys.executable, "-m", "moet.cli", "status", "a", "--config", str(cfg)], capture_output=True, text=True, check=True).stdout
    assert text.splitlines()[0] == "a: not running at http://127.0.0.1:8301 (health: unreachable)"
    assert "  base_cache_misses: 2" in text.splitlines()
    missing = subprocess.run([sys.executable, "-m", "moet.cli", "status", "zz", "--config", str(cfg)], capture_output=True, text=True)
    assert missing.returncode == 1 and "no model named 'zz'" in missing.stderr
