#!/usr/bin/env bash
# Set up (if needed), then lint, type-check and run the whole test suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -k codec).
#   KVSTORE_TEST_WORKERS  pytest-xdist workers (default 2; 1 runs in one process). Each test
#                         module stays on one worker (--dist loadfile): the vLLM end-to-end
#                         modules share their engine runs within a module, and spend most of
#                         their time starting engines, which two workers overlap.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The engines' venv is the longest install (mostly download): it runs beside the rest of
# the set-up and the lint, after setup.sh (both install this checkout in editable mode).
bash scripts/setup-vllm.sh &
engines=$!
trap 'kill "$engines" 2>/dev/null || true' EXIT
bash scripts/setup-dynamo.sh
bash scripts/install-servers.sh
bin="${KVSTORE_VENV:-.venv}/bin"
echo "== ruff" >&2
"$bin/ruff" check kvstore kvharness tests benchmarks examples scripts
"$bin/ruff" format --check kvstore kvharness tests benchmarks examples scripts
echo "== mypy" >&2
"$bin/mypy" kvstore kvharness
wait "$engines"  # its exit status: a failed set-up fails the run here
trap - EXIT
echo "== pytest" >&2
workers="${KVSTORE_TEST_WORKERS:-2}"
parallel=()
if [ "$workers" -gt 1 ]; then
  parallel=(-n "$workers" --dist loadfile)
fi
exec "$bin/python" -m pytest -p no:cacheprovider --durations=40 "${parallel[@]}" "$@"
