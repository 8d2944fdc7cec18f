#!/usr/bin/env bash
# On the GPU machine: the same benchmarks under several environment settings side by side, to
# decide on a switch (SPARSEMLA_PDL, SPARSEMLA_GEMV_PREFETCH, ...). Binaries in $BIN ($LIBS).
#   VARIANTS   settings separated by spaces, each a comma-separated list of NAME=VALUE ("-" = none)
#   MATMUL=1   bench_cuda_matmul --quick --decode per variant (kernel times, back-to-back calls)
#   LAYERS     GLM-5-width models to decode (make-model --layers L), e.g. "2 4"
#   BATCHES    decode batches (default 1,8,32); INT8=1 also runs --int8-activations
set -uo pipefail
. "$(dirname "$0")/env.sh"
VARIANTS=${VARIANTS:-SPARSEMLA_PDL=0 SPARSEMLA_PDL=1}
with() {  # with "A=1,B=2" cmd...: runs cmd with those variables set
  local v=$1; shift
  if [ "$v" = "-" ]; then "$@"; else env ${v//,/ } "$@"; fi
}
if [ "${MATMUL:-0}" = 1 ]; then
  for v in $VARIANTS; do
    echo "== bench_cuda_matmul ($v)"
    with "$v" timeout ${MATMUL_TIMEOUT:-240} "$BIN/bench_cuda_matmul" --quick --decode 2>&1
  done | tee "$OUT/matmul_ab.log" | grep -E "==|copy|x2048 |x6144 |x16384 |8exp|q8:8e" | grep -vE " (pf:|)[248] " 
fi
for L in ${LAYERS:-}; do
  [ -f /tmp/glm5w_$L.gguf ] || /usr/bin/time -f "make-model $L layers: %e s" "$BIN/sparsemla" make-model \
    --preset glm5-width --layers $L --type q4_k_m --zeros -o /tmp/glm5w_$L.gguf >/dev/null
  for v in $VARIANTS; do
    for q in "" ${INT8:+--int8-activations}; do
      echo "== $L layers ($v) $q"
      with "$v" timeout ${BENCH_TIMEOUT:-300} "$BIN/sparsemla" bench -m /tmp/glm5w_$L.gguf --device cuda \
        --prompt ${PROMPT:-1024} --gen ${GEN:-32} --batch ${BATCHES:-1,8,32} $q 2>&1 | grep -E "decode|error|Error"
    done
  done
done 2>&1 | tee "$OUT/model_ab.log"
