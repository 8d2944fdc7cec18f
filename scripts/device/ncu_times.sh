#!/usr/bin/env bash
# On the GPU machine: per-kernel device durations by Nsight Compute (launches serialized, caches and
# clocks left alone) for any command. KERNELS: a regex of kernel names; COUNT launches profiled
# after SKIP. Usage: KERNELS='topk|indexer' COUNT=8 ncu_times.sh "$BIN/sparsemla" bench attention ...
set -uo pipefail
. "$(dirname "$0")/env.sh"
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
timeout ${NCU_TIMEOUT:-240} "$NCU" --clock-control none --cache-control none --section SpeedOfLight \
  --kernel-name regex:"${KERNELS:-.}" --launch-skip ${SKIP:-0} --launch-count ${COUNT:-10} "$@" >"$OUT/ncu_times.txt" 2>&1
echo "ncu exit $?"
# One line per kernel: its name (namespaces dropped), grid x block, duration.
awk '/Context [0-9]+, Stream/ {l=$0; gsub(/[a-z_]+::|\(anonymous namespace\)::|void /, "", l); sub(/\(.*\) \(/, " (", l); sub(/, Context.*/, "", l); name=l}
     /^ +Duration/ {print name, $(NF-1), $NF}' "$OUT/ncu_times.txt" | sed 's/^ *//' | cut -c1-200
