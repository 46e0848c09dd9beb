#!/usr/bin/env bash
# Create .venv-mooncake, the Mooncake Store peer's virtualenv, for benchmarks/bench_peers.py:
# mooncake-transfer-engine-non-cuda (its CPU wheel: mooncake_master, the standalone store
# process mooncake_client, and mooncake.store) plus numpy, and the three shared libraries its
# store.so links that Debian does not install by default (libibverbs1, libnl-3-200,
# libnl-route-3-200), unpacked from Debian's packages (`apt-get download` + `dpkg-deb -x`)
# into $venv/debs: nothing is installed system-wide. bench_peers.py puts the folders they hold
# (listed, colon-separated, in $venv/ld_library_path) on LD_LIBRARY_PATH for every Mooncake
# process it starts.
# The wheel exists for CPython 3.10-3.13 on x86_64 (manylinux_2_28); nothing of Mooncake is
# committed: it lives only in this git-ignored venv (~150 MB).
# Idempotent: a stamp records what was installed; a complete venv is left alone (rebuilt in
# place when the versions below change). Needs python3 (3.10-3.13), pip, apt-get and dpkg-deb.
# Output of pip and apt goes to $venv/setup.log; on failure its tail is printed, exit 1.
#   KVSTORE_MOONCAKE_VENV  where the virtualenv lives (default: .venv-mooncake in the repo)
set -euo pipefail
cd "$(dirname "$0")/../.."
venv="${KVSTORE_MOONCAKE_VENV:-.venv-mooncake}"
python="${PYTHON:-python3}"
mooncake_version="0.3.13.post1"
debs=(libibverbs1 libnl-3-200 libnl-route-3-200)
stamp="$venv/.kvstore-mooncake-installed"
want="mooncake-transfer-engine-non-cuda-$mooncake_version-debs-${debs[*]// /-}-v2"
want="${want// /-}"
log="$venv/setup.log"

fail() {
  echo "setup_mooncake: FAILED: $*" >&2
  if [ -f "$log" ]; then
    echo "setup_mooncake: last lines of $log:" >&2
    grep -v "is ignored: it is neither a file nor a directory" "$log" | tail -n 15 >&2 || true
  fi
  echo "setup_mooncake: bench_peers.py reports the Mooncake rows as skipped until this succeeds" >&2
  exit 1
}

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "setup_mooncake: creating $venv: mooncake-transfer-engine-non-cuda==$mooncake_version" >&2
start=$(date +%s)
"$python" -c 'import sys; assert (3, 10) <= sys.version_info[:2] <= (3, 13), sys.version' \
  2>/dev/null || fail "$python is not CPython 3.10-3.13 (Mooncake's wheels exist for those only)"
"$python" -m venv "$venv" || fail "could not create the virtualenv $venv with $python"
rm -f "$stamp"
: > "$log"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install --upgrade "pip>=23" >> "$log" 2>&1 || fail "could not upgrade pip"
"${pip[@]}" install "mooncake-transfer-engine-non-cuda==$mooncake_version" numpy >> "$log" 2>&1 \
  || fail "mooncake-transfer-engine-non-cuda==$mooncake_version did not install"
"${pip[@]}" check >> "$log" 2>&1 || fail "pip check found broken requirements"

# The shared libraries, from Debian's packages, unpacked into the venv (no system install).
command -v apt-get > /dev/null || fail "apt-get is not here: the libraries come from Debian's packages"
command -v dpkg-deb > /dev/null || fail "dpkg-deb is not here"
download="$venv/debs/download"
rm -rf "$venv/debs"
mkdir -p "$download"
fetch() { (cd "$download" && apt-get download "${debs[@]}") >> "$log" 2>&1; }
if ! fetch; then
  # A fresh machine may have no package lists yet; refreshing them needs root.
  [ "$(id -u)" = 0 ] || fail "apt-get download ${debs[*]} failed (run apt-get update as root)"
  apt-get update >> "$log" 2>&1 || fail "apt-get update failed"
  fetch || fail "apt-get download ${debs[*]} failed"
fi
for deb in "$download"/*.deb; do
  dpkg-deb -x "$deb" "$venv/debs" >> "$log" 2>&1 || fail "dpkg-deb -x $deb failed"
done
rm -rf "$download"
# Every folder the packages put a library in (libnl-3-200 uses /lib, the others /usr/lib).
libdir="$(find "$(cd "$venv/debs" && pwd)" -name '*.so.*' -printf '%h\n' | sort -u | paste -sd:)"
[ -n "$libdir" ] || fail "the packages held no shared library"
echo "$libdir" > "$venv/ld_library_path"

# Every library store.so needs is found, and the store, master and client all start to load.
LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$venv/bin/python" - >> "$log" 2>&1 <<PY \
  || fail "the venv does not import mooncake.store"
import importlib.metadata, os, subprocess, sys
from mooncake.store import MooncakeDistributedStore  # noqa: F401
assert importlib.metadata.version("mooncake-transfer-engine-non-cuda") == "$mooncake_version"
here = os.path.dirname(__import__("mooncake").__file__)
for binary in ("store.so", "mooncake_master", "mooncake_client"):
    out = subprocess.run(["ldd", os.path.join(here, binary)], capture_output=True, text=True).stdout
    missing = [line for line in out.splitlines() if "not found" in line]
    assert not missing, f"{binary}: {missing}"
PY
echo "$want" > "$stamp"
echo "setup_mooncake: mooncake $mooncake_version, libraries in $libdir: done in $(( $(date +%s) - start )) s" >&2
