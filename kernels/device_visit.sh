#!/usr/bin/env bash
# One device visit: GPU tests, then `moet bench kernels` with results under $OUT (see docs/KERNELS.md).
# Usage (device tool): bash kernels/device_visit.sh "<bench args>" [pytest -k expression]
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MOET_BENCH_DIR=$OUT
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee $OUT/device.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a $OUT/device.txt
if [ -n "$2" ]; then
  timeout 240 python3 -m pytest -q -x tests/test_kernels.py -k "$2" 2>&1 | tail -25 | tee $OUT/pytest.txt
fi
python3 -m moet.cli bench kernels $1 2>&1 | tee $OUT/bench.log
tar czf $OUT/triton_cache.tgz -C ~/.triton cache 2>/dev/null
exit 0
