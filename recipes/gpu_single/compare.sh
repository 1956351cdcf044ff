#!/usr/bin/env bash
# GRPO and the README's rows A-D on one GPU, one after the other, each run with the study's keys for its row on top
# of qwen3_0p6b_gsm8k.yaml (same data, seed, group size, budget and learning rate for every run). Each run's name says
# whether it reads the dataset's worked solutions:
#   grpo_without_solutions          the baseline every row is measured against
#   rredcot_with_solutions          README row A: the recipe as written (the solutions value each boundary)
#   ibpo_without_solutions          README row B: IBPO, repairs by rewrite
#   rredcot_without_solutions       README row C: bank of the group's correct traces, else its verified repairs;
#                                   all-equal groups by value differences
#   rredcot_ibpo_without_solutions  README row D: IBPO's shaped outcome placed on the segments by values of that bank
# B-D repair by rewrite as measured, with the package's compare-and-correct prompt for chat models (the study's tiny
# model was asked to solve the question afresh).
#   recipes/gpu_single/compare.sh [overrides...]   # the overrides apply to every run
#   DATA_DIR  folder holding gsm8k/{train,test}.parquet as verl writes them (examples/data_preprocess/gsm8k.py)
#   OUT       where each run's metrics go (default outputs/gpu_single): <run>/metrics.jsonl
# At the end: the demo's comparison of the runs (python -m rredcot_verl.runs): a table of validation accuracy, train
# reward and step time, $OUT/curves.png and $OUT/comparison.json.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
: "${DATA_DIR:?set DATA_DIR to the prepared data folder}"
OUT="${OUT:-$ROOT/outputs/gpu_single}"
k=algorithm.rredcot
RUNS=()
train() {  # train <run name> <overrides...>
  local name=$1
  shift
  RUNS+=("$name")
  mkdir -p "$OUT/$name"
  VERL_FILE_LOGGER_PATH="$OUT/$name/metrics.jsonl" python -m rredcot_verl.main \
    --config-dir "$ROOT/recipes/gpu_single" --config-name qwen3_0p6b_gsm8k \
    trainer.experiment_name="qwen3_0p6b_gsm8k_$name" trainer.default_local_dir="$OUT/$name/checkpoints" "$@"
}
train grpo_without_solutions algorithm.adv_estimator=grpo "$@"
train rredcot_with_solutions "$@"
train ibpo_without_solutions algorithm.adv_estimator=ibpo $k.ibpo.repair_operator=rewrite "$@"
train rredcot_without_solutions $k.candidates.source=group_and_repairs \
  $k.redistribution.degenerate_groups=value_differences $k.ibpo.repair_operator=rewrite "$@"
train rredcot_ibpo_without_solutions algorithm.adv_estimator=rredcot_ibpo $k.candidates.source=group_and_repairs \
  $k.ibpo.repair_operator=rewrite "$@"
python -m rredcot_verl.runs --out "$OUT" "${RUNS[@]}"
