#!/usr/bin/env bash
# Create .venv-dynamo: NVIDIA Dynamo's standalone KV indexer (`python -m dynamo.indexer`, in
# the ai-dynamo-runtime wheel; runs on CPUs, needs no NATS/etcd), plus pyzmq and msgspec for
# hand-written vLLM-format publishers. For tests/events/test_dynamo_indexer.py, which feeds it
# KV events and queries it (tests/events/dynamo_indexer.py drives it). About 280 MB (a 75 MB
# wheel), 15-30 seconds.
# Idempotent: a stamp records what was installed; a complete venv is left alone (it is
# rebuilt in place when the versions below change).
# Needs only python3 (>= 3.10) and pip.
#   KVSTORE_DYNAMO_VENV  where the virtualenv lives (default: .venv-dynamo in the repo; the
#                        tests look only there)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${KVSTORE_DYNAMO_VENV:-.venv-dynamo}"
python="${PYTHON:-python3}"
dynamo_version="1.6.1"
pyzmq_version="27.3.0"
msgspec_version="0.22.0"
stamp="$venv/.kvstore-dynamo-installed"
want="ai-dynamo-runtime-$dynamo_version-pyzmq-$pyzmq_version-msgspec-$msgspec_version"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "setup-dynamo: creating $venv with ai-dynamo-runtime==$dynamo_version (about 280 MB)" >&2
start=$(date +%s)
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
# The runtime wheel alone carries dynamo.indexer (a Rust extension, dynamo._core); the
# `ai-dynamo` meta-package (engines, planner, ...) is not needed.
"${pip[@]}" install "ai-dynamo-runtime==$dynamo_version" "pyzmq==$pyzmq_version" \
  "msgspec==$msgspec_version" >&2
"$venv/bin/python" - <<PY
import importlib.metadata, subprocess, sys
import msgspec, zmq  # noqa: F401  a hand publisher's needs
from dynamo.llm import run_kv_indexer  # noqa: F401  the indexer's entry point
assert importlib.metadata.version("ai-dynamo-runtime") == "$dynamo_version"
out = subprocess.run([sys.executable, "-m", "dynamo.indexer", "--help"],
                     capture_output=True, text=True, timeout=60)
assert out.returncode == 0 and "Standalone KV cache indexer" in out.stdout, out
print(f"setup-dynamo: ai-dynamo-runtime $dynamo_version, pyzmq {zmq.__version__}")
PY
echo "$want" > "$stamp"
echo "setup-dynamo: done in $(( $(date +%s) - start )) s" >&2
