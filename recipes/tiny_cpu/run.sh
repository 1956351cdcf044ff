#!/usr/bin/env bash
# Train one estimator on the embedded task: recipes/tiny_cpu/run.sh <grpo|rredcot|ibpo|segment_mc> [hydra overrides...]
#
# Env: RREDCOT_BUILD  task + model folder (default outputs/tiny_cpu/build; built and cached if missing)
#      RREDCOT_SETTING  the build's preset (default "default"; "long" for the long setting: pass its data limits,
#                     data.max_prompt_length=64 data.max_response_length=512)
#      OUT            run folder (default outputs/tiny_cpu/<estimator>): metrics.jsonl, train.log, snapshots/
#      RREDCOT_STEPS  training steps (default 30)      RREDCOT_SEED  data seed (default 1)
#      RREDCOT_REWARD_FILE  reward function file (default rredcot_verl/tasks/reward.py, the task's exact-integer reward)
#      RAY_ADDRESS    submit to an existing Ray cluster with `ray job submit` instead of a local run. On a CPU
#                     cluster start the head with: ray start --head --num-cpus=32 --num-gpus=<trainer.n_gpus_per_node>
#      RUN_TIMEOUT    hard wall-clock limit in seconds (default 3600); on expiry the run and its Ray processes end.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
EST="${1:?usage: run.sh <grpo|rredcot|ibpo|segment_mc> [overrides...]}"
shift
[ -f "recipes/tiny_cpu/$EST.yaml" ] || { echo "run.sh: no recipe recipes/tiny_cpu/$EST.yaml" >&2; exit 2; }
PY="${PYTHON:-$ROOT/.venv/bin/python}"
export RREDCOT_BUILD="${RREDCOT_BUILD:-$ROOT/outputs/tiny_cpu/build}"
export RREDCOT_REWARD_FILE="${RREDCOT_REWARD_FILE:-$ROOT/rredcot_verl/tasks/reward.py}"
OUT="${OUT:-$ROOT/outputs/tiny_cpu/$EST}"
mkdir -p "$OUT"
export VERL_FILE_LOGGER_PATH="$OUT/metrics.jsonl"
rm -f "$VERL_FILE_LOGGER_PATH"
"$PY" -m rredcot_verl.tasks.build --out "$RREDCOT_BUILD" --setting "${RREDCOT_SETTING:-default}" >"$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log" >&2; exit 1; }

CMD=("$PY" -m rredcot_verl.main --config-dir "$ROOT/recipes/tiny_cpu" --config-name "$EST"
     "algorithm.rredcot.snapshot_dir=$OUT/snapshots" "trainer.experiment_name=$EST" "$@")
if [ -n "${RAY_ADDRESS:-}" ]; then
  # RAY_ADDRESS=auto inside the job: the driver joins the cluster it runs on instead of starting its own.
  # RAY_OVERRIDE_JOB_RUNTIME_ENV=1: verl's ray.init passes its own runtime_env (with the same variables) to workers;
  # Ray refuses overlapping keys between a job's and the driver's runtime_env unless told to merge them.
  ENV_JSON=$("$PY" -c 'import json,os,sys; e={k: os.environ[k] for k in sys.argv[1:]}; e.update(RAY_ADDRESS="auto", RAY_OVERRIDE_JOB_RUNTIME_ENV="1")
print(json.dumps({"env_vars": e}))' RREDCOT_BUILD RREDCOT_REWARD_FILE VERL_FILE_LOGGER_PATH RREDCOT_STEPS)
  exec timeout -k 30 "${RUN_TIMEOUT:-3600}" "$ROOT/.venv/bin/ray" job submit --address "$RAY_ADDRESS" \
    --runtime-env-json "$ENV_JSON" -- "${CMD[@]}"
fi
# setsid: the whole process group (Ray, vLLM) is ended together on timeout or interrupt.
exec timeout -k 30 "${RUN_TIMEOUT:-3600}" setsid "${CMD[@]}"
