#!/usr/bin/env bash
# Create the virtualenv and install kvstore with its dev tools. Idempotent:
# re-runs only when pyproject.toml changed. Needs only python3 (>= 3.10) and pip.
#   KVSTORE_VENV   where the virtualenv lives (default: .venv in the repo)
#   KVSTORE_EXTRAS pip extras to install (default: dev,encrypt: the dev tools, and
#                  cryptography for encryption at rest)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${KVSTORE_VENV:-.venv}"
extras="${KVSTORE_EXTRAS:-dev,encrypt}"
python="${PYTHON:-python3}"
stamp="$venv/.kvstore-installed"
want="$(sha256sum pyproject.toml | cut -c1-16)-$extras"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "setup: creating $venv and installing kvstore-tiers[$extras] (imports as kvstore)" >&2
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install --upgrade "pip>=23" >&2

# A CPU-only torch wheel may be provided locally (pip's find-links). Pin it first,
# so that the range in pyproject.toml does not pull a multi-GB CUDA build.
tmp="$(mktemp -d)"
if "${pip[@]}" download --no-index --no-deps -d "$tmp" "torch==2.13.0" >/dev/null 2>&1; then
  "${pip[@]}" install "torch==2.13.0" >&2
fi
rm -rf "$tmp"

# The distribution was named "kvstore" before (the name of an unrelated package on the public
# index): drop such an install of this checkout and its build metadata in the source tree,
# or two distributions would own `kvstore`.
"${pip[@]}" uninstall -y kvstore >/dev/null 2>&1 || true
rm -rf kvstore.egg-info
# setuptools' build backend says "Editable installation" in a 10-line banner (a warning,
# pypa/packaging-problems#558) that recent pip shows: information, not a problem. Only that
# warning is filtered, in the backend's process (it inherits the variable).
PYTHONWARNINGS="ignore:Editable installation${PYTHONWARNINGS:+,$PYTHONWARNINGS}" \
  "${pip[@]}" install -e ".[$extras]" >&2
echo "$want" > "$stamp"
