#!/usr/bin/env bash
# The whole GPU check in one run, for a machine with an NVIDIA GPU, torch (CUDA) and
# transformers but no package index: install the wheels carried in .whl/ (lz4, msgspec,
# pyzmq, pytest-asyncio: scripts/gpu-wheels.sh fetches them beforehand), build the C extensions
# in place, run the CUDA tests and both GPU benchmarks, and encryption at rest's cost on
# this machine's cores (issue 34: the 2-core CI machine is CPU-bound). Everything lands in
# $OUT (default /tmp/kvstore-gpu): info.txt, build.log, tests.log, bench_gpu.log, gpu.json,
# bench_gpu_model.log, gpu-model.json, bench_encrypt.log, encrypt.json. About five minutes
# on an H100 (each part has a timeout; together they stay under eight minutes).
# The rows kernel (kvstore/copies/kernel.py, Triton): its CUDA tests run with tests/copies,
# bench_gpu.py's gpu.json has `hbm_get_vs_device_copy` (the HBM tier's get(out=gpu) ÷ one
# device copy of the same bytes) and `hbm.rows_kernel` (the Triton version, or why it did
# not run); info.txt says which Triton the run used. The image's torch (PyPI's CUDA build)
# requires Triton, so it is there; a triton wheel in .whl/ (scripts/gpu-wheels.sh with
# GPU_WHEELS_TRITON=1) is installed over it, where it fits the device tool's carry limit.
#   --dry-run          print what would run, run nothing (check the script without a GPU)
#   GPU_CHECK_PARTS    which parts to run (default "tests bench model encrypt")
#   GPU_CHECK_LENGTHS  the model benchmark's prompt lengths (default 4096,16384,32768)
#   GPU_CHECK_DISK     where the model benchmark's disk tier goes (default ~/kvstore-gpu-disk)
#   GPU_CHECK_PYTHON   the Python to run (default python3)
set -uo pipefail
cd "$(dirname "$0")/.."
dry=0
if [ "${1:-}" = "--dry-run" ]; then dry=1; fi
out="${OUT:-/tmp/kvstore-gpu}"
parts="${GPU_CHECK_PARTS:-tests bench model encrypt}"
export PYTHONUNBUFFERED=1
py="${GPU_CHECK_PYTHON:-python3}"

# run CMD... : run it (with --dry-run: print it instead)
run() {
  if [ "$dry" = 1 ]; then echo "+ $*"; return 0; fi
  "$@"
}
if [ "$dry" = 1 ]; then
  echo "dry run (nothing is written): OUT=$out parts=\"$parts\" python=$py"
else
  mkdir -p "$out"
fi

if compgen -G ".whl/*.whl" >/dev/null; then
  run "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/kvstore-site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/kvstore-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "$dry" = 1 ]; then
  echo "PYTHONPATH=$PYTHONPATH"
  for part in $parts; do
    case "$part" in
      tests) echo "+ timeout 150 $py -m pytest ... tests/copies (the rows kernel's CUDA tests:" \
        "tests/copies/test_copies_rows_kernel.py) ... > $out/tests.log" ;;
      bench) echo "+ timeout 150 $py benchmarks/bench_gpu.py --out $out/gpu.json" \
        "(hbm_get_vs_device_copy) > $out/bench_gpu.log" ;;
      model) echo "+ timeout 240 $py benchmarks/bench_gpu_model.py --out $out/gpu-model.json ..." ;;
      encrypt) echo "+ timeout 200 $py benchmarks/bench_encrypt.py --json ... > $out/encrypt.json" ;;
      *) echo "unknown part: $part" >&2; exit 2 ;;
    esac
  done
  "$py" -c 'import sys; sys.path[:0] = [p for p in sys.argv[1:] if p]
from kvstore.copies import kernel
print("rows kernel here:", kernel.reason())' ${PYTHONPATH//:/ } 2>&1 | tail -1
  bash -n "$0" && echo "syntax ok"
  exit 0
fi

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv
  "$py" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())'
  "$py" -c 'import transformers; print("transformers", transformers.__version__)' 2>&1 | tail -1
  "$py" -c 'import triton; print("triton", triton.__version__, triton.__file__)' 2>&1 | tail -1
  "$py" -c 'from kvstore.copies import kernel; print("rows kernel:", kernel.reason())' 2>&1 | tail -1
  nproc; free -g | head -2; df -h /tmp | tail -1
} > "$out/info.txt" 2>&1

"$py" setup.py build_ext --inplace > "$out/build.log" 2>&1 || echo "C extensions not built" >> "$out/build.log"
"$py" -c 'import kvstore.native._memcopy, kvstore.native._chain; print("extensions ok")' >> "$out/build.log" 2>&1

if [[ " $parts " == *" tests "* ]]; then
  # tests/copies holds the rows kernel's tests: the CUDA ones compile it (a few variants,
  # ~1 s each, cached in ~/.triton for the benchmark), the rest run under the interpreter
  timeout 150 "$py" -m pytest -q -p no:cacheprovider --timeout 120 -n 4 \
    tests/copies tests/datapath/test_saves.py tests/datapath/test_prefetch_gpu.py tests/datapath/test_prefetch.py \
    tests/tiers/test_device.py tests/tiers/test_host.py tests/test_memory.py \
    tests/connectors/test_vllm_groups.py > "$out/tests.log" 2>&1
  echo "exit $?" >> "$out/tests.log"
fi
if [[ " $parts " == *" bench "* ]]; then
  timeout 150 "$py" benchmarks/bench_gpu.py --out "$out/gpu.json" > "$out/bench_gpu.log" 2>&1
  echo "exit $?" >> "$out/bench_gpu.log"
fi
if [[ " $parts " == *" model "* ]]; then
  disk="${GPU_CHECK_DISK:-$HOME/kvstore-gpu-disk}"  # not /tmp: that may be tmpfs
  mkdir -p "$disk"
  timeout 240 "$py" benchmarks/bench_gpu_model.py --out "$out/gpu-model.json" --disk-dir "$disk" \
    --lengths "${GPU_CHECK_LENGTHS:-4096,16384,32768}" \
    > "$out/bench_gpu_model.log" 2>&1
  echo "exit $?" >> "$out/bench_gpu_model.log"
fi
if [[ " $parts " == *" encrypt "* ]]; then
  # disk (O_DIRECT) and kvstore-server; the S3 pair needs moto, which the image lacks
  timeout 200 "$py" benchmarks/bench_encrypt.py --json --media disk,server \
    > "$out/encrypt.json" 2> "$out/bench_encrypt.log"
  echo "exit $?" >> "$out/bench_encrypt.log"
fi
tail -n 3 "$out"/*.log
