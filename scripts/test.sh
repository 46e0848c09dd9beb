#!/usr/bin/env bash
# Set up (if needed), then lint, type-check and run the whole test suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -k codec).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup-vllm.sh
bash scripts/install-servers.sh
bin="${KVSTORE_VENV:-.venv}/bin"
echo "== ruff" >&2
"$bin/ruff" check kvstore tests benchmarks examples
"$bin/ruff" format --check kvstore tests benchmarks examples
echo "== mypy" >&2
"$bin/mypy" kvstore
echo "== pytest" >&2
exec "$bin/python" -m pytest -p no:cacheprovider "$@"
