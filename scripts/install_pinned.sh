#!/usr/bin/env bash
# Installs verl 0.9.1's pinned transformers stack into ./.venv-pinned (requirements-pinned.txt; idempotent: a second
# run only checks), for the tests that touch transformers (scripts/test.sh runs them there too).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-pinned
STAMP="$VENV/.rredcot-installed"
want=$(cat requirements-pinned.txt requirements-test.txt setup.py | sha1sum | cut -c1-12)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
pip_quiet() {  # as scripts/install_cpu.sh: this machine's unused local index folders warn once per package
  "$VENV/bin/python" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
pip_quiet install -q -U pip
# verl with the requirements it declares: here pip resolves verl's transformers<5.11 with the pin above.
pip_quiet install -q -r requirements-pinned.txt -r requirements-test.txt
# As in scripts/install_cpu.sh: PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break imports next to CPU
# torch (a requirement of verl's may have pulled one in).
pip_quiet uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
PYTHONWARNINGS=ignore pip_quiet install -q --no-deps -e .
echo "$want" > "$STAMP"
