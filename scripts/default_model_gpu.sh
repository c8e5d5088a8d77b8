#!/usr/bin/env bash
# One GPU visit for the embedded default model: train the bf16 master, export it to modelopt NVFP4
# (routed experts only), score held-out perplexity of BF16 / NVFP4 / 2-bit, and leave in $OUT what
# must come back (≤ 8 files of ≤ 16 MB: the NVFP4 weights split in two, JSON logs, configs).
# Needs .cache/default_model from `python -m moet.models.data` (carried: token ids are built where
# the corpus interpreter is). Usage: OUT=dir BUDGET=seconds DEVICE=cuda scripts/default_model_gpu.sh
set -euo pipefail
OUT=${OUT:-.cache/default_model/out}
DEVICE=${DEVICE:-cuda}
BUDGET=${BUDGET:-270}
TOKENS=${TOKENS:-65536}
EXTRA=${EXTRA:-}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1  # keeps a carried /tmp/site (wheels the device lacks)
W=$(mktemp -d /tmp/moet_default.XXXXXX)
HELDOUT=.cache/default_model/heldout.npy
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
# shellcheck disable=SC2086
python3 -m moet.models.train --data .cache/default_model --out "$W/master" --device "$DEVICE" \
  --time-budget "$BUDGET" --max-shard-size 500MB --log "$OUT/train_log.json" $EXTRA
python3 -c "import sys; from moet.formats.export import export_nvfp4; export_nvfp4(sys.argv[1], sys.argv[2])" "$W/master" "$W/nvfp4"
tar czf "$OUT/nvfp4_meta.tgz" -C "$W/nvfp4" config.json hf_quant_config.json generation_config.json
split -n 2 -d "$W/nvfp4/model.safetensors" "$OUT/model.safetensors.part"
sha256sum "$W/nvfp4/model.safetensors" | cut -d' ' -f1 > "$OUT/model.safetensors.sha256"
python3 -m moet.eval.perplexity "$W/master" --variants source,fp4,base --heldout "$HELDOUT" \
  --tokens "$TOKENS" --device "$DEVICE" --out "$OUT/ppl_master.json"
python3 -m moet.eval.perplexity "$W/nvfp4" --variants source,base --heldout "$HELDOUT" \
  --tokens "$TOKENS" --device "$DEVICE" --out "$OUT/ppl_nvfp4.json"
ls -la "$OUT"
