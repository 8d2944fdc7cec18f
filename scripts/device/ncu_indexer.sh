#!/usr/bin/env bash
# On the GPU machine: Nsight Compute (full set) on the indexer's mma kernels as `sparsemla bench
# attention` runs them, for one shape, the bf16 keys on each kernel (SPARSEMLA_INDEXER_MMA): staged
# (shared-memory stages), regs (keys straight into registers) and qfrag (queries in registers).
# Nsight Compute fixes the clocks for each profiled kernel, so they are compared without the
# run-to-run spread that the regs kernel showed in session 17 (docs/PERFORMANCE.md).
#   SHAPE glm5|dsv32 (dsv32)   KV bf16|fp8 (bf16)   BATCH (1)   CTX (131072)
#   VARIANTS kernel names for SPARSEMLA_INDEXER_MMA (default "staged regs qfrag")
# Full reports in $OUT/ncu_indexer_<shape>_<kv>_<batch>_<ctx>_<name>.txt; the lines that say where
# the time goes on stdout. The bench's first calls are its warm-up: SKIP of them are not profiled.
set -uo pipefail
. "$(dirname "$0")/env.sh"
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
SHAPE=${SHAPE:-dsv32} KV=${KV:-bf16} BATCH=${BATCH:-1} CTX=${CTX:-131072}
mkdir -p "$OUT"
for name in ${VARIANTS:-staged regs qfrag}; do
  f="$OUT/ncu_indexer_${SHAPE}_${KV}_${BATCH}_${CTX}_$name.txt"
  SPARSEMLA_INDEXER_MMA=$name timeout "${NCU_TIMEOUT:-300}" "$NCU" --set full \
    --kernel-name regex:"indexer_(mma|regs|qfrag)_kernel" --launch-skip "${SKIP:-3}" --launch-count 1 \
    "$BIN/sparsemla" bench attention --shapes "$SHAPE" --kv "$KV" --batch "$BATCH" --context "$CTX" --reps 1 >"$f" 2>&1
  echo "== $SHAPE $KV batch $BATCH context $CTX: $name (exit $?)"
  grep -E "^ +(Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Registers Per Thread|Block Size|Grid Size|Dynamic Shared Memory Per Block|Waves Per SM|Achieved Occupancy|Theoretical Occupancy|Eligible Warps Per Scheduler|Issued Warp Per Scheduler|Warp Cycles Per Issued Instruction|L2 Hit Rate|Executed Instructions|Local Memory) " \
    "$f" | sed 's/  */ /g'
  grep -E "Est\. (Local )?Speedup|stall|Stall" "$f" | head -"${STALLN:-8}" | cut -c1-300
done
