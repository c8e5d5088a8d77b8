#!/usr/bin/env bash
# The test command (README, .ci/run): installs what the tests need, then runs the whole suite.
#   bash test.sh            everything (~15 min on 2 cores; vLLM-starting tests are marked `vllm`)
#   bash test.sh -m "not vllm"   the fast part
set -euo pipefail
cd "$(dirname "$0")"
# nix-instantiate (parse/eval of nix/*.nix) and systemd-analyze (verify of the units).
need=()
command -v nix-instantiate >/dev/null || need+=(nix-bin)
command -v systemd-analyze >/dev/null || need+=(systemd)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq "${need[@]}"
  else
    echo "test.sh: missing ${need[*]}; install them (apt-get install ${need[*]}) or their tests fail" >&2
  fi
fi
bash install.sh
exec .venv/bin/python -m pytest -q "$@"
