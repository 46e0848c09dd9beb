#!/usr/bin/env bash
# Download, here (where pip reaches the package index), the wheels scripts/gpu-check.sh
# installs on a GPU machine that reaches none: what its image (Python 3.12, torch with CUDA,
# transformers, numpy, xxhash, pyyaml, pytest, pytest-xdist, pytest-timeout) lacks
# (cryptography and its cffi: encryption at rest, bench_encrypt).
# They land in .whl/ (keep it out of git: echo /.whl/ >> .git/info/exclude) and travel with
# the device tool's `carry: [".whl"]`.
# Triton (the rows kernel, copies/kernel.py): the image's torch (2.11, PyPI's CUDA build)
# requires triton==3.6.0 and has it. Only for an image without it, GPU_WHEELS_TRITON=1 adds
# that wheel (~160 MB: more than the device tool carries, 64 MiB in all, so only for a
# machine that copies .whl/ another way); gpu-check.sh installs whatever .whl/ holds.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
wheels=(lz4==4.4.4 msgspec==0.19.0 pyzmq==27.1.0 pytest-asyncio==1.2.0
  cryptography==50.0.2 cffi==2.1.1 pycparser==3.12)
if [ "${GPU_WHEELS_TRITON:-0}" = 1 ]; then
  wheels+=("triton==${GPU_WHEELS_TRITON_VERSION:-3.6.0}")
fi
for wheel in "${wheels[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$wheel"
done
ls .whl
