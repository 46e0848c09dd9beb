#!/usr/bin/env bash
# Install the real servers the test suite starts on free ports (redis-server and
# redis-cli, for the Redis tier and its 3-node cluster tests; curl, which the docs' shell
# snippets use and tests/test_docs_snippets.py runs as written). A no-op when present.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1 \
  && command -v curl >/dev/null 2>&1; then
  exit 0
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "install-servers: installing redis-server and curl with apt-get" >&2
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq >&2
$sudo apt-get install -y -qq redis-server curl >&2
# The package may start a system instance on 6379; the tests never use it.
