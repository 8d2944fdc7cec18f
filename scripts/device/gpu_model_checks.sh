#!/usr/bin/env bash
# On the GPU machine: the GPU model's tests (single GPU, tensor parallel over host-staged
# collectives, and over NCCL where there are 2+ GPUs), compute-sanitizer on the graph / sampling /
# sharding tests, then decode benchmarks with CUDA graphs on and off (the bundled model and
# GLM-5-width models). Binaries in $BIN (libraries in $LIBS); logs to $OUT.
set -uo pipefail
. "$(dirname "$0")/env.sh"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
# FILTER: gtest filters separated by spaces, each run in its own process with its own timeout, so
# that one that hangs (NCCL waits without a deadline) does not keep the others from running. The
# leading * also takes the fixture suites (Fixtures/GpuModelFixture.*, Fixtures/GpuTensorParallel...),
# which "GpuModel*" does not match; set -f keeps the shell from globbing the filters.
set -f
for f in ${FILTER-*GpuModel*:*GpuTensorParallel*}; do
  echo "== tests: $f"
  timeout ${TEST_TIMEOUT:-300} "$BIN/sparsemla_tests" --gtest_filter="$f" >>"$OUT/tests.log" 2>&1
  echo "exit $? ($f)" | tee -a "$OUT/tests.log"
done
[ -f "$OUT/tests.log" ] && grep -vE '^\[ +(RUN|OK) ' "$OUT/tests.log" | grep -E "FAILED|Failure|exit [^0]|PASSED|SKIPPED \]" | tail -${TAILN:-40}
SAN=/usr/local/cuda/bin/compute-sanitizer
if [ -n "${SAN_FILTER:-}" ] && [ -x "$SAN" ]; then
  for tool in ${SAN_TOOLS:-memcheck}; do
    timeout ${SAN_TIMEOUT:-200} "$SAN" --tool $tool --report-api-errors no --error-exitcode 9 "$BIN/sparsemla_tests" \
      --gtest_filter="$SAN_FILTER" >"$OUT/$tool.log" 2>&1
    echo "compute-sanitizer $tool: exit $?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" "$OUT/$tool.log" | tail -4
  done
fi
# BENCH=1: decode with CUDA graphs on and off (bundled model; GLM-5-width models of 2 and 3 layers at
# batch 1/8/32); BENCH_CTX=1: GLM-5 width (2 layers) at 4K, 32K and 128K contexts, sparse and dense;
# TP=N: the GLM-5-width models split over N GPUs (NCCL) at batch 1/8/32, with the all-reduce time.
mk() { [ -f /tmp/glm5w_$1.gguf ] || "$BIN/sparsemla" make-model --preset glm5-width --layers $1 --type q4_k_m --zeros \
  -o /tmp/glm5w_$1.gguf >/dev/null; }
b() { echo "== $*"; timeout ${BENCH_TIMEOUT:-200} "$BIN/sparsemla" bench "$@" 2>&1 | grep -E "prefill|decode|all-reduce|error"; }
if [ "${BENCH:-1}" = 1 ]; then
  {
    for graphs in 1 0; do
      echo "(CUDA graphs $graphs)"; SPARSEMLA_CUDA_GRAPHS=$graphs b -m models/tiny-glm5-q8_0.gguf --device cuda --prompt 512 --gen 256
    done
    for L in 2 3; do
      mk $L
      for batch in 1 8 32; do
        for graphs in 1 0; do
          echo "(CUDA graphs $graphs)"; SPARSEMLA_CUDA_GRAPHS=$graphs b -m /tmp/glm5w_$L.gguf --device cuda --prompt ${PROMPT:-1024} --gen ${GEN:-32} --batch $batch
          [ $batch -gt 8 ] && break  # beyond the sync-free MoE size there is no graph
        done
      done
    done
  } 2>&1 | tee "$OUT/bench.log"
fi
if [ "${BENCH_CTX:-0}" = 1 ]; then
  mk 2
  for att in sparse dense; do
    for ctx in 4096 32768 131072; do
      BENCH_TIMEOUT=400 b -m /tmp/glm5w_2.gguf --device cuda --prompt $ctx --gen 16 --attention $att
    done
  done 2>&1 | tee "$OUT/bench_ctx.log"
fi
if [ -n "${TP:-}" ]; then
  for L in 2 3; do
    mk $L
    for batch in 1 8 32; do
      b -m /tmp/glm5w_$L.gguf --device cuda --tensor-parallel $TP --prompt ${PROMPT:-1024} --gen ${GEN:-32} --batch $batch
    done
  done 2>&1 | tee "$OUT/bench_tp.log"
fi
