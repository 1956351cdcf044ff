#!/usr/bin/env bash
# Submit a paper-scale recipe to a running Ray cluster (GPU): recipes/paper/submit.sh <recipe name> [overrides...]
#   RAY_ADDRESS  the cluster's dashboard address (http://head:8265)
#   DATA_DIR     folder with the prepared parquet files (prepare_math_data.py), visible on every node
# Every node needs this package installed (pip install -e .): the reward function is named by module
# (pkg://rredcot_verl.tasks.math_reward), so each node imports its own installed copy.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
RECIPE="${1:?usage: submit.sh <recipe name without .yaml> [overrides...]}"; shift
: "${RAY_ADDRESS:?set RAY_ADDRESS to the cluster dashboard, e.g. http://head:8265}"
: "${DATA_DIR:?set DATA_DIR to the prepared data folder}"
ENV_JSON=$(python3 -c 'import json,os; print(json.dumps({"env_vars": {"DATA_DIR": os.environ["DATA_DIR"], "RAY_ADDRESS": "auto", "RAY_OVERRIDE_JOB_RUNTIME_ENV": "1"}}))')
exec ray job submit --address "$RAY_ADDRESS" --runtime-env-json "$ENV_JSON" -- \
  python -m rredcot_verl.main --config-dir "$ROOT/recipes/paper" --config-name "$RECIPE" "$@"
