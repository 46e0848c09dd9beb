#!/usr/bin/env bash
# The deploy tests, the container ones included: build deploy/Dockerfile and run the image,
# the demo in it and the compose cluster with podman (tests/deploy/conftest.py). The first
# run makes a Debian base image and builds every layer (about 5 minutes on 2 cores); later
# runs reuse them from .deploy-cache/ ($DEPLOY_TEST_CACHE) and rebuild only what changed.
# Needs root. Extra arguments go to pytest (e.g. scripts/test-deploy.sh -k compose).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/install-servers.sh
bash scripts/install-containers.sh
bin="${KVSTORE_VENV:-.venv}/bin"
# `-m containers` turns the container tests on; `or not containers` keeps the others.
exec "$bin/python" -m pytest -p no:cacheprovider --durations=10 \
  -m "containers or not containers" tests/deploy "$@"
