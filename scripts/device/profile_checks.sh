#!/usr/bin/env bash
# On the GPU machine: where the decode time goes. The step profile (SPARSEMLA_STEP_PROFILE=1:
# device time by operation over the decode steps) of the GLM-5-width model at 4K and 128K context
# and at batch 8, then Nsight Compute on the decode matrix products (bench_cuda_matmul --quick), or
# (NCU_STEP=1) on every kernel of one decode step.
# Binaries in $BIN (libraries in $LIBS); logs to $OUT.
set -uo pipefail
. "$(dirname "$0")/env.sh"
mk() { [ -f /tmp/glm5w_$1.gguf ] || "$BIN/sparsemla" make-model --preset glm5-width --layers $1 --type q4_k_m --zeros \
  -o /tmp/glm5w_$1.gguf >/dev/null; }
if [ "${PROFILE:-1}" = 1 ]; then
  mk 2
  for args in "--prompt 4096 --gen 32" "--prompt 131072 --gen 32" "--prompt 1024 --gen 32 --batch 8"; do
    echo "== profile: $args"
    SPARSEMLA_STEP_PROFILE=1 timeout 300 "$BIN/sparsemla" bench -m /tmp/glm5w_2.gguf --device cuda $args 2>&1 | tail -${PROFN:-40}
  done 2>&1 | tee "$OUT/profile.log"
fi
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [ -n "${NCU_KERNEL:-}" ] && [ -n "$NCU" ]; then
  timeout 300 "$NCU" --clock-control none -k "regex:${NCU_KERNEL}" -s ${NCU_SKIP:-20} -c ${NCU_COUNT:-3} \
    --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis --section Occupancy \
    --section LaunchStats --section SchedulerStats "$BIN/bench_cuda_matmul" ${NCU_ARGS:---quick} >"$OUT/ncu.log" 2>&1
  echo "ncu exit $?"; grep -E "gemv|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Stall|Warp Cycles Per Issued|Registers Per|Block Size|Grid Size|Eligible|Issued Warp" "$OUT/ncu.log" | head -${NCUN:-80}
fi
# NCU_STEP=1: every kernel of one decode step of the 3-layer GLM-5-width model, timed alone (graphs
# off), summed per kernel and launch shape (ncu_step_summary.py); found the 77 us MoE combine. Then
# the same for 2 layers, and the difference: one MoE layer, kernel by kernel (session 19's table).
if [ "${NCU_STEP:-0}" = 1 ] && [ -n "$NCU" ]; then
  for L in 3 2; do
    mk $L
    SPARSEMLA_CUDA_GRAPHS=0 timeout 300 "$NCU" --clock-control none --cache-control none --metrics gpu__time_duration.sum \
      --csv "$BIN/sparsemla" bench -m /tmp/glm5w_$L.gguf --device cuda --prompt ${NCU_STEP_PROMPT:-64} --gen 3 ${NCU_STEP_ARGS:-} \
      >"$OUT/ncu_step$L.csv" 2>"$OUT/ncu_step$L.err"
  done
  python3 "$(dirname "$0")/ncu_step_summary.py" "$OUT/ncu_step3.csv" ${NCU_STEP_TOP:-40}
  python3 "$(dirname "$0")/ncu_step_summary.py" "$OUT/ncu_step3.csv" --minus "$OUT/ncu_step2.csv" ${NCU_STEP_TOP:-40}
  python3 "$(dirname "$0")/ncu_step_summary.py" "$OUT/ncu_step3.csv" --order >"$OUT/ncu_step3_order.txt"
fi
if [ -n "${MATMUL:-}" ]; then
  timeout 300 "$BIN/bench_cuda_matmul" $MATMUL 2>&1 | tee "$OUT/matmul.log" | tail -60
fi
