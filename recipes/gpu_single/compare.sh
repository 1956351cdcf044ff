#!/usr/bin/env bash
# GRPO vs RREDCoT vs IBPO on one GPU, one after the other, same settings: recipes/gpu_single/compare.sh [overrides...]
#   DATA_DIR  folder holding gsm8k/{train,val}.parquet (recipes/paper/prepare_math_data.py --dataset openai/gsm8k)
#   OUT       where each run's metrics go (default outputs/gpu_single): <estimator>/metrics.jsonl
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
: "${DATA_DIR:?set DATA_DIR to the prepared data folder}"
OUT="${OUT:-$ROOT/outputs/gpu_single}"
for estimator in grpo rredcot ibpo; do
  mkdir -p "$OUT/$estimator"
  VERL_FILE_LOGGER_PATH="$OUT/$estimator/metrics.jsonl" python -m rredcot_verl.main \
    --config-dir "$ROOT/recipes/gpu_single" --config-name qwen3_0p6b_gsm8k \
    algorithm.adv_estimator="$estimator" trainer.default_local_dir="$OUT/$estimator/checkpoints" "$@"
done
