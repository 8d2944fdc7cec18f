#!/usr/bin/env bash
# On the GPU machine: the attention kernels' tests, compute-sanitizer memcheck and racecheck over
# them (shrunk sizes), and `bench attention`. Binaries come prebuilt in $BIN (with their libraries
# in $LIBS); logs go to $OUT.
set -uo pipefail
. "$(dirname "$0")/env.sh"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
timeout ${TEST_TIMEOUT:-150} "$BIN/sparsemla_tests" --gtest_filter="${FILTER:-CudaAttention*}" 2>&1 | tee "$OUT/tests.log" | grep -vE '^\[ +(RUN|OK) ' | tail -60
SAN=/usr/local/cuda/bin/compute-sanitizer
if [ "${SANITIZE:-1}" = 1 ] && [ -x "$SAN" ]; then
  for tool in memcheck racecheck; do
    SPARSEMLA_GPU_TEST_SMALL=1 timeout ${SAN_TIMEOUT:-200} "$SAN" --tool $tool --error-exitcode 9 "$BIN/sparsemla_tests" \
      --gtest_filter="${SAN_FILTER:-CudaAttention*}" >"$OUT/$tool.log" 2>&1
    echo "compute-sanitizer $tool: exit $?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" "$OUT/$tool.log" | tail -4
  done
fi
# BENCH_ARGS: one `bench attention` run; BENCH_RUNS: several, their argument lists separated by ';'.
# Other GPUs' attention shapes timed on this one (its SMs, their shared memory per block and per SM):
#   BENCH_RUNS='--smem-limit 101376 --smem-per-sm 102400;--smem-limit 166912 --smem-per-sm 167936'
# (SM86 / SM89 / SM12x: 99 KB per block, one such block per SM; A100: 163 KB per block).
# BASE_BIN (with BASE_RUNS, likewise): an earlier build's binary, benchmarked first in the same session.
# bench_runs BINARY "RUNS" LOG LABEL: `bench attention` once per ';'-separated argument list.
bench_runs() {
  local bin=$1 log=$3 label=$4 args
  IFS=';' read -ra runs <<<"$2"
  [ ${#runs[@]} = 0 ] && runs=("")
  : >"$log"
  for args in "${runs[@]}"; do
    echo "== ${label}bench attention $args" | tee -a "$log"
    timeout 200 "$bin/sparsemla" bench attention $args 2>&1 | tee -a "$log"
  done
}
[ -n "${BASE_BIN:-}" ] && bench_runs "$BASE_BIN" "${BASE_RUNS:-}" "$OUT/bench_base.log" "before: "
[ "${BENCH:-1}" = 1 ] && bench_runs "$BIN" "${BENCH_RUNS:-${BENCH_ARGS:-}}" "$OUT/bench.log" ""
# SWEEP="bench attention arguments" (e.g. "--shapes glm5 --batch 1 --context 1024 --kv bf16"): the mma
# kernel at every forced split count (SWEEP_SPLITS) and heads per block (16, 32, 64), after the
# launch's own choice, one line each: the forced shape, then the table row of the shape (its
# attention column and, last, what ran). The rows start with the shape's name, not with '|'.
if [ -n "${SWEEP:-}" ]; then
  row() { grep -E '^(glm5|dsv32) ' | head -1 | sed -E 's/ +/ /g'; }
  {
    echo "auto: $(timeout 60 "$BIN/sparsemla" bench attention $SWEEP 2>&1 | row)"
    for hpb in 16 32 64; do for sp in ${SWEEP_SPLITS:-4 8 16 32}; do
      echo "heads/block $hpb splits $sp: $(timeout 60 "$BIN/sparsemla" bench attention $SWEEP --kernel mma \
        --splits $sp --heads-per-block $hpb 2>&1 | row)"
    done; done
  } | tee "$OUT/sweep.log"
fi
# PROFILE="bench attention arguments": Nsight Compute on one launch of the attention kernel, or
# with PROFILE_KERNELS (a regex), the first launch of each kernel and launch shape it matches, with
# their durations and throughputs only.
if [ -n "${PROFILE:-}" ]; then
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  if [ -n "${PROFILE_KERNELS:-}" ]; then
    timeout 200 "$NCU" --clock-control none --kernel-name regex:"$PROFILE_KERNELS" --filter-mode per-launch-config \
      --launch-count 1 --section SpeedOfLight --section LaunchStats --section Occupancy \
      "$BIN/sparsemla" bench attention $PROFILE >"$OUT/ncu.log" 2>&1
    grep -E "^  [a-z_]+.*\(|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Grid Size|Block Size|Registers Per|Achieved Occupancy|Dynamic Shared" \
      "$OUT/ncu.log" | sed -E 's/ +/ /g' | cut -c1-110
  else
    timeout 200 "$NCU" --kernel-name regex:${PROFILE_KERNEL:-mla_mma} --launch-skip 3 --launch-count 1 \
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
      "$BIN/sparsemla" bench attention $PROFILE >"$OUT/ncu.log" 2>&1
    grep -vE "^==PROF==|^ *$" "$OUT/ncu.log" | tail -70
  fi
fi
