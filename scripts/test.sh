#!/usr/bin/env bash
# README command (b): install the CPU stack (cached) and run the whole test suite, end-to-end runs included.
# Extra arguments go to pytest (e.g. `-m "not e2e"` for the fast tier only).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_cpu.sh
# --durations: the slowest tests in every CI log, to keep the suite inside its 30-minute budget.
exec .venv/bin/python -m pytest -q -p no:cacheprovider --timeout=1500 --durations=15 tests "$@"
