#!/usr/bin/env bash
# On the GPU machine: the same checks on several builds of the product kernels, side by side —
# for deciding whether an experiment branch's kernel may replace main's. Each of $BUILDS is a
# directory holding sparsemla, sparsemla_tests and bench_cuda_matmul (libraries in $LIBS).
#   BUILDS="/tmp/main /tmp/wip" bash scripts/device/compare_builds.sh
# (the first build must hold sparsemla: it writes the model; the others may leave it out to fit
# the 64 MiB a call carries, and then skip the model decode).
# Per build: the product tests against the CPU (CudaMatmul.MatchesCpu*, FILTER to change), the
# products' times at 9-64 tokens and the tensor-core kernel at decode sizes (pf:T), and GLM-5-width
# decode at batch 1/16/32 (3 layers, Q4_K_M mix, zero matrices).
set -uo pipefail
. "$(dirname "$0")/env.sh"
first=$(echo $BUILDS | awk '{print $1}')
[ -f /tmp/glm5w_3.gguf ] || "$first/sparsemla" make-model --preset glm5-width --layers 3 --type q4_k_m --zeros \
  -o /tmp/glm5w_3.gguf >/dev/null
for b in $BUILDS; do
  echo "=== $b"
  timeout ${TEST_TIMEOUT:-300} "$b/sparsemla_tests" --gtest_filter="${FILTER:-*CudaMatmul.MatchesCpu*}" 2>&1 |
    grep -E "^\[  (PASSED|FAILED) |Failure" | head -8
  timeout 300 "$b/bench_cuda_matmul" --quick 2>&1 | grep -vE "q8:|bf16" |
    awk '$3 ~ /^(16|32|64|pf:2|pf:8|pf:16)$/' | awk '{printf "%s %s %s %s %s | ", $1, $2, $3, $4, $6} NR % 4 == 0 {print ""}'
  echo
  [ -x "$b/sparsemla" ] && timeout 200 "$b/sparsemla" bench -m /tmp/glm5w_3.gguf --device cuda --gen 32 --prompt 1024 \
    --batch 1,16,32 2>&1 | grep -E "^ +[0-9]|error"
done
