// The lightning indexer's tokens kernel (IndexerMma::kTokens): a prefill's tokens share each key
// tile. The other mma kernels score one token per block, so a prefill of T tokens reads every key
// tile T times over (from L2: 16 GB per layer for a 4096-token chunk at 16K context), and that, not
// the tensor cores, sets its pace. Here a block takes TQ consecutive tokens (8 / HW) and a run of
// tiles: the tiles come through the qfrag kernel's shared-memory stages once, and each of the
// block's 8 warps scores all 64 keys of a tile against the A fragments of MH m-tiles of its token's
// heads, held in registers for the whole block (HW warps per token, MH * 16 heads each); fp8 keys
// are widened to fp16 once per tile for all of them (not per warp, as qfrag's warps do). The sums
// are the qfrag kernel's, term for term and in the same order (the heads' relu-weighted products
// added per lane over its m-tiles, then over the 8 lanes of a key in one tree, then the second
// warp's), so both kernels give the same bits.
//
// Tokens of another sequence in a block (the block's tokens are consecutive rows of the call; only
// at a sequence's boundary, or in a decode batch) are scored in a pass of their own over their
// sequence's pages: correct for any batch, efficient where runs of a sequence are long, which is
// why indexer_mma_choice takes this kernel only when IndexerArgs::tokens_per_run says so.
//
// Included by indexer_kernels.cuh (its helpers: the stages' copies and sizes, the shared step
// key_pair_products / key_pair_head_sums, sum_over_g), whose dispatch launches it; built by the host
// emulation too.
#pragma once

namespace sparsemla::cuda::indexer {

constexpr int kTokensWarps = 8;
constexpr int kTokensThreads = kTokensWarps * 32;
// Two blocks per SM (registers held to 128): 64 registers of query fragments per thread.
constexpr int kTokensMinBlocks = 2;

// Two stages: on an H100 (session 41) three and four streamed a 16K prompt's indexer no faster (15.8,
// 16.0, 15.7 ms over its 18 calls under Nsight Compute; prefill tok/s within 0.5%).
constexpr int kTokensStages = 2;

// Shared memory: the key stages (qfrag_stage_bytes: fp8 rows as stored), for fp8 keys the tile
// widened to fp16 [64][DIM + 8], the partial sums of the HW > 1 warps of a token [8 warps][64 keys],
// the run's page-table entries.
template <int DIM, bool FP8, int HW>
__host__ __device__ constexpr int tokens_fixed_bytes() {
  return kTokensStages * qfrag_stage_bytes<DIM, FP8>() + (FP8 ? kKeysPerTile * (DIM + 8) * 2 : 0) +
         (HW > 1 ? kTokensWarps * kKeysPerTile * 4 : 0);
}
template <int DIM, bool FP8, int HW>
size_t tokens_smem_bytes(int tiles, int block_size) {
  return size_t(tokens_fixed_bytes<DIM, FP8, HW>()) + size_t(pages_per_block(tiles, block_size) + 3) / 4 * 16;
}

// Row h of token t's queries as the 16-bit pair at dimensions d, d + 1 (zeros for padding heads):
// from the 16-bit queries, or the fp32 ones rounded as stage_queries rounds them.
template <class T16>
__device__ __forceinline__ uint32_t query_pair(const IndexerArgs& a, int64_t t, int h, int d) {
  if (h >= a.heads) return 0u;
  const int64_t i = (t * a.heads + h) * a.dim + d;
  if (a.q16) return *reinterpret_cast<const uint32_t*>(a.q16 + i);
  const float2 v = *reinterpret_cast<const float2*>(a.q + i);
  if constexpr (std::is_same<T16, __half>::value) {
    const __half2 h2 = __floats2half2_rn(v.x, v.y);
    return *reinterpret_cast<const uint32_t*>(&h2);
  } else {
    return pack_bf16(v.x, v.y);
  }
}

template <int DIM, bool FP8, int HW, int MH>
__global__ void __launch_bounds__(kTokensThreads, kTokensMinBlocks) indexer_tokens_kernel(IndexerArgs a, int tiles_per_block, int slot_run) {
  static_assert(DIM % 32 == 0 && (HW == 1 || HW == 2) && (MH == 1 || MH == 2), "shape");
  constexpr int STAGES = kTokensStages;
  using T16 = typename std::conditional<FP8, __half, __nv_bfloat16>::type;
  constexpr int STR = DIM + 8, KSTEPS = DIM / 16, RB8 = DIM + 4;  // RB8: an fp8 row's bytes
  constexpr int TQ = kTokensWarps / HW;                            // tokens per block
  constexpr int SB = qfrag_stage_bytes<DIM, FP8>();
  constexpr int KW = 32, NT = KW / 8, V = 2 * NT;  // keys per group (two per tile), n-tiles, a lane's sums
  SPARSEMLA_DYNAMIC_SMEM(smem);
  unsigned char* sStage = smem;                                                 // [STAGES][SB]
  T16* sWide = reinterpret_cast<T16*>(smem + STAGES * SB);                      // fp8: [64][STR]
  float* sPart = reinterpret_cast<float*>(sWide + (FP8 ? kKeysPerTile * STR : 0));  // [8 warps][64] (HW > 1)
  int32_t* sPage = reinterpret_cast<int32_t*>(smem + tokens_fixed_bytes<DIM, FP8, HW>());  // [pages]

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, q4 = lane % 4;
  const int mi = lane / 8, ri = lane % 8;
  const int slot = warp / HW, hw = warp % HW;  // this warp's token of the block, and its heads' share
  const int64_t tq0 = int64_t(blockIdx.y) * TQ;
  const int n_slots = int(min(int64_t(TQ), a.T - tq0));
  const int tile0 = int(blockIdx.x) * tiles_per_block;
  const int64_t t = tq0 + min(slot, n_slots - 1);  // (warps past the last token stand in for it, unwritten)
  const int n_tok = a.n_ctx[t];
  const bool have = slot < n_slots;
  const uint8_t* keys = static_cast<const uint8_t*>(a.keys.data);
  const int64_t RB = a.keys.row_bytes;
  const int bs = a.keys.block_size;
  const bool pow2 = (bs & (bs - 1)) == 0;
  const int bs_shift = __ffs(bs) - 1;
  const bool one_page = bs % kKeysPerTile == 0;
  // fp8: rows are copied as runs of `slot_run` consecutive slots (fp8_run: a page, or a whole tile of
  // a larger one), 16 bytes at a time.
  const int run_bytes = slot_run * int(RB);

  // The runs of the block's tokens that share a sequence, one pass each over its keys: slots s0 ..
  // s1 - 1, the largest context n among them, and the block's tiles of it.
  struct Run {
    int s0, s1, seq, n, n_tiles;
  };
  auto run_from = [&](int s0) {
    Run r{s0, s0 + 1, a.seq[tq0 + s0], a.n_ctx[tq0 + s0], 0};
    while (r.s1 < n_slots && a.seq[tq0 + r.s1] == r.seq) r.n = max(r.n, a.n_ctx[tq0 + r.s1++]);
    r.n_tiles = min(tiles_per_block, (r.n + kKeysPerTile - 1) / kKeysPerTile - tile0);
    return r;
  };
  // The next run from slot s0 with keys in this block's tiles (n_tiles <= 0: none).
  auto next_run = [&](int s0) {
    Run r = run_from(s0);
    while (r.n_tiles <= 0 && r.s1 < n_slots) r = run_from(r.s1);
    return r;
  };
  Run run = next_run(0);
  if (run.n_tiles <= 0) return;  // (the same for every thread)
  const int page0 = tile0 * kKeysPerTile / bs;
  auto slot_of = [&](int p) -> int64_t {
    return pow2 ? (int64_t(sPage[(p >> bs_shift) - page0]) << bs_shift) + (p & (bs - 1))
                : int64_t(sPage[p / bs - page0]) * bs + p % bs;
  };
  // The run's page-table entries (every thread, then a barrier).
  auto load_pages = [&] {
    const int n_pages = (min(run.n, (tile0 + run.n_tiles) * kKeysPerTile) - 1) / bs - page0 + 1;
    for (int i = tid; i < n_pages; i += kTokensThreads)
      sPage[i] = a.keys.block_tables[int64_t(run.seq) * a.keys.max_blocks + page0 + i];
    __syncthreads();
  };
  auto issue = [&](int j, int st) {
    const int p0 = (tile0 + j) * kKeysPerTile, n = run.n;
    const int64_t first = one_page ? slot_of(p0) : 0;
    unsigned char* dst = sStage + st * SB;
    if constexpr (FP8) {
      if (one_page) {
        issue_fp8_run_tile<DIM, kTokensThreads>(dst, keys + first * RB, p0, n);
      } else {  // runs of a page each (chunks starting in a row from n on skipped)
        for (int off = tid * 16; off < kKeysPerTile * RB8; off += kTokensThreads * 16) {
          const int r = off / run_bytes, p = p0 + r * slot_run;
          if (p0 + off / RB8 < n) cp_async16(dst + off, keys + slot_of(p) * RB + (off - r * run_bytes));
        }
      }
    } else
      issue_bf16_tile<DIM, kTokensThreads>(reinterpret_cast<T16*>(dst), keys, RB, p0, n,
                                           [&](int p) { return one_page ? first + (p - p0) : slot_of(p); });
  };
  // The copies of the run's first STAGES - 1 tiles, one group each.
  auto start_run = [&] {
    load_pages();
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
      if (st < run.n_tiles) issue(st, st);
      cp_async_commit();
    }
  };
  start_run();

  // Launched with programmatic dependent launch (pdl.cuh), as the other mma kernels: the page table
  // and the first tile's keys load while the kernel before finishes; the queries and their weights
  // (that kernel's output) after the wait, straight into this warp's A fragments: rows g and g + 8
  // of each m-tile, the k-step's dimensions in the qfrag kernel's order (bf16: ldmatrix's, 2 q4 and
  // 2 q4 + 8; fp8: 4 q4 and 4 q4 + 2, so that a key's word is one load).
  pdl::wait();
  pdl::launch_dependents();
  uint32_t qa[MH][KSTEPS][4];
  float wv[MH][2];
#pragma unroll
  for (int mh = 0; mh < MH; ++mh) {
    const int h = (hw * MH + mh) * 16 + g;
#pragma unroll
    for (int r = 0; r < 2; ++r) wv[mh][r] = h + 8 * r < a.heads ? a.w[t * a.heads + h + 8 * r] : 0.0f;
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
      const int d0 = ks * 16 + (FP8 ? 4 * q4 : 2 * q4), d1 = d0 + (FP8 ? 2 : 8);
      qa[mh][ks][0] = query_pair<T16>(a, t, h, d0);
      qa[mh][ks][1] = query_pair<T16>(a, t, h + 8, d0);
      qa[mh][ks][2] = query_pair<T16>(a, t, h, d1);
      qa[mh][ks][3] = query_pair<T16>(a, t, h + 8, d1);
    }
  }

  for (;;) {
    const int n_tiles = run.n_tiles;
    const bool in_run = have && slot >= run.s0 && slot < run.s1;
    float* out = a.scores + t * a.score_stride;
    for (int it = 0; it < n_tiles; ++it) {
      cp_async_wait_group<STAGES - 2>();
      __syncthreads();  // tile `it` landed for every thread; the stage refilled below is no longer read
      if (it + STAGES - 1 < n_tiles) issue(it + STAGES - 1, (it + STAGES - 1) % STAGES);
      cp_async_commit();
      const int p0 = (tile0 + it) * kKeysPerTile;
      const bool active = in_run && p0 < n_tok;  // (the same for the warp)
      const unsigned char* stage = sStage + (it % STAGES) * SB;
      if constexpr (FP8) {
        // The tile's fp8 rows widened (exactly) to fp16 once for the block's warps, each k-step's 16
        // dimensions in the order of the queries' fragments (qfrag's): dimension 4 q + e at column
        // 2 q + e, 4 q + 2 + e at 8 + 2 q + e. A thread widens 16 bytes of a row (four words, read
        // one by one: fp8 rows are 4-byte aligned) into two 16-byte stores.
        constexpr int CH = DIM / 16;
        for (int i = tid; i < kKeysPerTile * CH; i += kTokensThreads) {
          const int r = i / CH, c = i % CH;
          const uint32_t* src = reinterpret_cast<const uint32_t*>(stage + r * RB8 + c * 16);
          uint32_t lo[4], hi[4];
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const uint32_t w = src[q];
            lo[q] = fp8x2_to_f16x2(w), hi[q] = fp8x2_hi_to_f16x2(w);
          }
          uint4* dst = reinterpret_cast<uint4*>(sWide + r * STR + c * 16);
          dst[0] = make_uint4(lo[0], lo[1], lo[2], lo[3]);
          dst[1] = make_uint4(hi[0], hi[1], hi[2], hi[3]);
        }
        __syncthreads();  // (the next tile's first barrier keeps it until every warp has read it)
      }
      const T16* tile16 = FP8 ? sWide : reinterpret_cast<const T16*>(stage);
      float score[2] = {0.0f, 0.0f};  // keys kg * 32 + key_in_group, kg = 0, 1
      // This lane's key of a group after the sums: value g of sum_over_g<8>.
      const int key_in_group = 8 * (g / 2) + 2 * q4 + g % 2;
      if (active) {
#pragma unroll
        for (int kg = 0; kg < 2; ++kg) {
          const int r0 = kg * KW;
          const T16* kb = tile16 + (r0 + ri) * STR + mi * 8;
          float x[V];
#pragma unroll
          for (int np = 0; np < NT / 2; ++np) {  // two n-tiles at a time, as the qfrag kernel
            // (fp8 keys' columns in the order above: the same products as qfrag's)
            float c[2][MH][4] = {};
            key_pair_products<MH, KSTEPS, STR>(c, qa, kb, np);
            key_pair_head_sums(x, c, wv, np);
          }
          sum_over_g<V>(x, lane);
          score[kg] = x[0];
        }
      }
      if constexpr (HW == 2) {
        // The second warp's heads, added to the first's through shared memory (the next tile's
        // first barrier comes before they are written again).
        if (hw == 1) {
          sPart[warp * kKeysPerTile + key_in_group] = score[0];
          sPart[warp * kKeysPerTile + KW + key_in_group] = score[1];
        }
        __syncthreads();
        if (hw == 0) {
          score[0] += sPart[(warp + 1) * kKeysPerTile + key_in_group];
          score[1] += sPart[(warp + 1) * kKeysPerTile + KW + key_in_group];
        }
      }
      if (active && hw == 0) {
#pragma unroll
        for (int kg = 0; kg < 2; ++kg) {
          const int key = kg * KW + key_in_group;
          float s = score[kg];
          if constexpr (FP8) s *= *reinterpret_cast<const float*>(stage + key * RB8 + DIM);  // the key's scale
          if (p0 + key < n_tok) out[p0 + key] = s;
        }
      }
    }
    if (run.s1 >= n_slots) break;
    run = next_run(run.s1);
    if (run.n_tiles <= 0) break;
    __syncthreads();  // every thread is done with the last run's pages and stages
    start_run();
  }
}

}  // namespace sparsemla::cuda::indexer
