#!/usr/bin/env bash
# On the GPU machine: the checks that sessions 32-33 left for the next session with a device (session
# 32's machine went away after its run 18; session 33 had none), in one run of ~10 minutes of device
# time. Binaries in $BIN (libraries in $LIBS: env.sh; pack sparsemla, sparsemla_tests and
# bench_cuda_matmul with scripts/device/pack.sh from a build configured with
# -DCMAKE_CUDA_ARCHITECTURES=90-real); everything is logged under $OUT. PHASES picks phases
# (default all: "tests sanitizer model ncu").
#
#  tests      the GPU model with session 32's automatic absorption path (the bf16 tensor-core kernel
#             at 2-8 tokens, cuBLAS from 9) and its Q4_0 test in its final form (dense layers), the
#             int8 decode kernels' shared block start (start_rows, block32_x: CudaMatmulQ8 typed
#             suites), the router tests on the shared case table (router_cases.h) and the attention
#             tests on the shared inputs (mla_test_inputs.h, CudaAttention.*);
#  sanitizer  compute-sanitizer memcheck on the int8 decode tests (small shapes);
#  model      GLM-5-width 2-layer IQ2_XS and IQ3_XXS models at batch 1 (session 32: IQ2_XS
#             0.680 / 0.708 ms per step at --prompt 512 --gen 48), and the batch-8 Q4_K_M step with
#             the absorption products' tensor-core kernel on and off (SPARSEMLA_ABSORB_TC=1 / 0,
#             rounds interleaved);
#  ncu        Nsight Compute on the one-token IQ1_S and IQ2_XXS output heads (154880 x 6144, 25-31% of
#             copy in session 32): whether the L1/shared data path (the grid gathers, each lane's 128
#             bytes of activations per unit, the staged weights) or instruction issue bounds them, the
#             question that decides the next step for the IQ types.
# What to do with the figures: docs/PERFORMANCE.md "Session 33".
set -uo pipefail
. "$(dirname "$0")/env.sh"
PHASES=${PHASES:-tests sanitizer model ncu}
has() { [[ " $PHASES " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)

if has tests; then
  F='*GpuModel*:CudaAttention.*:*CudaMatmulQ8*:CudaRouter.*:CudaSmallOps.*'  # (typed suites: Types/..., Fixtures/...)
  timeout 420 "$BIN/sparsemla_tests" --gtest_filter="$F" >"$OUT/tests.log" 2>&1
  echo "tests: exit $?"
  grep -E "^\[  FAILED|PASSED|tests ran" "$OUT/tests.log" | tail -12
fi

if has sanitizer && [ -x "$SAN" ]; then
  SPARSEMLA_GPU_TEST_SMALL=1 timeout 240 "$SAN" --tool memcheck --report-api-errors no --error-exitcode 9 \
    "$BIN/sparsemla_tests" --gtest_filter='*CudaMatmulQ8*' >"$OUT/memcheck.log" 2>&1
  echo "compute-sanitizer memcheck: exit $?"
  grep -E "ERROR SUMMARY|FAILED" "$OUT/memcheck.log" | tail -3
fi

if has model; then
  for t in iq2_xs iq3_xxs; do
    timeout 90 "$BIN/sparsemla" make-model --preset glm5-width --layers 2 --type $t --zeros -o /tmp/m_$t.gguf \
      >/dev/null 2>&1 || { echo "make-model $t failed"; continue; }
    for round in 1 2; do
      line=$(timeout 90 "$BIN/sparsemla" bench -m /tmp/m_$t.gguf --device cuda --prompt 512 --gen 48 --batch 1 \
        2>&1 | grep '^decode')
      echo "$t round $round: $line" | tee -a "$OUT/model.log"
    done
    rm -f /tmp/m_$t.gguf
  done
  timeout 90 "$BIN/sparsemla" make-model --preset glm5-width --layers 2 --type q4_k_m --zeros -o /tmp/g2.gguf \
    >/dev/null 2>&1 || echo "make-model q4_k_m failed"
  for round in 1 2 3; do
    for tc in 1 0; do
      line=$(SPARSEMLA_ABSORB_TC=$tc timeout 120 "$BIN/sparsemla" bench -m /tmp/g2.gguf --device cuda --prompt 256 \
        --gen 24 --batch 8 2>&1 | grep '^decode')
      echo "batch 8 round $round, ABSORB_TC=$tc: $line" | tee -a "$OUT/model.log"
    done
  done
fi

if has ncu; then
  CASES="iq1_s:154880x6144:1 iq2_xxs:154880x6144:1" KERNELS="gemv_q8_staged" STALLN=12 \
    bash "$(dirname "$0")/ncu_gemv.sh" 2>&1 | tee "$OUT/ncu.log"
fi
