#!/usr/bin/env bash
# On the GPU machine: the checks that sessions 30-31 (no device lent) left for the first session
# with one (run in session 32 but for the lowbit phase, which session 32 replaced by its own IQ
# model A/B: everything passed; docs/PERFORMANCE.md "Session 32"), in one run of
# ~12 minutes of device time. Binaries in $BIN (libraries in $LIBS: env.sh;
# pack sparsemla, sparsemla_tests and bench_cuda_matmul with scripts/device/pack.sh, two calls if
# the archive passes the carry limit); everything is logged under $OUT. PHASES picks phases
# (default all: "tests sanitizer kernels model lowbit").
#
#  tests      the GPU tests of what was written without a GPU: the quantized absorption kernel
#             (CudaAttention.QuantizedAbsorptionWeightsReadInPlace, GpuModel.QuantizedAbsorption...),
#             the int8 decode units of IQ3_XXS, IQ3_S, IQ2_XS, IQ2_S, IQ1_S, IQ1_M, Q4_0, IQ4_NL
#             (CudaMatmulQ8*), the model with them, and the kernels moved into headers for the host
#             emulation (gemv_q8_kernels.cuh, absorb_q8_kernel.cuh, sparse_mla_kernels.cuh: their
#             PTX was checked identical, this checks the launches);
#  sanitizer  compute-sanitizer memcheck (and racecheck on the absorption kernel), small shapes;
#  kernels    bench_cuda_matmul --absorb (bf16 copies against Q8_0 / Q4_K / Q6_K read in place) and
#             the one-token fp32 / int8 lines of the eight new types;
#  model      Q4_K_M GLM-5-width models of 2 and 3 layers, decode at batch 1 with the absorption
#             weights as bf16 copies (SPARSEMLA_ABSORB_QUANT=0) against read in place (=1), rounds
#             interleaved; Nsight Compute times of the absorption kernels in both;
#  lowbit     GLM-5-width models of IQ2_XXS / IQ1_S / IQ3_XXS / Q4_0 matrices (zeros: timing only),
#             decode at batch 1 with the fp32 products against --int8-activations.
# What to do with the figures: docs/PERFORMANCE.md "Session 30" and "Session 31" (flip
# absorb_quantized_in_place on if it is faster; add the faster IQ types to GpuModel::q8_levels).
set -uo pipefail
. "$(dirname "$0")/env.sh"
PHASES=${PHASES:-tests sanitizer kernels model lowbit}
has() { [[ " $PHASES " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
NEW_TYPES="iq3_xxs iq3_s iq2_xs iq2_s iq1_s iq1_m q4_0 iq4_nl"

if has tests; then
  F='*Absorption*:*GpuModel*:*CudaMatmul*:*CudaQ8*:CudaAttention.*'  # (typed suites: Types/..., Fixtures/...)
  timeout 300 "$BIN/sparsemla_tests" --gtest_filter="$F" >"$OUT/tests.log" 2>&1
  echo "tests: exit $?"
  grep -E "^\[  FAILED|PASSED|tests ran" "$OUT/tests.log" | tail -12
  grep -E "absorption .*max error|new type|max error" "$OUT/tests.log" | tail -20
fi

if has sanitizer && [ -x "$SAN" ]; then
  for spec in "memcheck:CudaAttention.QuantizedAbsorptionWeightsReadInPlace:CudaMatmulQ8*" \
              "racecheck:CudaAttention.QuantizedAbsorptionWeightsReadInPlace"; do
    tool=${spec%%:*}
    filter=${spec#*:}
    SPARSEMLA_GPU_TEST_SMALL=1 timeout 240 "$SAN" --tool "$tool" --report-api-errors no --error-exitcode 9 \
      "$BIN/sparsemla_tests" --gtest_filter="$filter" >"$OUT/$tool.log" 2>&1
    echo "compute-sanitizer $tool: exit $?"
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|FAILED" "$OUT/$tool.log" | tail -3
  done
fi

if has kernels; then
  timeout 120 "$BIN/bench_cuda_matmul" --absorb >"$OUT/absorb.log" 2>&1
  echo "bench --absorb: exit $?"
  cat "$OUT/absorb.log" | tail -40
  for t in $NEW_TYPES; do
    timeout 60 "$BIN/bench_cuda_matmul" --quick --decode --tokens 1 --type "$t" >"$OUT/decode_$t.log" 2>&1
    echo "== $t (exit $?)"
    grep -E " 1 | q8x2?:1 | q8x2?u:1 " "$OUT/decode_$t.log" | head -12
  done
fi

if has model; then
  for L in 2 3; do
    timeout 90 "$BIN/sparsemla" make-model --preset glm5-width --layers $L --type q4_k_m --zeros -o /tmp/g$L.gguf \
      >/dev/null 2>&1 || echo "make-model $L layers failed"
  done
  for round in 1 2 3; do
    for L in 2 3; do
      for m in 0 1; do
        line=$(SPARSEMLA_ABSORB_QUANT=$m timeout 90 "$BIN/sparsemla" bench -m /tmp/g$L.gguf --device cuda --prompt 1024 \
          --gen 64 --batch 1 2>&1 | grep '^decode')
        echo "round $round, $L layers, ABSORB_QUANT=$m: $line" | tee -a "$OUT/model.log"
      done
    done
  done
  if [ -x "$NCU" ]; then
    for m in 0 1; do
      SPARSEMLA_ABSORB_QUANT=$m SPARSEMLA_CUDA_GRAPHS=0 timeout 120 "$NCU" --clock-control none --cache-control none \
        --metrics gpu__time_duration.sum --csv "$BIN/sparsemla" bench -m /tmp/g3.gguf --device cuda --prompt 256 \
        --gen 3 >"$OUT/ncu_absorb_$m.csv" 2>/dev/null
      echo "== Nsight, ABSORB_QUANT=$m (exit $?): kernels of one decode step"
      python3 "$(dirname "$0")/ncu_step_summary.py" "$OUT/ncu_absorb_$m.csv" 2>&1 | head -30
    done
  fi
fi

if has lowbit; then
  for t in iq2_xxs iq1_s iq3_xxs q4_0; do
    timeout 90 "$BIN/sparsemla" make-model --preset glm5-width --layers 2 --type $t --zeros -o /tmp/lb_$t.gguf \
      >/dev/null 2>&1 || { echo "make-model $t failed"; continue; }
    for flag in "" "--int8-activations"; do
      line=$(timeout 90 "$BIN/sparsemla" bench -m /tmp/lb_$t.gguf --device cuda --prompt 1024 --gen 64 --batch 1 $flag \
        2>&1 | grep '^decode')
      echo "$t ${flag:-fp32 products}: $line" | tee -a "$OUT/lowbit.log"
    done
    rm -f /tmp/lb_$t.gguf
  done
fi
