#!/usr/bin/env bash
# README command (b): install the CPU stack (cached) and run the whole test suite, end-to-end runs included.
# Extra arguments go to one pytest over tests/ (e.g. `-m "not e2e"` for the fast tier only).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_cpu.sh
# --durations: the slowest tests in every CI log, to keep the suite inside its 30-minute budget.
# The tiers share two cores with the launches' processes: OpenMP threads that spin while waiting starve the others
# (rredcot_verl/compat/cpu.py sets the same for every process of a CPU run).
export OMP_WAIT_POLICY=PASSIVE
PYTEST=(.venv/bin/python -m pytest -q -p no:cacheprovider --timeout=1500 --durations=15)
if [ "$#" -gt 0 ]; then
  exec "${PYTEST[@]}" tests "$@"
fi
# Without arguments: the end-to-end launches (one Ray cluster at a time) and the fast tier in two processes side by
# side. A launch keeps the two cores only 50-80% busy while its Ray, FSDP and vLLM processes start; the fast tier
# fills the rest.
E2E_LOG="$(mktemp /tmp/rredcot_e2e.XXXXXX.log)"
"${PYTEST[@]}" -m e2e tests >"$E2E_LOG" 2>&1 &
E2E_PID=$!
trap 'kill "$E2E_PID" 2>/dev/null || true' INT TERM
set +e
echo "== fast tier (the end-to-end tier runs beside it; its log follows) =="
"${PYTEST[@]}" -m "not e2e" tests
FAST_RC=$?
wait "$E2E_PID"
E2E_RC=$?
set -e
echo "== end-to-end tier =="
cat "$E2E_LOG"
echo "fast tier exit $FAST_RC, end-to-end tier exit $E2E_RC"
[ "$FAST_RC" -eq 0 ] && [ "$E2E_RC" -eq 0 ]
