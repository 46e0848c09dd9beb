#!/usr/bin/env bash
# Download, here (where pip reaches the package index), the wheels scripts/gpu-check.sh
# installs on a GPU machine that reaches none: what its image (Python 3.12, torch with CUDA,
# transformers, numpy, xxhash, pyyaml, pytest, pytest-xdist, pytest-timeout) lacks
# (cryptography and its cffi: encryption at rest, bench_encrypt).
# They land in .whl/ (keep it out of git: echo /.whl/ >> .git/info/exclude) and travel with
# the device tool's `carry: [".whl"]`.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
for wheel in lz4==4.4.4 msgspec==0.19.0 pyzmq==27.1.0 pytest-asyncio==1.2.0 \
  cryptography==50.0.2 cffi==2.1.1 pycparser==3.12; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$wheel"
done
ls .whl
