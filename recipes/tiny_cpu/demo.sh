#!/usr/bin/env bash
# README command (a): install the CPU stack, build the embedded task + warm-started model (cached), train GRPO,
# RREDCoT and IBPO for the same number of steps, write metrics/curves/credit report under outputs/demo.
set -euo pipefail
cd "$(dirname "$0")/../.."
started=$(date +%s)
echo "[1/3] installing the CPU stack into .venv (cached after the first run)"
bash scripts/install_cpu.sh
echo "[2/3] building the embedded task and warm-started model (copies the committed artefact)"
.venv/bin/python -m rredcot_verl.tasks.build --out outputs/tiny_cpu/build 2>&1 | grep -v -i warn | tail -3
echo "[3/3] training"
.venv/bin/python recipes/tiny_cpu/demo.py --out outputs/demo "$@"
echo "demo wall time including install: $(( $(date +%s) - started )) s"
