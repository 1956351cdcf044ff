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
# Without arguments: the end-to-end launches in two streams that share their tests (tests/conftest.py: each claims
# the next group of launches left), and the fast tier beside them. A launch keeps the two cores only 50-80% busy while
# its Ray, FSDP and vLLM processes start: the first stream runs beside the fast tier, the second once it is done, beside
# the pinned tier.
CLAIMS="$(mktemp -d /tmp/rredcot_e2e_claims.XXXXXX)"
export RREDCOT_E2E_CLAIMS="$CLAIMS"
# Builds the fast tier and the launches both need (a miniature family's warm start) are made once and shared.
BUILDS="$(mktemp -d /tmp/rredcot_test_builds.XXXXXX)"
export RREDCOT_TEST_BUILDS="$BUILDS"
E2E_LOG_1="$(mktemp /tmp/rredcot_e2e_1.XXXXXX.log)"
E2E_LOG_2="$(mktemp /tmp/rredcot_e2e_2.XXXXXX.log)"
PINNED_LOG="$(mktemp /tmp/rredcot_pinned.XXXXXX.log)"
"${PYTEST[@]}" -m e2e tests >"$E2E_LOG_1" 2>&1 &
E2E_PID_1=$!
E2E_PID_2=
trap 'kill $E2E_PID_1 $E2E_PID_2 2>/dev/null || true' INT TERM
set +e
echo "== fast tier (the end-to-end streams run beside it; their logs follow) =="
RREDCOT_E2E_CLAIMS= "${PYTEST[@]}" -m "not e2e" tests
FAST_RC=$?
"${PYTEST[@]}" -m e2e tests >"$E2E_LOG_2" 2>&1 &
E2E_PID_2=$!
"${PINNED[@]}" >"$PINNED_LOG" 2>&1
PINNED_RC=$?
wait "$E2E_PID_1"
E2E_RC_1=$?
wait "$E2E_PID_2"
E2E_RC_2=$?
set -e
echo "== end-to-end tier, stream 1 =="
cat "$E2E_LOG_1"
echo "== end-to-end tier, stream 2 =="
cat "$E2E_LOG_2"
echo "== tests that touch transformers, on verl's pinned transformers ($(.venv-pinned/bin/python -c \
  'import transformers; print(transformers.__version__)')) =="
cat "$PINNED_LOG"
rm -rf "$CLAIMS" "$BUILDS"
echo "fast tier exit $FAST_RC, end-to-end streams exit $E2E_RC_1 and $E2E_RC_2, pinned tier exit $PINNED_RC"
[ "$FAST_RC" -eq 0 ] && [ "$E2E_RC_1" -eq 0 ] && [ "$E2E_RC_2" -eq 0 ] && [ "$PINNED_RC" -eq 0 ]
