#!/usr/bin/env bash
# README command (b): install the CPU stack (cached) and run the whole test suite, end-to-end runs included, and the
# tests that touch transformers again on verl 0.9.1's pinned transformers (scripts/install_pinned.sh, cached).
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
bash scripts/install_pinned.sh
# The pinned tier: every test whose imports reach transformers (markers set at collection, tests/conftest.py), on
# .venv-pinned, where vLLM is not installed; its own build folder (model folders saved by the other transformers).
PINNED=(env RREDCOT_E2E_CLAIMS= RREDCOT_TEST_BUILDS= .venv-pinned/bin/python -m pytest -q -p no:cacheprovider
        --timeout=1500 --durations=5 -m "transformers and not vllm and not e2e" tests)
# Without arguments: the end-to-end launches in one stream, beside the fast tier and then beside the pinned tier (a
# launch keeps the two cores only 50-80% busy while its Ray, FSDP and vLLM processes start). One launch at a time: two
# side by side with a tier beside them oversubscribe two cores and slow every launch.
# Builds the fast tier and the launches both need (a miniature family's warm start) are made once and shared.
BUILDS="$(mktemp -d /tmp/rredcot_test_builds.XXXXXX)"
export RREDCOT_TEST_BUILDS="$BUILDS"
E2E_LOG="$(mktemp /tmp/rredcot_e2e.XXXXXX.log)"
PINNED_LOG="$(mktemp /tmp/rredcot_pinned.XXXXXX.log)"
"${PYTEST[@]}" -m e2e tests >"$E2E_LOG" 2>&1 &
E2E_PID=$!
trap 'kill $E2E_PID 2>/dev/null || true' INT TERM
set +e
echo "== fast tier (the end-to-end tier runs beside it; its log follows) =="
"${PYTEST[@]}" -m "not e2e" tests
FAST_RC=$?
"${PINNED[@]}" >"$PINNED_LOG" 2>&1
PINNED_RC=$?
wait "$E2E_PID"
E2E_RC=$?
set -e
echo "== end-to-end tier =="
cat "$E2E_LOG"
echo "== tests that touch transformers, on verl's pinned transformers ($(.venv-pinned/bin/python -c \
  'import transformers; print(transformers.__version__)')) =="
cat "$PINNED_LOG"
rm -rf "$BUILDS"
echo "fast tier exit $FAST_RC, end-to-end tier exit $E2E_RC, pinned tier exit $PINNED_RC"
[ "$FAST_RC" -eq 0 ] && [ "$E2E_RC" -eq 0 ] && [ "$PINNED_RC" -eq 0 ]
