#!/usr/bin/env bash
# Submit a training run to a running Ray cluster (GPU): recipes/paper/submit.sh <recipe> [overrides...]
#   <recipe>     any recipe: a yaml file anywhere (my_recipes/exp.yaml, or my_recipes/exp without .yaml), or the name
#                of one under recipes/paper (qwen3_4b_numina_rredcot); or no recipe at all, only k=v overrides
#                (the first argument holds "="): verl's ppo_trainer plus algorithm.rredcot, as main_ppo is launched.
#   RAY_ADDRESS  the cluster's dashboard address (http://head:8265)
#   DATA_DIR     folder with the prepared parquet files (prepare_math_data.py), visible on every node; optional when
#                the recipe does not read it
# The job's runtime environment carries, from this shell, whichever of these are set (Ray merges it into every actor's):
#   DATA_DIR, trackers: WANDB_API_KEY WANDB_PROJECT WANDB_ENTITY WANDB_MODE WANDB_BASE_URL WANDB_DIR TENSORBOARD_DIR
#   MLFLOW_TRACKING_URI SWANLAB_API_KEY, the hub: HF_TOKEN HUGGING_FACE_HUB_TOKEN HF_HOME HF_ENDPOINT HF_HUB_OFFLINE
#   HF_DATASETS_CACHE, the launcher's: VERL_FILE_LOGGER_PATH RREDCOT_*, and the names listed in SUBMIT_ENV.
# The job runs `python -m rredcot_verl.main` on the cluster with the recipe's folder as --config-dir (an absolute
# path: the recipe must be at the same path there, e.g. on a shared filesystem). Every node needs this package
# installed (pip install -e .): the reward function is named by module (pkg://rredcot_verl.tasks.math_reward), so
# each node imports its own installed copy.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
RECIPE="${1:?usage: submit.sh <recipe.yaml | recipe name under recipes/paper | k=v ...> [overrides...]}"
: "${RAY_ADDRESS:?set RAY_ADDRESS to the cluster dashboard, e.g. http://head:8265}"
CONFIG=()
if [[ "$RECIPE" != *=* ]]; then
  shift
  for candidate in "$RECIPE" "$RECIPE.yaml" "$ROOT/recipes/paper/$RECIPE" "$ROOT/recipes/paper/$RECIPE.yaml"; do
    if [[ -f "$candidate" && "$candidate" == *.yaml ]]; then
      FILE="$(cd "$(dirname "$candidate")" && pwd)/$(basename "$candidate")"
      CONFIG=(--config-dir "$(dirname "$FILE")" --config-name "$(basename "$FILE" .yaml)")
      break
    fi
  done
  [ ${#CONFIG[@]} -gt 0 ] || { echo "submit.sh: no recipe $RECIPE (a .yaml file, or a name under recipes/paper)" >&2; exit 2; }
fi
ENV_JSON=$(python3 -c 'import json,os
names = """DATA_DIR WANDB_API_KEY WANDB_PROJECT WANDB_ENTITY WANDB_MODE WANDB_BASE_URL WANDB_DIR TENSORBOARD_DIR
  MLFLOW_TRACKING_URI SWANLAB_API_KEY HF_TOKEN HUGGING_FACE_HUB_TOKEN HF_HOME HF_ENDPOINT HF_HUB_OFFLINE
  HF_DATASETS_CACHE VERL_FILE_LOGGER_PATH""".split() + os.environ.get("SUBMIT_ENV", "").split()
names += sorted(k for k in os.environ if k.startswith("RREDCOT_"))
env = {k: os.environ[k] for k in names if k in os.environ}
env.update({"RAY_ADDRESS": "auto", "RAY_OVERRIDE_JOB_RUNTIME_ENV": "1"})
print(json.dumps({"env_vars": env}))')
exec ray job submit --address "$RAY_ADDRESS" --runtime-env-json "$ENV_JSON" -- \
  python -m rredcot_verl.main ${CONFIG[@]+"${CONFIG[@]}"} "$@"
