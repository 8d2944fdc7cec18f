#!/usr/bin/env bash
# On the GPU machine: the GPU model's tests (single GPU, tensor parallel over host-staged
# collectives, and over NCCL where there are 2+ GPUs), compute-sanitizer on the graph / sampling /
# sharding tests, then decode benchmarks with CUDA graphs on and off (the bundled model and
# GLM-5-width models). Binaries in $BIN (libraries in $LIBS); logs to $OUT.
set -uo pipefail
BIN=${BIN:-.devbin/attn}
export LD_LIBRARY_PATH=${LIBS:-$PWD/.devbin/lib}:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
OUT=${OUT:-/tmp/out}
if ! ls /usr/local/cuda/lib64/libnccl.so.2 >/dev/null 2>&1; then
  nccl=$(find /usr /opt -name libnccl.so.2 2>/dev/null | head -1)
  [ -n "$nccl" ] && export LD_LIBRARY_PATH=$(dirname "$nccl"):$LD_LIBRARY_PATH
fi
export SPARSEMLA_FIXTURES_DIR=${SPARSEMLA_FIXTURES_DIR:-$PWD/tests/fixtures}
export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
if [ -n "${FILTER:-GpuModel*:GpuTensorParallel*}" ]; then
  timeout ${TEST_TIMEOUT:-300} "$BIN/sparsemla_tests" --gtest_filter="${FILTER:-GpuModel*:GpuTensorParallel*}" 2>&1 \
    | tee "$OUT/tests.log" | grep -vE '^\[ +(RUN|OK) ' | tail -${TAILN:-70}
fi
SAN=/usr/local/cuda/bin/compute-sanitizer
if [ -n "${SAN_FILTER:-}" ] && [ -x "$SAN" ]; then
  for tool in ${SAN_TOOLS:-memcheck}; do
    timeout ${SAN_TIMEOUT:-200} "$SAN" --tool $tool --report-api-errors no --error-exitcode 9 "$BIN/sparsemla_tests" \
      --gtest_filter="$SAN_FILTER" >"$OUT/$tool.log" 2>&1
    echo "compute-sanitizer $tool: exit $?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" "$OUT/$tool.log" | tail -4
  done
fi
if [ "${BENCH:-1}" = 1 ]; then
  {
    for graphs in 1 0; do
      echo "== bundled model, CUDA graphs $graphs"
      SPARSEMLA_CUDA_GRAPHS=$graphs timeout 120 "$BIN/sparsemla" bench -m models/tiny-glm5-q8_0.gguf --device cuda \
        --prompt 512 --gen 256 2>&1 | grep -E "prefill|decode"
    done
    for L in 2 3; do
      "$BIN/sparsemla" make-model --preset glm5-width --layers $L --type q4_k_m --zeros -o /tmp/glm5w_$L.gguf >/dev/null
      for graphs in 1 0; do
        echo "== GLM-5 width, $L layers, bf16 cache, CUDA graphs $graphs"
        SPARSEMLA_CUDA_GRAPHS=$graphs timeout 150 "$BIN/sparsemla" bench -m /tmp/glm5w_$L.gguf --device cuda \
          --prompt ${PROMPT:-1024} --gen ${GEN:-64} 2>&1 | grep -E "prefill|decode"
      done
    done
  } 2>&1 | tee "$OUT/bench.log"
fi
