#!/usr/bin/env bash
# On the GPU machine: the checks that session 34 left for the next session with a device (its H100's
# device time ended before them), in one run of ~8 minutes of device time. Binaries in $BIN
# (libraries in $LIBS: env.sh; pack sparsemla, sparsemla_tests and bench_cuda_matmul with
# scripts/device/pack.sh from a build configured with -DCMAKE_CUDA_ARCHITECTURES=90-real); everything
# is logged under $OUT. PHASES picks phases (default all: "tests sanitizer attention model ncu").
#
#  tests      the sparse MLA kernel's tile copy at advancing addresses (copy_row_pieces, f083015) and
#             the IQ grid tables in shared memory (976345d) inside the whole GPU model (GpuModel*, the
#             fixtures) and the attention and int8 product suites;
#  sanitizer  memcheck on the sparse MLA and staged-product tests (small shapes), racecheck on the
#             sparse MLA test;
#  attention  batch 1 and 8 attention at 1K / 4K / 128K (session 34's table, "after" column: the copy
#             loop's effect, on the same kind of device);
#  model      GLM-5-width 2-layer IQ2_XS, IQ3_XXS and IQ1_S steps at batch 1 with the grid tables in
#             shared memory and without (SPARSEMLA_Q8_SMEM_GRID=1 / 0, rounds interleaved), and the
#             Q4_K_M 2- and 3-layer steps;
#  ncu        Nsight Compute's instruction mix of the batch-1 attention kernel at 1K (what is left
#             after the copy loop).
# What to do with the figures: docs/PERFORMANCE.md "Session 34".
set -uo pipefail
. "$(dirname "$0")/env.sh"
PHASES=${PHASES:-tests sanitizer attention model ncu}
has() { [[ " $PHASES " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)

if has tests; then
  F='*GpuModel*:CudaAttention.*:*CudaMatmulQ8*'  # (typed suites: Types/..., Fixtures/...)
  timeout 420 "$BIN/sparsemla_tests" --gtest_filter="$F" >"$OUT/tests.log" 2>&1
  echo "tests: exit $?"
  grep -E "^\[  FAILED|PASSED|tests ran" "$OUT/tests.log" | tail -12
fi

if has sanitizer && [ -x "$SAN" ]; then
  SPARSEMLA_GPU_TEST_SMALL=1 timeout 150 "$SAN" --tool memcheck --report-api-errors no --error-exitcode 9 \
    "$BIN/sparsemla_tests" --gtest_filter='CudaAttention.SparseMla*:CudaAttention.Front*:*CudaMatmulQ8.StagedLoads*' \
    >"$OUT/memcheck.log" 2>&1
  echo "compute-sanitizer memcheck: exit $?"
  SPARSEMLA_GPU_TEST_SMALL=1 timeout 200 "$SAN" --tool racecheck --error-exitcode 9 \
    "$BIN/sparsemla_tests" --gtest_filter='CudaAttention.SparseMlaMatchesTheCpuReference' >"$OUT/racecheck.log" 2>&1
  echo "compute-sanitizer racecheck: exit $?"
  grep -hE "ERROR SUMMARY|RACECHECK SUMMARY|FAILED" "$OUT/memcheck.log" "$OUT/racecheck.log" | tail -4
fi

if has attention; then
  timeout 90 "$BIN/sparsemla" bench attention --shapes glm5 dsv32 --kv bf16 fp8 --batch 1 8 --context 1024 4096 131072 \
    --kernel mma >"$OUT/attention.log" 2>&1
  grep -E "^(glm5|dsv32) " "$OUT/attention.log" | awk -F'|' '{print $1 "|" $5 "|" $6}'
fi

if has model; then
  for t in iq2_xs iq3_xxs iq1_s; do
    timeout 90 "$BIN/sparsemla" make-model --preset glm5-width --layers 2 --type $t --zeros -o /tmp/m_$t.gguf \
      >/dev/null 2>&1 || { echo "make-model $t failed"; continue; }
    for round in 1 2; do
      for g in 1 0; do
        line=$(SPARSEMLA_Q8_SMEM_GRID=$g timeout 90 "$BIN/sparsemla" bench -m /tmp/m_$t.gguf --device cuda --prompt 512 \
          --gen 48 --batch 1 2>&1 | grep '^decode' | grep -o '[0-9.]* ms per step')
        echo "$t round $round, SMEM_GRID=$g: $line" | tee -a "$OUT/model.log"
      done
    done
    rm -f /tmp/m_$t.gguf
  done
  for n in 2 3; do
    timeout 90 "$BIN/sparsemla" make-model --preset glm5-width --layers $n --type q4_k_m --zeros -o /tmp/g$n.gguf \
      >/dev/null 2>&1 || echo "make-model q4_k_m failed"
    for round in 1 2; do
      line=$(timeout 90 "$BIN/sparsemla" bench -m /tmp/g$n.gguf --device cuda --prompt 1024 --gen 64 --batch 1 2>&1 \
        | grep '^decode' | grep -o '[0-9.]* ms per step')
      echo "q4_k_m $n layers round $round: $line" | tee -a "$OUT/model.log"
    done
  done
fi

if has ncu; then
  KERNEL=mla_mma_kernel SKIP=3 bash "$(dirname "$0")/ncu_sass.sh" "$BIN/sparsemla" bench attention --shapes glm5 \
    --kv bf16 --batch 1 --context 1024 2>&1 | head -30 | tee "$OUT/ncu.log"
fi
