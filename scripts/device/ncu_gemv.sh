#!/usr/bin/env bash
# On the GPU machine: Nsight Compute (full set) on single decode products of bench_cuda_matmul
# --only: the fp32, int8 and tensor-core decode kernels (KERNELS). CASES: TYPE:ROWSxCOLS:T separated by spaces.
# Full reports in $OUT/ncu_<case>_<kernel>.txt; the lines that say where the time goes on stdout.
set -uo pipefail
. "$(dirname "$0")/env.sh"
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
for c in ${CASES:-q4_K:2048x6144:1}; do
  for k in ${KERNELS:-gemv_kernel gemv_q8_kernel gemv_mma_kernel}; do
    f="$OUT/ncu_${c//[:x]/_}_$k.txt"
    timeout ${NCU_TIMEOUT:-120} "$NCU" --set full --kernel-name regex:"^$k" --launch-skip ${SKIP:-2} --launch-count 1 \
      "$BIN/bench_cuda_matmul" --only "$c" >"$f" 2>&1
    echo "== $c $k (exit $?)"
    grep -E "^ +(Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Registers Per Thread|Block Size|Grid Size|Waves Per SM|Achieved Occupancy|Theoretical Occupancy|Eligible Warps Per Scheduler|Issued Warp Per Scheduler|Warp Cycles Per Issued Instruction|Executed Ipc Active|L2 Hit Rate|L1/TEX Hit Rate|L1/TEX Cache Throughput|Executed Instructions|Local Memory) " "$f" | sed 's/  */ /g'
    grep -E "Est\. (Local )?Speedup|stall|Stall" "$f" | head -${STALLN:-8} | cut -c1-300
  done
done
