#!/usr/bin/env bash
# GRPO, RREDCoT, IBPO and RREDCoT+IBPO on one GPU, one after the other, same settings:
# NOT MEASURED HERE as run: the rredcot run is the recipe as written (bank both, value_mapping affine) and the
# rredcot_ibpo run keeps value_mapping affine, while the measured runs (README rows A and D) used log_affine; pass
# algorithm.rredcot.redistribution.value_mapping=log_affine to run what was measured. Only the rredcot_ibpo run trains
# without the dataset's solutions.
#   recipes/gpu_single/compare.sh [overrides...]
#   DATA_DIR  folder holding gsm8k/{train,val}.parquet (recipes/paper/prepare_math_data.py --dataset openai/gsm8k)
#   OUT       where each run's metrics go (default outputs/gpu_single): <run>/metrics.jsonl
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
: "${DATA_DIR:?set DATA_DIR to the prepared data folder}"
OUT="${OUT:-$ROOT/outputs/gpu_single}"
train() {  # train <run name> <overrides...>
  local name=$1
  shift
  mkdir -p "$OUT/$name"
  VERL_FILE_LOGGER_PATH="$OUT/$name/metrics.jsonl" python -m rredcot_verl.main \
    --config-dir "$ROOT/recipes/gpu_single" --config-name qwen3_0p6b_gsm8k \
    trainer.default_local_dir="$OUT/$name/checkpoints" "$@"
}
for estimator in grpo rredcot ibpo; do
  train "$estimator" algorithm.adv_estimator="$estimator" "$@"
done
# Without the dataset's solutions: each group's bank is its own correct traces, else its verified repairs.
train rredcot_ibpo algorithm.adv_estimator=rredcot_ibpo algorithm.rredcot.candidates.source=group_and_repairs "$@"
