#!/usr/bin/env bash
# On the GPU machine: GLM-5-width test models (real widths, Q4_K_M mix, zero matrices written as
# sparse holes, random norms and router) with 2 and 3 main layers (the first dense), benchmarked on
# the GPU; the difference between the two is one MoE layer's time. Binaries in $BIN.
set -uo pipefail
. "$(dirname "$0")/env.sh"
for L in 2 3; do
  /usr/bin/time -f "make-model $L layers: %e s" "$BIN/sparsemla" make-model --preset glm5-width --layers $L \
    --type q4_k_m --zeros -o /tmp/glm5w_$L.gguf
done
"$BIN/sparsemla" inspect /tmp/glm5w_3.gguf | grep -E "q4_K|q6_K|q8_0|f32 " | head
for kv in ${KV:-bf16 fp8}; do
  for L in 2 3; do
    echo "== $L layers, $kv cache"
    timeout 150 "$BIN/sparsemla" bench -m /tmp/glm5w_$L.gguf --device cuda --kv-cache $kv --prompt ${PROMPT:-1024} \
      --gen ${GEN:-32} ${VERBOSE:+--verbose} 2>&1 | tail -${TAILN:-4}
  done
done 2>&1 | tee "$OUT/glm5w.log"
