#!/usr/bin/env bash
# Time the same GPU figure at several revisions on one GPU machine, in one device call:
# the way to find which change moved a figure (run 8 found the 4K host hit at 52 ms against
# run 7's code's 40.5 ms on the same H200). Two steps:
#   here:    bash scripts/gpu-ab.sh prepare REV [REV...]
#            makes a worktree of each revision under .gpu-ab/ (ignored: the script adds it to
#            .git/info/exclude) and prints what to carry (with .whl from gpu-wheels.sh)
#   there:   bash scripts/gpu-ab.sh run
#            builds each worktree's C extensions, then runs bench_gpu_model.py at
#            GPU_AB_LENGTHS (default 4096) for each revision and this tree, in ROUNDS rounds
#            (default 2) of alternating order, and writes $OUT/ab.json: per revision, every
#            rep's host-hit and disk-hit TTFT and the full prefill's.
set -uo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  prepare)
    shift
    [ "$#" -gt 0 ] || { echo "usage: $0 prepare REV [REV...]" >&2; exit 2; }
    grep -qx '/.gpu-ab/' .git/info/exclude 2>/dev/null || echo '/.gpu-ab/' >> .git/info/exclude
    mkdir -p .gpu-ab
    for rev in "$@"; do
      sha=$(git rev-parse --short "$rev") || exit 1
      [ -d ".gpu-ab/$sha" ] || git worktree add -q --detach ".gpu-ab/$sha" "$sha" || exit 1
      rm -f ".gpu-ab/$sha/.git"  # travels as a plain folder
    done
    echo "carry: [\".whl\", \".gpu-ab\"]; command: bash scripts/gpu-ab.sh run"
    ;;
  run)
    out="${OUT:-/tmp/kvstore-gpu-ab}"
    mkdir -p "$out" "$HOME/gpu-ab-disk"
    export PYTHONUNBUFFERED=1
    if compgen -G ".whl/*.whl" >/dev/null; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/kvstore-site .whl/*.whl || exit 1
    fi
    trees=("$PWD")
    for dir in .gpu-ab/*/; do trees+=("$PWD/${dir%/}"); done
    for tree in "${trees[@]}"; do
      (cd "$tree" && python3 setup.py build_ext --inplace > /tmp/gpu-ab-build.log 2>&1) \
        || echo "build failed in $tree" >&2
    done
    rm -f /tmp/gpu-ab-*.json
    for round in $(seq "${ROUNDS:-2}"); do
      order=("${trees[@]}")
      if [ $((round % 2)) -eq 0 ]; then  # every other round backwards: drift cancels out
        order=(); for ((i=${#trees[@]}-1; i>=0; i--)); do order+=("${trees[$i]}"); done
      fi
      for tree in "${order[@]}"; do
        name=$(basename "$tree"); [ "$tree" = "$PWD" ] && name=head
        (cd "$tree" && PYTHONPATH="/tmp/kvstore-site:$tree" timeout 120 python3 \
          benchmarks/bench_gpu_model.py --lengths "${GPU_AB_LENGTHS:-4096}" \
          --disk-dir "$HOME/gpu-ab-disk" --out "/tmp/gpu-ab-$name-$round.json" \
          > /dev/null 2> "/tmp/gpu-ab-$name-$round.log") || echo "$name round $round failed" >&2
      done
    done
    python3 - "$out/ab.json" <<'EOF'
import glob, json, re, sys
rows = {}
for path in sorted(glob.glob("/tmp/gpu-ab-*.json")):
    name = re.match(r"/tmp/gpu-ab-(.+)-(\d+)\.json", path).group(1)
    result = json.load(open(path))
    for length, row in result.get("lengths", {}).items():
        entry = rows.setdefault(name, {}).setdefault(length, {})
        for field in ("ttft_full_ms_all", "ttft_hit_host_ms_all", "ttft_hit_disk_ms_all"):
            entry.setdefault(field, []).extend(row.get(field, []))
for name, lengths in rows.items():
    for length, entry in lengths.items():
        for field, values in list(entry.items()):
            entry[field.replace("_all", "_median")] = sorted(values)[len(values) // 2] if values else None
json.dump(rows, open(sys.argv[1], "w"), indent=1)
for name, lengths in rows.items():
    for length, entry in lengths.items():
        print(name, length, {k: round(v, 1) for k, v in entry.items() if k.endswith("median") and v})
EOF
    ;;
  *)
    echo "usage: $0 prepare REV [REV...] | run" >&2
    exit 2
    ;;
esac
