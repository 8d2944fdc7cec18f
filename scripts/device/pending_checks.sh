#!/usr/bin/env bash
# On the GPU machine: re-checks of sessions 34-38's and 44's GPU code, in one run of ~18 minutes of
# device time. Every phase has run but s54 and s53 (owed: sessions 54's and 53's changes, the device lent to neither; s52 in run 110 of session 53, H100; s51 and s50's memcheck in run 103 of session
# 52; s50's tests, racecheck and bounds in run 99 of session 51; s49 in run 95 of session 50): session 48 f16 and small8 on an H100 on d9c6745 (run 82), session 37 all but prefill and ncu on an H200 on 186f2c6, session
# 38 the prefill phase on an H100, session 45 the wgmma phase on an H100 on 118c578, session 46 the fp8
# phase on an H100 on aa478b5 (PERFORMANCE.md, "Session 37", "Session 38", "Session 45", "Session 46":
# all passed, the figures recorded; session 46 also ran session 45's quarters phase, not kept:
# patches/mla_quarters.patch). `PHASES=wgmma` alone: ~4 minutes. Binaries in $BIN (libraries in $LIBS: env.sh; pack sparsemla, sparsemla_tests
# and bench_cuda_matmul with scripts/device/pack.sh from a build configured with
# -DCMAKE_CUDA_ARCHITECTURES=90-real); everything is logged under $OUT. PHASES picks phases
# (default all: "f16 small8 fp8 wgmma prefill attention tests sanitizer model ncu profile"); ROUNDS the attention phase's
# rounds (2).
#
#  prefill    the cuBLAS prefill (prefill_blas.cu; on by default since session 38,
#             SPARSEMLA_PREFILL_BLAS=0 turns it off): its tests (the cuBLAS product and the bf16 rows
#             against the CPU for every type, the fp32 router product, column slices, a long fixture
#             prompt through the whole model), memcheck on them, `bench_cuda_matmul --prefill` (the
#             tile kernel "pf:T" against "blas:T" at 64-4096 tokens, "dq" the bf16 rows alone), the
#             GLM-5-width 3-layer prefill at 4K and 32K with it on and off, a 32K prompt in forwards
#             of 512-16384 tokens (session 39's sweep, H100 only so far) with session 40's expert
#             tiles on and off (and decode batches of 128 / 256, which take the same path), session
#             41's indexer tokens kernel against qfrag at 32K and 128K prompts (bf16 and fp8 caches)
#             and alone (`bench attention --prefill 4096`, run in session 42), session 42's
#             per-token rows of front selections on and off (SPARSEMLA_MLA_SELECTED_FRONT) at
#             2K-16K prompts with their GPU tests, and the kernel time of
#             one 4096-token chunk under Nsight Compute with the split norms at their default limit
#             (128 rows) and at 64 rows (SPARSEMLA_SPLIT_NORM_MAX_ROWS). blas_min_tokens
#             (quant_matmul.cu) holds the crossovers the "pf" / "blas" lines give.
#
#  attention  the sparse MLA kernel's tile pairs (session 35: two sets of warps per head group taking
#             alternate tiles) on and off (SPARSEMLA_MLA_TILE_PAIRS=1 / 0, two rounds interleaved)
#             at batch 1 and 2, 1K / 4K / 128K, bf16 and fp8 rows; the "on" column also gives session
#             34's tile copy at advancing addresses (copy_row_pieces) against its "after" column on
#             the same kind of device;
#  tests      the tile pairs' test first, then the attention, whole-GPU-model (GpuModel*, the
#             fixtures: the IQ grid tables in shared memory, session 34) and int8 product suites;
#  sanitizer  memcheck on the sparse MLA and staged-product tests (small shapes), racecheck on the
#             tile pairs' test (their hand-over through shared memory) and the sparse MLA test;
#  model      GLM-5-width 2-layer IQ2_XS and IQ1_S steps at batch 1 with the grid tables in shared
#             memory and without (SPARSEMLA_Q8_SMEM_GRID=1 / 0), and the Q4_K_M 2-layer step at 1K
#             with tile pairs on and off (rounds interleaved);
#  ncu        Nsight Compute's instruction mix of the batch-1 attention kernel at 1K (with tile pairs);
#  profile    why SPARSEMLA_STEP_PROFILE's "attention: W_UV, output projection" reads ~0.9 ms per step
#             more than its kernels (session 36): the 3-layer Q4_K_M step profile with the hold that
#             covers the host's enqueue at 20 ms (the default) and at 200 ms; if the section shrinks
#             with the longer hold, the host fell behind the device there (a host-side cost in that
#             part of the enqueue), else the device runs something there.
#  wgmma      session 44's Hopper kernel (bf16 rows in whole lines, swizzled tiles, unpaired): its
#             final binary's tests (run 70 ran the same paths from the commit before the template
#             reorganization), memcheck and racecheck; the attention table on this device for both
#             caches with the lines on and off (SPARSEMLA_WGMMA_LINES); the small-batch crossover
#             against the mma kernel (SPARSEMLA_WGMMA_MIN_BATCH=1 against the default 8, bf16, batches
#             1-8: where the Hopper kernel now wins, lower the bound in plan_mma); prefill at 4K / 16K
#             with the lines on and off; and the same as a prefill's attention (`bench attention
#             --one-sequence`): the old tiles (unpaired; the old default, bf16 pairs through registers,
#             is only in a70283c's build or the patch wgmma_gather_forms.patch) and unpaired lines.
#             (Session 45 also ran bf16 pairs in lines here; not kept: wgmma_bf16_pairs.patch.)
#  small8     (session 46; run 82 in session 48, H100: the bound became kWgmmaFp8MinRows = 256
#             token-head rows, the peer arrival was kept) fp8 rows at small batches: its tests, then
#             attention at batch 1, 2, 4, 8 (4K, 128K, GLM-5 and DeepSeek-V3.2, fp8) with
#             `--kernel mma` against the Hopper kernel (SPARSEMLA_WGMMA_FP8_MIN_ROWS=1), two rounds;
#             and the 3-layer GLM-5-width step at batch 1 with an fp8 cache, the bound at 256 and 1.
#             With $BIN/sparsemla_peer and $BIN/sparsemla_tests_peer (a build with a patch under test
#             for the pairs; run 82 timed the peer arrival without MEMBAR.ALL.GPU) also the Hopper tests
#             and racecheck on the pairs with it, and an A/B of DeepSeek-V3.2 fp8 at batch 32 / 128
#             against $BIN/sparsemla.
#  s54        (session 54; owed, never ran: no device was lent after its code was written) four
#             changes on the batch-1 decode path: (1) the indexer's q_b product on the side stream
#             right after q_a's norm (GpuModelOptions::index_qb_side, SPARSEMLA_INDEX_QB_SIDE; opt-in),
#             so that the indexer's queries, scores and top-k (the longer path past top_k positions)
#             start before q_b's product ends; (2) the query's rope done by W_UK's launch at one token
#             (rope_in_wuk, SPARSEMLA_ROPE_IN_WUK; opt-in; its kernel is host-emulated in CI); (2b) the
#             indexer's queries rotated and scaled by the qfrag scores kernel itself, one launch
#             fewer on the indexer's path (index_queries_in_scores, SPARSEMLA_INDEX_QUERIES_IN_SCORES;
#             opt-in; host-emulated in CI); (3) the
#             top-k block kernel's scores loaded before the row's length (on; host-emulated in CI),
#             and SPARSEMLA_TOPK_BLOCK_PER=8 letting the automatic choice take the block path for
#             rows of up to 8K scores (the model's 8K context bucket: 4097-8192 positions). Their GPU
#             tests (the side-stream bit-for-bit test with the q_b split on and off, the rope's ops
#             and model tests, the top-k tests) and the fixtures' model tests with both switches on,
#             memcheck on the new kernels' tests, and the top-k block path at 4 / 8 per thread in
#             `bench attention` (contexts 3000-8000): ~4 minutes. Phase s54model (~6 minutes, a call
#             of its own): the GLM-5-width step at batch 1 (prompts 1K, 4K, 32K; 2 and 3 layers;
#             each switch off against all on, and all off; two rounds) and the SPARSEMLA_ABSORB_QUANT
#             A/B (owed since session 52). Decide from the figures: turn
#             index_qb_side / rope_in_wuk / index_queries_in_scores on by default (gpu_model.h), and the block path's bound
#             (takes_block, topk.cu) to 8 per thread where it wins.
#  s53        (session 53; owed, never ran: 17e5af0 and fbeed38 were written after the device time ran out) unpaired
#             splits planned 9-16 ways merged as 8 (or fewer that fit) in clusters, GLM-5 at batch 8-15
#             (wgmma_cluster_splits; run 113 timed the same path by `--splits 8`): the merge test (its
#             launch-chosen 12 tokens: 8 splits merged expected, printed) and the other Hopper tests
#             (the pairs' clusters, run 112-113: passed), the attention table at batch 5-16 with split
#             clusters on and off (two rounds; DeepSeek-V3.2 bf16 at 5-7 tokens is new ground: its plan of
#             9-13 splits becomes the most of 8 or fewer that fit), and the s52 table on an H200 (every
#             split-cluster figure so far is from an H100).
#  s52        (session 52; runs 106-108 on an H100 ran it, kept on by default; run 110 in session 53,
#             H100: the pairs test's updated assertion passed) the Hopper kernel's splits
#             merged in their thread-block cluster (merge_splits, sparse_mla_sm90.cu; on by default,
#             AttentionWorkspace::split_clusters / SPARSEMLA_WGMMA_SPLIT_CLUSTERS=0 / 1): its test (against the
#             CPU and, to the bit, the merge kernel; 2-8 splits, 32 / 64 / 128 heads, both row types) and
#             the other Hopper tests, racecheck and memcheck on it (small shapes), the attention table at
#             batch 8-128 (4K) with it on and off (two rounds interleaved: GLM-5 at batch 64 took as long
#             as at 128 in run 103, its two splits merged by the kernel), the merge kernel's cost at batch
#             64 (`--splits 1` and `2`), the fixtures' model tests, and the GLM-5-width step at batch 32
#             and 64 with it on and off. On an H200: the table there (runs 106-108 were on an H100).
#  s51        (session 51; run 103 in session 52, H200: passed) the attention's FMA kernel with its inner loop unrolled by 4
#             (it spilled 5.6-12 KB a thread on sm_80-89 fully unrolled; on sm_90 12-20 bytes): its GPU
#             test (SparseMlaMatchesTheCpuReference runs it on bf16, fp8 and f32 rows) and the fixtures'
#             f32-cache model tests, which take it, then memcheck on the attention test (small shapes).
#  s50        (session 50; run 99 in session 51 ran its tests, racecheck and bounds on the final code (run 103
#             in session 52 its memcheck: 0 errors),
#             H100: passed, the bound confirmed; run 96 ran it on the three-form build of eae8482, H100: kept the bulk
#             copies from 64 heads) the Hopper kernel's output stored by bulk copies: on the final
#             code, the attention tests (all of CudaAttention), the Hopper ones with the bulk copies
#             at every head count and with none (SPARSEMLA_WGMMA_BULK_OUT=1 / 0), memcheck and
#             racecheck on the Hopper tests with the bulk copies (small shapes), and the small-batch
#             bounds on one device: `--kernel mma` against the Hopper kernel forced
#             (SPARSEMLA_WGMMA_BULK_MIN_ROWS=1 ...) at batch 1, 2, 4 for GLM-5 and DeepSeek-V3.2,
#             both caches (the new bound, kWgmmaBulkMinRows = 128 rows, was set from the mma kernel's
#             figures of earlier runs: sparse_mla.cu, plan_mma). (s49, run 95 in session 50, H100: the
#             staged thread copy; patches/wgmma_staged_output.patch.)
#  s48        (session 48; run 89 in session 49, H100: tests passed, the shares timed) the indexer's scaled fp16 queries on the final code
#             (index_queries' kernel moved into indexer_kernels.cuh after run 88) and `bench attention`'s
#             tensor-parallel shares (glm5-tp2 / -tp8, dsv32-tp2; bf16 and fp8; batch 1-128; the
#             kernel the model takes, mma and wgmma): where the Hopper kernel (64 heads per block, 8 or
#             32 of them real) and the mma kernel cross at these head counts; the selector gives them mma.
#  f16        (session 47; run 82 in session 48, H100: fp16 tiles 5-8% slower, not kept:
#             patches/wgmma_fp16_tiles.patch) the attention and indexer tests on q of any range
#             (SparseMlaWgmmaTakesQOfAnyRange, SparseMlaFp8RowsTakeQOfAnyRange, IndexQueries*,
#             IndexerTakes*), racecheck and memcheck on the Hopper tests; with $BIN/sparsemla_old (an
#             older build), the mma kernel's fp8 rows at batch 1 / 2 / 8 against it. (Run 82 also timed
#             SPARSEMLA_WGMMA_F16=1 against 0, which needs the patch applied.)
#  fp8        (session 45; run 77 in session 46, H100) why the Hopper kernel's fp8 rows are slower than bf16 rows at
#             batch 128 (GLM-5 135 against 126 us on an H100, half the bytes) though neither their
#             loads' latency (rows a tile ahead) nor their rope loads (by cp.async) were the bound
#             (run 74, wgmma_fp8_forms.patch): Nsight's instruction mix and stall samples of the
#             kernel (scripts/device/ncu_sass.sh) for DeepSeek-V3.2 fp8 (pairs), GLM-5 fp8 and GLM-5
#             bf16, batch 128, 4K; the decode table at batch 1 and 128 (4K, 128K) on this device
#             (on an H200: the figures issue 6 asks for).
# What to do with the figures: docs/PERFORMANCE.md "Session 35" and "Session 36" (the H100 tables to
# compare with; "Session 44" for the wgmma phase).
set -uo pipefail
. "$(dirname "$0")/env.sh"
PHASES=${PHASES:-s54 s54model s53 s52 s51 s50 s48 f16 small8 fp8 wgmma prefill attention tests sanitizer model ncu profile}
has() { [[ " $PHASES " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
step() { awk -F'|' '{print $1 "|" $4 "|" $5 "|" $6 "|" $7}'; }
# gtests NAME SECONDS BINARY FILTER: a test binary's run under a filter, logged to $OUT/NAME_tests.log,
# its exit status and summary lines printed.
gtests() {
  timeout "$2" "$BIN/$3" --gtest_filter="$4" >"$OUT/$1_tests.log" 2>&1
  echo "$1 tests: exit $?"; grep -E "^\[  FAILED|PASSED|tests ran" "$OUT/$1_tests.log" | tail -8
}

if has s54; then
  gtests s54 300 sparsemla_tests 'GpuModel.SideStream*:GpuModel.DecodeFolds*:CudaAttention.AbsorptionProduct*:CudaAttention.*TopK*:CudaAttention.Index*'
  SPARSEMLA_INDEX_QB_SIDE=1 SPARSEMLA_ROPE_IN_WUK=1 SPARSEMLA_INDEX_QUERIES_IN_SCORES=1 gtests s54_fixtures 300 sparsemla_tests \
    '*GpuModelFixture.LogitsMatch*:*GpuModelFixture.Greedy*:GpuModel.DecodeGraphs*'
  SPARSEMLA_GPU_TEST_SMALL=1 timeout 120 "$SAN" --tool memcheck "$BIN/sparsemla_tests" \
    --gtest_filter='CudaAttention.TopKBlock*:CudaAttention.AbsorptionProductDoes*:GpuModel.DecodeFolds*' >"$OUT/s54_memcheck.log" 2>&1
  echo "s54 memcheck: exit $?"; grep -hE "ERROR SUMMARY" "$OUT/s54_memcheck.log"
  for per in 4 8; do
    echo "== top-k block per $per (shape | top-k tied | idx+top-k | kernels)"
    SPARSEMLA_TOPK_BLOCK_PER=$per timeout 100 "$BIN/sparsemla" bench attention --shapes glm5 dsv32 --kv bf16 fp8 \
      --batch 1 4 --context 3000 4096 6000 8000 --reps 3 2>&1 | grep -E "^(glm5|dsv32)|rror" |
      awk -F'|' '{print $1 "|" $3 "|" $4 "|" $7}'
  done | tee "$OUT/s54_topk.log"
fi

if has s54model; then
  for L in 2 3; do
    [ -f /tmp/s54_$L.gguf ] || timeout 60 "$BIN/sparsemla" make-model --preset glm5-width --layers $L --type q4_k_m \
      --zeros -o /tmp/s54_$L.gguf >/dev/null 2>&1 || echo "make-model $L layers failed"
  done
  s54_step() {  # s54_step QB,PER,RW,IQ LAYERS PROMPT
    local qb per rw iq; IFS=, read -r qb per rw iq <<<"$1"
    echo "qb_side $qb, top-k block per $per, rope_in_wuk $rw, queries in scores $iq, prompt $3, $2 layers: $(\
      SPARSEMLA_INDEX_QB_SIDE=$qb SPARSEMLA_TOPK_BLOCK_PER=$per SPARSEMLA_ROPE_IN_WUK=$rw \
      SPARSEMLA_INDEX_QUERIES_IN_SCORES=$iq timeout 60 "$BIN/sparsemla" bench -m /tmp/s54_$2.gguf \
      --device cuda --prompt $3 --gen 64 --batch 1 2>&1 | grep -E '^decode|rror' | grep -oE '[0-9.]+ ms per step|rror.*')"
  }
  for round in 1 2; do
    for P in 4096 32768; do
      for v in 1,8,1,1 0,8,1,1 1,4,1,1 1,8,0,1 1,8,1,0 0,4,0,0; do
        [ $P = 32768 ] && [ $v = 1,4,1,1 ] && continue  # (past 16K the block path never applies)
        s54_step $v 3 $P
      done
      s54_step 1,8,1,1 2 $P; s54_step 0,4,0,0 2 $P
    done
    s54_step 1,8,1,1 2 1024; s54_step 1,8,1,1 3 1024; s54_step 0,4,0,0 2 1024; s54_step 0,4,0,0 3 1024
  done 2>&1 | tee "$OUT/s54_model.log"
  for round in 1 2; do for v in 0 1; do
    echo "absorb_quant $v, prompt 4096, 3 layers, round $round: $(SPARSEMLA_ABSORB_QUANT=$v timeout 60 "$BIN/sparsemla" \
      bench -m /tmp/s54_3.gguf --device cuda --prompt 4096 --gen 64 --batch 1 2>&1 | grep -E '^decode|rror' |
      grep -oE '[0-9.]+ ms per step|rror.*')"
  done; done | tee "$OUT/s54_absorb_quant.log"
  rm -f /tmp/s54_2.gguf /tmp/s54_3.gguf
fi

if has s53; then
  gtests s53 240 sparsemla_tests 'CudaAttention.SparseMlaWgmma*:SparseMlaPlan.*'
  grep -E "tokens" "$OUT/s53_tests.log"
  for round in 1 2; do
    for c in 1 0; do
      echo "== split clusters $c, round $round (attention us | kernel)" | tee -a "$OUT/s53_attention.log"
      SPARSEMLA_WGMMA_SPLIT_CLUSTERS=$c timeout 100 "$BIN/sparsemla" bench attention --shapes glm5 dsv32 --kv bf16 fp8 \
        --batch 5 6 7 8 10 12 14 16 --context 4096 --reps 3 2>&1 | grep -E "^(glm5|dsv32)|rror" |
        awk -F'|' '{print $1 "|" $5 "|" $7}' | tee -a "$OUT/s53_attention.log"
    done
  done
fi

if has s52; then
  gtests s52_merge 150 sparsemla_tests 'CudaAttention.SparseMlaWgmmaMerges*'
  grep -E "64 tokens" "$OUT/s52_merge_tests.log"
  gtests s52 240 sparsemla_tests 'CudaAttention.SparseMlaWgmma*:SparseMlaPlan.*:CudaAttention.SparseMlaMatches*:*GpuModelFixture.LogitsMatch*'  # (with the pairs test)
  for tool in racecheck memcheck; do
    SPARSEMLA_GPU_TEST_SMALL=1 timeout 120 "$SAN" --tool $tool "$BIN/sparsemla_tests" \
      --gtest_filter='CudaAttention.SparseMlaWgmmaMerges*' >"$OUT/s52_$tool.log" 2>&1
    echo "s52 $tool: exit $?"; grep -hE "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/s52_$tool.log"
  done
  for round in 1 2; do
    for c in 1 0; do
      echo "== split clusters $c, round $round (attention us | kernel)" | tee -a "$OUT/s52_attention.log"
      SPARSEMLA_WGMMA_SPLIT_CLUSTERS=$c timeout 100 "$BIN/sparsemla" bench attention --shapes glm5 dsv32 --kv bf16 fp8 \
        --batch 8 16 32 48 64 96 128 --context 4096 --reps 3 2>&1 | grep -E "^(glm5|dsv32)|rror" |
        awk -F'|' '{print $1 "|" $5 "|" $7}' | tee -a "$OUT/s52_attention.log"
    done
  done
  for sp in 1 2; do
    echo "== merge kernel, --splits $sp" | tee -a "$OUT/s52_attention.log"
    SPARSEMLA_WGMMA_SPLIT_CLUSTERS=0 timeout 100 "$BIN/sparsemla" bench attention --kernel wgmma --shapes glm5 --kv bf16 \
      --batch 64 128 --context 4096 --splits $sp --reps 3 2>&1 | grep -E "^glm5|rror" |
      awk -F'|' '{print $1 "|" $5 "|" $7}' | tee -a "$OUT/s52_attention.log"
  done
  for L in 2 3; do
    timeout 60 "$BIN/sparsemla" make-model --preset glm5-width --layers $L --type q4_k_m --zeros -o /tmp/s52_$L.gguf \
      >/dev/null 2>&1 || echo "make-model $L layers failed"
  done
  for round in 1 2; do for B in 32 64; do for c in 1 0; do for L in 2 3; do
    echo "split clusters $c, batch $B, $L layers, round $round: $(SPARSEMLA_WGMMA_SPLIT_CLUSTERS=$c timeout 60 \
      "$BIN/sparsemla" bench -m /tmp/s52_$L.gguf --device cuda --prompt 1024 --gen 32 --batch $B 2>&1 |
      grep -E '^decode|rror' | grep -oE '[0-9.]+ ms per step|rror.*')" | tee -a "$OUT/s52_model.log"
  done; done; done; done
  rm -f /tmp/s52_2.gguf /tmp/s52_3.gguf
fi

if has s51; then
  gtests s51 150 sparsemla_tests 'CudaAttention.SparseMlaMatchesTheCpuReference:*GpuModelFixture.F32Cache*'
  SPARSEMLA_GPU_TEST_SMALL=1 timeout 120 "$SAN" --tool memcheck "$BIN/sparsemla_tests" \
    --gtest_filter='CudaAttention.SparseMlaMatchesTheCpuReference' >"$OUT/s51_memcheck.log" 2>&1
  echo "s51 memcheck: exit $?"; grep -hE "ERROR SUMMARY" "$OUT/s51_memcheck.log"
fi

if has s50; then
  gtests s50 200 sparsemla_tests 'CudaAttention.*:SparseMlaPlan.*'
  for m in 0 1; do
    SPARSEMLA_WGMMA_BULK_OUT=$m gtests s50_bulk$m 100 sparsemla_tests 'CudaAttention.SparseMlaWgmma*'
  done
  for tool in memcheck racecheck; do
    SPARSEMLA_WGMMA_BULK_OUT=1 SPARSEMLA_GPU_TEST_SMALL=1 timeout 150 "$SAN" --tool $tool "$BIN/sparsemla_tests" \
      --gtest_filter='CudaAttention.SparseMlaWgmmaMatches*:CudaAttention.SparseMlaWgmmaTakesTensor*' \
      >"$OUT/s50_$tool.log" 2>&1
    echo "s50 $tool: exit $?"; grep -hE "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/s50_$tool.log"
  done
  for round in 1 2; do
    for k in mma wgmma; do
      echo "== round $round --kernel $k" | tee -a "$OUT/s50_bounds.log"
      SPARSEMLA_WGMMA_BULK_MIN_ROWS=1 SPARSEMLA_WGMMA_MIN_BATCH=1 SPARSEMLA_WGMMA_FP8_MIN_ROWS=1 timeout 120 \
        "$BIN/sparsemla" bench attention --kernel $k --shapes glm5 dsv32 --kv bf16 fp8 --batch 1 2 4 \
        --context 4096 131072 --reps 3 2>&1 | grep -E "^(glm5|dsv32)|rror" | step | tee -a "$OUT/s50_bounds.log"
    done
  done
fi

if has s48; then
  gtests s48 150 sparsemla_tests \
    'CudaAttention.IndexQueries*:CudaAttention.IndexerTakes*:CudaAttention.IndexerScoresMatch*:DeviceCli.BenchAttention*'
  for k in auto mma wgmma; do
    echo "== tensor-parallel shares, --kernel $k" | tee -a "$OUT/s48_tp.log"
    timeout 120 "$BIN/sparsemla" bench attention --kernel $k --shapes glm5-tp2 glm5-tp8 dsv32-tp2 --kv bf16 fp8 \
      --batch 1 8 32 128 --context 4096 131072 --reps 3 2>&1 | grep -E "^(glm5|dsv32)|rror" | tee -a "$OUT/s48_tp.log"
  done
fi

if has f16; then
  gtests f16 150 sparsemla_tests \
    'CudaAttention.SparseMla*:CudaAttention.FrontSelections*:SparseMlaPlan*:CudaAttention.IndexQueries*:CudaAttention.IndexerTakes*'
  if [ -x "$SAN" ]; then
    SPARSEMLA_GPU_TEST_SMALL=1 timeout 90 "$SAN" --tool racecheck --error-exitcode 9 "$BIN/sparsemla_tests" \
      --gtest_filter='CudaAttention.SparseMlaWgmma*' >"$OUT/f16_racecheck.log" 2>&1
    echo "f16 racecheck: exit $?"
    SPARSEMLA_GPU_TEST_SMALL=1 timeout 90 "$SAN" --tool memcheck --report-api-errors no --error-exitcode 9 "$BIN/sparsemla_tests" \
      --gtest_filter='CudaAttention.SparseMlaWgmma*:CudaAttention.SparseMlaFp8Rows*' >"$OUT/f16_memcheck.log" 2>&1
    echo "f16 memcheck: exit $?"; grep -hE "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/f16_racecheck.log" "$OUT/f16_memcheck.log"
  fi
  for round in 1 2; do
    # (The fp16 tiles' A/B, SPARSEMLA_WGMMA_F16=1 against 0, needs a build with
    # patches/wgmma_fp16_tiles.patch: the code left the tree after run 82.)
    if [ -x "$BIN/sparsemla_old" ]; then
      for v in sparsemla sparsemla_old; do
        echo "== mma fp8 rows, $v, round $round" | tee -a "$OUT/f16_attention.log"
        timeout 60 "$BIN/$v" bench attention --kernel mma --shapes glm5 dsv32 --kv fp8 --batch 1 2 8 \
          --context 4096 131072 --reps 3 2>&1 | grep -E "^(glm5|dsv32)|rror" | tee -a "$OUT/f16_attention.log"
      done
    fi
  done
fi

if has small8; then
  gtests small8 120 sparsemla_tests 'CudaAttention.SparseMlaBatchOne*:CudaAttention.SparseMlaWgmma*:SparseMlaPlan*'
  for round in 1 2; do
    for k in mma wgmma; do
      echo "== fp8 attention, --kernel $k, round $round" | tee -a "$OUT/small8_attention.log"
      SPARSEMLA_WGMMA_FP8_MIN_ROWS=1 timeout 60 "$BIN/sparsemla" bench attention --kernel $k --shapes glm5 dsv32 \
        --kv fp8 --batch 1 2 4 8 --context 4096 131072 --reps 3 2>&1 | grep -E "^(glm5|dsv32)|rror" | tee -a "$OUT/small8_attention.log"
    done
  done
  timeout 60 "$BIN/sparsemla" make-model --preset glm5-width --layers 3 --type q4_k_m --zeros -o /tmp/g3s.gguf \
    >/dev/null 2>&1 || echo "make-model q4_k_m 3 layers failed"
  for round in 1 2; do
    for mb in 256 1; do
      echo "fp8 cache, SPARSEMLA_WGMMA_FP8_MIN_ROWS=$mb, round $round: $(SPARSEMLA_WGMMA_FP8_MIN_ROWS=$mb timeout 90 \
        "$BIN/sparsemla" bench -m /tmp/g3s.gguf --device cuda --kv-cache fp8 --prompt 32768 --gen 32 --batch 1 2>&1 |
        grep -E '^decode|rror')" | tee -a "$OUT/small8_model.log"
    done
  done
  rm -f /tmp/g3s.gguf
  if [ -x "$BIN/sparsemla_peer" ] && [ -x "$BIN/sparsemla_tests_peer" ]; then
    gtests small8_peer 120 sparsemla_tests_peer 'CudaAttention.SparseMlaWgmma*'
    SPARSEMLA_GPU_TEST_SMALL=1 timeout 120 "$SAN" --tool racecheck --error-exitcode 9 "$BIN/sparsemla_tests_peer" \
      --gtest_filter='CudaAttention.SparseMlaWgmmaPairs*' >"$OUT/small8_peer_racecheck.log" 2>&1
    echo "peer racecheck: exit $?"; grep -hE "RACECHECK SUMMARY" "$OUT/small8_peer_racecheck.log"
    for round in 1 2; do
      for v in "" _peer; do
        echo "== sparsemla$v, round $round" | tee -a "$OUT/small8_peer.log"
        timeout 60 "$BIN/sparsemla$v" bench attention --kernel wgmma --shapes dsv32 --kv fp8 --batch 32 128 \
          --context 4096 131072 --reps 3 2>&1 | grep -E "^dsv32|rror" | tee -a "$OUT/small8_peer.log"
      done
    done
  fi
fi

if has fp8; then
  for c in "dsv32 fp8" "glm5 fp8" "glm5 bf16"; do
    set -- $c
    KERNEL=mla_wgmma_kernel NAME=wgmma_${1}_$2 SKIP=3 NCU_TIMEOUT=90 bash "$(dirname "$0")/ncu_sass.sh" \
      "$BIN/sparsemla" bench attention --kernel wgmma --shapes "$1" --kv "$2" --batch 128 --context 4096 --reps 1 2>&1 |
      head -45
  done
  timeout 150 "$BIN/sparsemla" bench attention --batch 1 128 --context 4096 131072 --reps 3 >"$OUT/fp8_table.log" 2>&1
  echo "decode table: exit $?"; grep -E "^(glm5|dsv32|device|ceilings)" "$OUT/fp8_table.log" | cut -c1-150
fi

if has wgmma; then
  W='CudaAttention.SparseMla*:CudaAttention.FrontSelections*:*GpuModelFixture.LogitsMatch*:*GpuModelFixture.Greedy*'
  gtests wgmma 240 sparsemla_tests "$W"
  if [ -x "$SAN" ]; then
    SPARSEMLA_GPU_TEST_SMALL=1 timeout 120 "$SAN" --tool memcheck --report-api-errors no --error-exitcode 9 \
      "$BIN/sparsemla_tests" --gtest_filter='CudaAttention.SparseMlaWgmma*' >"$OUT/wgmma_memcheck.log" 2>&1
    echo "wgmma memcheck: exit $?"
    SPARSEMLA_GPU_TEST_SMALL=1 timeout 120 "$SAN" --tool racecheck --error-exitcode 9 "$BIN/sparsemla_tests" \
      --gtest_filter='CudaAttention.SparseMlaWgmma*' >"$OUT/wgmma_racecheck.log" 2>&1
    echo "wgmma racecheck: exit $?"
    grep -hE "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/wgmma_memcheck.log" "$OUT/wgmma_racecheck.log"
  fi
  # As a prefill's attention (a call's 128 tokens on one sequence: rows shared in L2).
  for v in SPARSEMLA_WGMMA_LINES=0 SPARSEMLA_WGMMA_LINES=1; do
    echo "== one sequence, $v" | tee -a "$OUT/wgmma_one_sequence.log"
    env $v timeout 60 "$BIN/sparsemla" bench attention --kernel wgmma --shapes glm5 dsv32 --kv bf16 --batch 128 \
      --context 4096 16384 --one-sequence --reps 3 2>&1 | grep -E "^(glm5|dsv32)|rror" | tee -a "$OUT/wgmma_one_sequence.log"
  done
  for lines in 1 0; do
    echo "== attention, SPARSEMLA_WGMMA_LINES=$lines" | tee -a "$OUT/wgmma_attention.log"
    SPARSEMLA_WGMMA_LINES=$lines timeout 120 "$BIN/sparsemla" bench attention --kernel wgmma --shapes glm5 dsv32 \
      --kv bf16 fp8 --batch 8 32 64 128 --context 4096 32768 131072 --reps 3 2>&1 | grep -E "^(glm5|dsv32)|rror" \
      | tee -a "$OUT/wgmma_attention.log"
  done
  for minb in 8 1; do
    echo "== attention, SPARSEMLA_WGMMA_MIN_BATCH=$minb" | tee -a "$OUT/wgmma_crossover.log"
    SPARSEMLA_WGMMA_MIN_BATCH=$minb timeout 60 "$BIN/sparsemla" bench attention --kernel wgmma --shapes glm5 dsv32 \
      --kv bf16 --batch 1 2 4 8 --context 4096 131072 --reps 3 2>&1 | grep -E "^(glm5|dsv32)|rror" \
      | tee -a "$OUT/wgmma_crossover.log"
  done
  timeout 60 "$BIN/sparsemla" make-model --preset glm5-width --layers 3 --type q4_k_m --zeros -o /tmp/g3w.gguf \
    >/dev/null 2>&1 || echo "make-model q4_k_m 3 layers failed"
  for round in 1 2; do
    for lines in 1 0; do
      for P in 4096 16384; do
        line=$(SPARSEMLA_WGMMA_LINES=$lines timeout 60 "$BIN/sparsemla" bench -m /tmp/g3w.gguf --device cuda \
          --prompt $P --gen 2 2>&1 | grep -E "^prefill|rror")
        echo "lines $lines, prompt $P, round $round: $line" | tee -a "$OUT/wgmma_prefill.log"
      done
    done
  done
  rm -f /tmp/g3w.gguf
fi

if has prefill; then
  F='*CudaMatmul.CublasPrefill*:*CudaMatmul.DequantizeBf16*:*CudaMatmul.MatchesCpu*:CudaMatmulApi.*:*GpuModelFixture.LongPrompt*:*GpuModelFixture.Logits*:*Absorption*'
  timeout 240 "$BIN/sparsemla_tests" --gtest_filter="$F" >"$OUT/prefill_tests.log" 2>&1
  echo "prefill tests: exit $?"
  grep -E "^\[  FAILED|PASSED|tests ran" "$OUT/prefill_tests.log" | tail -12
  grep -E "tokens, .* (same choices|free)" "$OUT/prefill_tests.log" | head -8
  [ -x "$SAN" ] && { SPARSEMLA_GPU_TEST_SMALL=1 timeout 150 "$SAN" --tool memcheck --error-exitcode 9 "$BIN/sparsemla_tests" \
    --gtest_filter='*CudaMatmul.CublasPrefill*/q4_K:*CudaMatmul.CublasPrefill*/bf16:*CudaMatmul.DequantizeBf16*/iq2_xs:CudaMatmulApi.F32Blas*' \
    >"$OUT/prefill_memcheck.log" 2>&1; echo "prefill memcheck: exit $?"; grep -E "ERROR SUMMARY" "$OUT/prefill_memcheck.log" | tail -1; }
  for t in q4_K q6_K q8_0 bf16; do
    timeout 120 "$BIN/bench_cuda_matmul" --quick --prefill --type $t 2>&1 | grep -vE "^$" | tee -a "$OUT/prefill_bench.log"
  done
  timeout 60 "$BIN/sparsemla" make-model --preset glm5-width --layers 3 --type q4_k_m --zeros -o /tmp/g3pf.gguf \
    >/dev/null 2>&1 || echo "make-model q4_k_m 3 layers failed"
  for p in 4096 32768; do
    for b in 1 0 1 0; do
      echo "3 layers, prompt $p, SPARSEMLA_PREFILL_BLAS=$b: $(SPARSEMLA_PREFILL_BLAS=$b timeout 90 "$BIN/sparsemla" bench \
        -m /tmp/g3pf.gguf --device cuda --prompt $p --gen 4 --batch 1 2>&1 | grep '^prefill')" | tee -a "$OUT/prefill_model.log"
    done
  done
  # Prefill chunk sizes (serve's --batch-tokens; 4096 on a GPU by default since session 39), with the
  # experts' tiles (session 40) on and off (SPARSEMLA_EXPERT_TILES), and decode batches past 64.
  for t in 1 0; do
    echo "SPARSEMLA_EXPERT_TILES=$t:" | tee -a "$OUT/prefill_model.log"
    SPARSEMLA_EXPERT_TILES=$t timeout 150 "$BIN/sparsemla" bench -m /tmp/g3pf.gguf --device cuda --prompt 4096,32768 --gen 2 \
      --batch 1 --batch-tokens 512,2048,4096,8192,16384 2>&1 | grep -E '^prefill|workspace' | tee -a "$OUT/prefill_model.log"
    SPARSEMLA_EXPERT_TILES=$t timeout 100 "$BIN/sparsemla" bench -m /tmp/g3pf.gguf --device cuda --prompt 1024 --gen 24 \
      --batch 128,256 2>&1 | grep -E '^decode' | tee -a "$OUT/prefill_model.log"
  done
  # Session 41's indexer tokens kernel (the default in a prefill) against qfrag, long prompts, both
  # cache formats (H100 and H200 figures in PERFORMANCE.md, "Session 41"); the kernels alone at a
  # 4096-token prefill (`bench attention --prefill`, written in session 41 after its device time).
  timeout 300 "$BIN/sparsemla" bench attention --prefill 4096 --batch 1 --context 32768 131072 --reps 2 2>&1 |
    grep -E '^prefill|^ceilings|^device' | tee -a "$OUT/prefill_model.log"
  for kv in bf16 fp8; do
    for k in tokens qfrag; do
      echo "SPARSEMLA_INDEXER_MMA=$k, --kv-cache $kv:" | tee -a "$OUT/prefill_model.log"
      SPARSEMLA_INDEXER_MMA=$k timeout 200 "$BIN/sparsemla" bench -m /tmp/g3pf.gguf --device cuda --kv-cache $kv \
        --prompt 32768,131072 --gen 2 --batch 1 2>&1 | grep -E '^prefill' | tee -a "$OUT/prefill_model.log"
    done
  done
  # Session 42's per-token rows of front selections (each token's attention blocks stop after its
  # first min(top_k, n_ctx) entries; SPARSEMLA_MLA_SELECTED_FRONT=0 goes over all top_k entries, as
  # before): prompts of 2048 and 4096 tokens (one forward; the first 2048 tokens have fewer rows)
  # and 16K (only its first forward's tokens), and its GPU tests (the stale tail past the context).
  for p in 2048 4096 16384; do
    for f in 1 0 1 0; do
      echo "prompt $p, SPARSEMLA_MLA_SELECTED_FRONT=$f: $(SPARSEMLA_MLA_SELECTED_FRONT=$f timeout 90 "$BIN/sparsemla" bench \
        -m /tmp/g3pf.gguf --device cuda --prompt $p --gen 2 --batch 1 2>&1 | grep '^prefill')" | tee -a "$OUT/prefill_model.log"
    done
  done
  timeout 120 "$BIN/sparsemla_tests" --gtest_filter='CudaAttention.FrontSelections*:CudaAttention.SparseMla*' 2>&1 |
    grep -E "^\[  (PASSED|FAILED)|FAILED" | tee -a "$OUT/prefill_model.log"
  for r in 128 64; do
    SPARSEMLA_PREFILL_BLAS=1 SPARSEMLA_SPLIT_NORM_MAX_ROWS=$r SPARSEMLA_CUDA_GRAPHS=0 timeout 200 ncu --clock-control none \
      --metrics gpu__time_duration.sum --csv "$BIN/sparsemla" bench -m /tmp/g3pf.gguf --device cuda --prompt 4096 --gen 1 \
      --batch 1 >"$OUT/prefill_ncu_$r.csv" 2>/dev/null
    echo "== one 4096-token chunk (cuBLAS prefill on), split norms up to $r rows:"
    python3 "$(dirname "$0")/ncu_kernel_totals.py" "$OUT/prefill_ncu_$r.csv" 20
  done
  rm -f /tmp/g3pf.gguf
fi

if has attention; then
  for round in $(seq 1 "${ROUNDS:-2}"); do
    for p in 1 0; do
      SPARSEMLA_MLA_TILE_PAIRS=$p timeout 70 "$BIN/sparsemla" bench attention --shapes glm5 dsv32 --kv bf16 fp8 \
        --batch 1 2 --context 1024 4096 131072 --kernel mma >"$OUT/attention_${round}_$p.log" 2>&1
      echo "== round $round, tile pairs $p (columns: idx+top-k | attention | step | kernels)"
      grep -E "^(glm5|dsv32) " "$OUT/attention_${round}_$p.log" | step
    done
  done
fi

if has tests; then
  F='CudaAttention.SparseMlaTilePairs*:CudaAttention.*:*GpuModel*:*CudaMatmulQ8*'  # (typed suites: Types/..., Fixtures/...)
  timeout 330 "$BIN/sparsemla_tests" --gtest_filter="$F" >"$OUT/tests.log" 2>&1
  echo "tests: exit $?"
  grep -E "^\[  FAILED|PASSED|tests ran|OK \] CudaAttention.SparseMlaTile" "$OUT/tests.log" | tail -12
fi

if has sanitizer && [ -x "$SAN" ]; then
  SPARSEMLA_GPU_TEST_SMALL=1 timeout 140 "$SAN" --tool memcheck --report-api-errors no --error-exitcode 9 \
    "$BIN/sparsemla_tests" --gtest_filter='CudaAttention.SparseMla*:CudaAttention.Front*:*CudaMatmulQ8.StagedLoads*' \
    >"$OUT/memcheck.log" 2>&1
  echo "compute-sanitizer memcheck: exit $?"
  SPARSEMLA_GPU_TEST_SMALL=1 timeout 150 "$SAN" --tool racecheck --error-exitcode 9 "$BIN/sparsemla_tests" \
    --gtest_filter='CudaAttention.SparseMlaTilePairs*:CudaAttention.SparseMlaMatchesTheCpuReference' >"$OUT/racecheck.log" 2>&1
  echo "compute-sanitizer racecheck: exit $?"
  grep -hE "ERROR SUMMARY|RACECHECK SUMMARY|FAILED|PASSED" "$OUT/memcheck.log" "$OUT/racecheck.log" | tail -6
fi

if has model; then
  for t in iq2_xs iq1_s; do
    timeout 60 "$BIN/sparsemla" make-model --preset glm5-width --layers 2 --type $t --zeros -o /tmp/m_$t.gguf \
      >/dev/null 2>&1 || { echo "make-model $t failed"; continue; }
    for g in 1 0; do
      line=$(SPARSEMLA_Q8_SMEM_GRID=$g timeout 40 "$BIN/sparsemla" bench -m /tmp/m_$t.gguf --device cuda --prompt 512 \
        --gen 48 --batch 1 2>&1 | grep '^decode' | grep -o '[0-9.]* ms per step')
      echo "$t SMEM_GRID=$g: $line" | tee -a "$OUT/model.log"
    done
    rm -f /tmp/m_$t.gguf
  done
  timeout 60 "$BIN/sparsemla" make-model --preset glm5-width --layers 2 --type q4_k_m --zeros -o /tmp/g2.gguf \
    >/dev/null 2>&1 || echo "make-model q4_k_m failed"
  for round in 1 2; do
    for p in 1 0; do
      line=$(SPARSEMLA_MLA_TILE_PAIRS=$p timeout 40 "$BIN/sparsemla" bench -m /tmp/g2.gguf --device cuda --prompt 1024 \
        --gen 64 --batch 1 2>&1 | grep '^decode' | grep -o '[0-9.]* ms per step')
      echo "q4_k_m 2 layers, tile pairs $p, round $round: $line" | tee -a "$OUT/model.log"
    done
  done
fi

if has ncu; then
  KERNEL=mla_mma_kernel SKIP=3 timeout 80 bash "$(dirname "$0")/ncu_sass.sh" "$BIN/sparsemla" bench attention \
    --shapes glm5 --kv bf16 --batch 1 --context 1024 2>&1 | head -30 | tee "$OUT/ncu.log"
fi

if has profile; then
  timeout 60 "$BIN/sparsemla" make-model --preset glm5-width --layers 3 --type q4_k_m --zeros -o /tmp/g3p.gguf \
    >/dev/null 2>&1 || echo "make-model q4_k_m 3 layers failed"
  for hold in 20000 200000; do
    echo "== step profile, hold $hold us" | tee -a "$OUT/profile.log"
    SPARSEMLA_STEP_PROFILE=1 SPARSEMLA_STEP_PROFILE_HOLD_US=$hold timeout 60 "$BIN/sparsemla" bench -m /tmp/g3p.gguf \
      --device cuda --prompt 1024 --gen 32 --batch 1 2>&1 | grep -E "per step" | head -8 | tee -a "$OUT/profile.log"
  done
  rm -f /tmp/g3p.gguf
fi
