#!/usr/bin/env bash
# Create .venv-lmcache, the LMCache peer's virtualenv, for benchmarks/bench_lmcache.py:
# torch 2.13.0 (the local CPU wheel), lmcache 0.5.6 with its dependencies, kvstore editable.
# Nothing of LMCache is committed: it lives only in this git-ignored venv (~1.9 GB).
# Idempotent: a stamp records what was installed; a complete venv is left alone (rebuilt in
# place when the versions below or pyproject.toml change). Needs python3 (>= 3.10) and pip.
# pip's output goes to $venv/setup.log; on failure its tail is printed and the exit is non-zero.
#   KVSTORE_LMCACHE_VENV  where the virtualenv lives (default: .venv-lmcache in the repo)
set -euo pipefail
cd "$(dirname "$0")/../.."
venv="${KVSTORE_LMCACHE_VENV:-.venv-lmcache}"
python="${PYTHON:-python3}"
torch_version="2.13.0"
lmcache_version="0.5.6"
stamp="$venv/.kvstore-lmcache-installed"
want="torch-$torch_version-lmcache-$lmcache_version-$(sha256sum pyproject.toml | cut -c1-16)"
log="$venv/setup.log"

fail() {
  echo "setup_lmcache: FAILED: $*" >&2
  if [ -f "$log" ]; then
    echo "setup_lmcache: last lines of $log:" >&2
    grep -v "is ignored: it is neither a file nor a directory" "$log" | tail -n 15 >&2 || true
  fi
  echo "setup_lmcache: bench_lmcache.py reports {\"skipped\": true} until this succeeds" >&2
  exit 1
}

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "setup_lmcache: creating $venv: lmcache==$lmcache_version over torch==$torch_version" >&2
start=$(date +%s)
"$python" -m venv "$venv" || fail "could not create the virtualenv $venv with $python"
rm -f "$stamp"
: > "$log"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install --upgrade "pip>=23" >> "$log" 2>&1 || fail "could not upgrade pip"
# Any torch spec but this exact pin pulls a multi-GB CUDA build: install it first, and hold it
# with a constraints file while LMCache's dependencies (which ask for any torch) resolve.
constraints="$venv/constraints.txt"
echo "torch==$torch_version" > "$constraints"
"${pip[@]}" install "torch==$torch_version" >> "$log" 2>&1 \
  || fail "torch==$torch_version did not install (is the local CPU wheel there?)"
"${pip[@]}" install -c "$constraints" "lmcache==$lmcache_version" >> "$log" 2>&1 \
  || fail "lmcache==$lmcache_version did not install"
# kvstore itself, editable, against the same pinned torch.
"${pip[@]}" install -c "$constraints" -e . >> "$log" 2>&1 || fail "kvstore did not install"
"${pip[@]}" check >> "$log" 2>&1 || fail "pip check found broken requirements"
LMCACHE_LOG_LEVEL=ERROR "$venv/bin/python" - >> "$log" 2>&1 <<PY || fail "the venv does not import"
import importlib.metadata, torch, kvstore  # noqa: F401
from lmcache.v1.storage_backend.storage_manager import StorageManager  # noqa: F401
assert torch.__version__.split("+")[0] == "$torch_version", f"torch became {torch.__version__}"
assert importlib.metadata.version("lmcache") == "$lmcache_version"
PY
echo "$want" > "$stamp"
echo "setup_lmcache: lmcache $lmcache_version, torch $torch_version: done in $(( $(date +%s) - start )) s" >&2
