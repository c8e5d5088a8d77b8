#!/usr/bin/env bash
# Nsight Compute over the decode kernels (or, with the tuning "oracle" past 512 tokens, the Gluon prefill kernel),
# one report per "tier tokens tuning [experts]" argument, under $OUT (a device-visit tool).
# Per kernel: time, DRAM throughput, instructions, resident warps, issue activity, the ALU / FMA pipes' load (where
# this ncu knows the metric) and the stall reasons per issued instruction. ncu flushes the caches before each pass.
# Usage: bash scripts/profile_decode.sh "base 1 r6b1k2x3_r2b1k2x0_o6" "fp4 1 r6b1k2x3_r2b1k2x0_o6" "base 8192 oracle 256" ...
set -o pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=$PWD:/tmp/site
WANT="dram__throughput.avg.pct_of_peak_sustained_elapsed gpu__time_duration.sum smsp__inst_executed.sum
sm__warps_active.avg.per_cycle_active smsp__issue_active.avg.pct_of_peak_sustained_active
sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active
sm__inst_executed_pipe_fmaheavy.avg.pct_of_peak_sustained_active sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active
sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active sm__pipe_fmaheavy_cycles_active.avg.pct_of_peak_sustained_active"
for stall in long_scoreboard short_scoreboard math_pipe_throttle wait not_selected selected barrier dispatch_stall \
  no_instruction branch_resolving mio_throttle lg_throttle; do
  WANT="$WANT smsp__average_warps_issue_stalled_${stall}_per_issue_active.ratio"
done
KNOWN=$(ncu --query-metrics 2>/dev/null | awk '{print $1}')
METRICS=$(for m in $WANT; do grep -qx "${m%%.*}" <<<"$KNOWN" && echo -n "$m,"; done)
echo "metrics: ${METRICS%,}" | tee $OUT/ncu-metrics.txt
for spec in "$@"; do
  set -- $spec
  ncu --clock-control none --metrics "${METRICS%,}" -k "regex:moe_(decode|prefill)" --launch-count 2 \
    python3 scripts/profile_decode.py --tier "$1" --tokens "$2" --tuning "$3" --experts "${4:-16}" > "$OUT/ncu-$1-t$2-$3.txt" 2>&1
  tail -4 "$OUT/ncu-$1-t$2-$3.txt"
done
