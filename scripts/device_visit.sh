#!/usr/bin/env bash
# One device visit: GPU tests, `moet bench kernels`, `moet bench e2e`, `moet bench hybrid`, results under $OUT
# (docs/KERNELS.md).
# The device image lacks pydantic (moet.knobs): carry its wheels in .whl (README of the device tool) and
# they are installed under /tmp/site. The bench modules are called directly (no console script there).
# Usage (device tool): bash scripts/device_visit.sh "<kernels bench args|->" "<pytest -k expr|->" "<e2e args|->" ["<hybrid args|->"]
# The hybrid bench computes misses on the host: the C++ CPU kernel is built there first (ninja from .whl).
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MOET_BENCH_DIR=$OUT TRITON_CACHE_DIR=/tmp/triton-cache
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PWD:/tmp/site
fi
# KEEP_CACHE=1 brings the Triton cache back in $OUT; carried as .devcarry/triton_cache.tgz it saves the compiles
[ -f .devcarry/triton_cache.tgz ] && mkdir -p $TRITON_CACHE_DIR && tar xzf .devcarry/triton_cache.tgz -C $TRITON_CACHE_DIR
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee $OUT/device.txt
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a $OUT/device.txt
# the CUDA decode cubin travels in moet/kernels/cubins (carry it); if this driver cannot load it, build it here
python3 -c "import sys; from moet.kernels import cuda; sys.exit(0 if cuda.available() else 1)" \
  || python3 scripts/build_kernels.py --cuda-only --targets 90 2>&1 | tail -3 | tee -a $OUT/device.txt
# the C++ CPU kernel: the hybrid bench and its GPU test compute misses on the host (ninja from .whl)
export PATH=/tmp/site/bin:$PATH MOET_CPU_KERNEL_DIR=/tmp/moet-cpu-lib
python3 -m moet.kernels.cpu_build 2>&1 | tail -2 | tee -a $OUT/device.txt
if [ "${2:--}" != - ]; then
  timeout 300 python3 -m pytest -q tests/test_kernels.py tests/test_oracle.py tests/test_device_slots.py tests/test_gpu_cache.py \
    -k "$2" 2>&1 | tail -25 | tee $OUT/pytest.txt
fi
bench() {  # bench <module> <args>
  python3 - $2 <<PY 2>&1 | tee -a $OUT/bench-$1.log
import argparse, sys
from moet.bench import $1 as bench
parser = argparse.ArgumentParser(prog="moet bench $1")
bench.add_arguments(parser)
sys.exit(bench.run(parser.parse_args()))
PY
}
[ "${1:--}" != - ] && bench kernels "$1"
[ "${3:--}" != - ] && bench e2e "$3"
[ "${4:--}" != - ] && bench hybrid "$4"
[ -n "$KEEP_CACHE" ] && tar czf $OUT/triton_cache.tgz -C $TRITON_CACHE_DIR . 2>/dev/null
exit 0
