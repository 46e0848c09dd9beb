#!/usr/bin/env bash
# Set up (if needed) and run the demo workload on the embedded default config.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${KVSTORE_VENV:-.venv}/bin/kvstore" demo "$@"
