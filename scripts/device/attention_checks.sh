#!/usr/bin/env bash
# On the GPU machine: the attention kernels' tests, compute-sanitizer memcheck and racecheck over
# them (shrunk sizes), and `bench attention`. Binaries come prebuilt in $BIN (with their libraries
# in $LIBS); logs go to $OUT.
set -uo pipefail
BIN=${BIN:-.devbin/attn}
export LD_LIBRARY_PATH=${LIBS:-$PWD/.devbin/lib}:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
OUT=${OUT:-/tmp/out}
# NCCL: the CUDA toolkit's, else the copy PyTorch's wheels bring.
if ! ls /usr/local/cuda/lib64/libnccl.so.2 >/dev/null 2>&1; then
  nccl=$(find /usr /opt -name libnccl.so.2 2>/dev/null | head -1)
  [ -n "$nccl" ] && export LD_LIBRARY_PATH=$(dirname "$nccl"):$LD_LIBRARY_PATH
fi
export SPARSEMLA_FIXTURES_DIR=${SPARSEMLA_FIXTURES_DIR:-$PWD/tests/fixtures}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
timeout ${TEST_TIMEOUT:-150} "$BIN/sparsemla_tests" --gtest_filter="${FILTER:-CudaAttention*}" 2>&1 | tee "$OUT/tests.log" | grep -vE '^\[ +(RUN|OK) ' | tail -60
SAN=/usr/local/cuda/bin/compute-sanitizer
if [ "${SANITIZE:-1}" = 1 ] && [ -x "$SAN" ]; then
  for tool in memcheck racecheck; do
    SPARSEMLA_GPU_TEST_SMALL=1 timeout 200 "$SAN" --tool $tool --error-exitcode 9 "$BIN/sparsemla_tests" \
      --gtest_filter="${SAN_FILTER:-CudaAttention*}" >"$OUT/$tool.log" 2>&1
    echo "compute-sanitizer $tool: exit $?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" "$OUT/$tool.log" | tail -4
  done
fi
if [ "${BENCH:-1}" = 1 ]; then
  timeout 200 "$BIN/sparsemla" bench attention ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
fi
# PROFILE="bench attention arguments": Nsight Compute on one launch of the attention kernel.
if [ -n "${PROFILE:-}" ]; then
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  timeout 200 "$NCU" --kernel-name regex:mla_mma --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
    "$BIN/sparsemla" bench attention $PROFILE >"$OUT/ncu.log" 2>&1
  grep -vE "^==PROF==|^ *$" "$OUT/ncu.log" | tail -70
fi
