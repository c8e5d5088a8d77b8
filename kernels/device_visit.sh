#!/usr/bin/env bash
# One device visit: GPU tests, then `moet bench kernels` with results under $OUT (see docs/KERNELS.md).
# The bench module is called directly: the device image lacks moet's CLI dependencies (pydantic).
# Usage (device tool): bash kernels/device_visit.sh "<bench args>" [pytest -k expression]
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MOET_BENCH_DIR=$OUT TRITON_CACHE_DIR=/tmp/triton-cache
# KEEP_CACHE=1 brings the Triton cache back in $OUT; carried as .devcarry/triton_cache.tgz it saves the compiles
[ -f .devcarry/triton_cache.tgz ] && mkdir -p $TRITON_CACHE_DIR && tar xzf .devcarry/triton_cache.tgz -C $TRITON_CACHE_DIR
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee $OUT/device.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a $OUT/device.txt
# the CUDA decode cubin travels in kernels/build (carry it); if this driver cannot load it, build it here
python3 -c "import sys; from moet.kernels import cuda; sys.exit(0 if cuda.available() else 1)" \
  || python3 kernels/build.py --cuda-only --targets 90 2>&1 | tail -3 | tee -a $OUT/device.txt
if [ -n "$2" ]; then
  timeout 240 python3 -m pytest -q -x tests/test_kernels.py -k "$2" 2>&1 | tail -25 | tee $OUT/pytest.txt
fi
python3 - $1 <<'PY' 2>&1 | tee $OUT/bench.log
import argparse, sys
from moet.bench import kernels
parser = argparse.ArgumentParser(prog="moet bench kernels")
kernels.add_arguments(parser)
sys.exit(kernels.run(parser.parse_args()))
PY
[ -n "$KEEP_CACHE" ] && tar czf $OUT/triton_cache.tgz -C $TRITON_CACHE_DIR . 2>/dev/null
exit 0
