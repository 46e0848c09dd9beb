#!/usr/bin/env bash
# Set up (if needed), then lint, type-check and run the whole test suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -k codec).
#   --fast                the fast lane (first argument): no engine virtualenvs (.venv-vllm,
#                         .venv-dynamo are neither built nor used), and the tests marked
#                         slow or engine left out (FAST_LANE below); ruff and mypy still run.
#                         A few minutes; .ci/run runs everything (this script without it).
#   KVSTORE_TEST_WORKERS  pytest-xdist workers (default 2; 1 runs in one process). Each test
#                         module stays on one worker (--dist loadfile): the vLLM end-to-end
#                         modules share their engine runs within a module, and spend most of
#                         their time starting engines, which two workers overlap.
set -euo pipefail
cd "$(dirname "$0")/.."
# The fast lane's selection (pytest -m); tests/test_fast_lane.py checks what it keeps.
FAST_LANE="not slow and not engine"
fast=0
if [ "${1:-}" = "--fast" ]; then
  fast=1
  shift
fi
bash scripts/setup.sh
engines=""
if [ "$fast" -eq 0 ]; then
  # The engines' venv is the longest install (mostly download): it runs beside the rest of
  # the set-up and the lint, after setup.sh (both install this checkout in editable mode).
  bash scripts/setup-vllm.sh &
  engines=$!
  trap 'kill "$engines" 2>/dev/null || true' EXIT
  bash scripts/setup-dynamo.sh
fi
bash scripts/install-servers.sh
bin="${KVSTORE_VENV:-.venv}/bin"
echo "== ruff" >&2
"$bin/ruff" check kvstore kvharness tests benchmarks examples scripts
"$bin/ruff" format --check kvstore kvharness tests benchmarks examples scripts
echo "== mypy" >&2
"$bin/mypy" kvstore kvharness
if [ -n "$engines" ]; then
  wait "$engines"  # its exit status: a failed set-up fails the run here
  trap - EXIT
fi
echo "== pytest" >&2
workers="${KVSTORE_TEST_WORKERS:-2}"
args=(-p no:cacheprovider --durations=40)
if [ "$workers" -gt 1 ]; then
  args+=(-n "$workers" --dist loadfile)
fi
if [ "$fast" -eq 1 ]; then
  args+=(-m "$FAST_LANE")
fi
exec "$bin/python" -m pytest "${args[@]}" "$@"
