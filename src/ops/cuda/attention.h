// Sparse MLA attention and the DSA lightning indexer on the GPU, over a paged cache in device
// memory. Plain C++ (no CUDA headers): every pointer is a device pointer unless it says otherwise.
//
// Cache rows, one layer, one token (a slot = block * block_size + offset, as in kv::PagedCache):
//   latent, bf16: kv_lora + rope bf16 values  (1152 bytes for GLM-5 / DeepSeek-V3.2)
//   latent, fp8:  kv_lora e4m3 | one fp32 scale per 128 latent values | rope bf16, padded to 16 bytes
//                 (656 bytes: 512 + 4*4 + 64*2)
//   index key, bf16: dim bf16 values (256 bytes)
//   index key, fp8:  dim e4m3 | one fp32 scale per 128 values, padded to 4 bytes (132 bytes)
//   f32 (either):    the values as fp32
#pragma once
#include <cstdint>
#include <string>

#include "gguf/ggml_types.h"
#include "ops/cuda/buffer.h"
#include "ops/cuda/small_ops.h"

namespace sparsemla::cuda {

enum class KvDtype {
  BF16,
  FP8,
  F32,  // fp32 rows: twice bf16's bytes; the reference format (the FMA kernels only)
};
const char* kv_dtype_name(KvDtype d);

inline constexpr int kFp8Group = 128;  // values sharing one fp32 scale in the fp8 formats

int64_t latent_row_bytes(KvDtype d, int kv_lora, int rope);
int64_t index_key_row_bytes(KvDtype d, int dim);

// One layer of a paged cache: rows of row_bytes at slot * row_bytes, reached through block tables.
struct PagedRows {
  void* data = nullptr;
  int64_t row_bytes = 0;
  const int32_t* block_tables = nullptr;  // [n_seq, max_blocks]
  int32_t max_blocks = 0;
  int32_t block_size = 16;
};

// Converts fp32 rows to the cache format and stores them at `slots` [T] (int64).
//   latent rows: [T, kv_lora + rope]   index keys: [T, dim]
void write_latent_rows(const float* rows, const int64_t* slots, int64_t T, KvDtype d, int kv_lora, int rope,
                       void* cache, int64_t row_bytes, Stream s);
void write_index_keys(const float* keys, const int64_t* slots, int64_t T, KvDtype d, int dim, void* cache,
                      int64_t row_bytes, Stream s);

// The decode step's fused forms, one launch instead of three: the new tokens' latent rows
// [rms_norm(c) * w | rope(k_pe)] from kv_a's output, and their index keys rope(layer_norm(k) * w + b)
// (rope on the first 2 rope.half values), normalized and rotated in the order and precision of
// rms_norm / layer_norm and DeviceRope::apply (the same bits), then stored as the two above store.
//   kv: [T, kv_lora + rope_dims]   keys: [T, dim]   pos: [T]   norm_b may be null
void write_latent_normed(const float* kv, const float* norm_w, float eps, const RopeTable& rope, const int64_t* pos,
                         const int64_t* slots, int64_t T, KvDtype d, int kv_lora, int rope_dims, void* cache,
                         int64_t row_bytes, Stream s);
void write_index_keys_normed(const float* keys, const float* norm_w, const float* norm_b, float eps,
                             const RopeTable& rope, const int64_t* pos, const int64_t* slots, int64_t T, KvDtype d,
                             int dim, void* cache, int64_t row_bytes, Stream s);

// Which kernel runs an operation (chosen by ops/select; every one is correct on every shape it accepts).
enum class IndexerKernel { Mma, Fma };
enum class AttentionKernel { Mma, Fma, Wgmma };  // Wgmma: Hopper only (sparse_mla_sm90.cu)

// The kernel a backend selector's attention choice names (ops/select: "cuda-wgmma-sm90", "cuda-mma",
// "cuda-fma"); false for a name without a GPU kernel (the CPU).
inline bool attention_kernel_named(const std::string& backend, AttentionKernel* k) {
  if (backend == "cuda-wgmma-sm90") *k = AttentionKernel::Wgmma;
  else if (backend == "cuda-mma") *k = AttentionKernel::Mma;
  else if (backend == "cuda-fma") *k = AttentionKernel::Fma;
  else return false;
  return true;
}

// top_k's first-digit histograms, for the kernel that writes the scores to fill (top_k_counts).
struct TopKCounts {
  uint32_t* hist = nullptr;  // [T][row_words]: row t's 2048 bins at hist + t * row_words (zero on entry)
  int64_t row_words = 0;
  int k = 0;                 // only rows with n > k are counted (top_k lists the others without a select)
};

// The mma indexer's kernels (indexer.cu; each gives the scores within the tests' bound, their sums
// in different orders): kStaged, keys through shared-memory stages against queries read from shared
// memory per 16 (bf16) or 32 (fp8) keys, any head count; kRegs (bf16 keys, up to 64 heads), keys
// straight into registers; kQfrag (up to 64 heads; fp8 keys in pages of a multiple of 64 slots), the
// queries held in registers against keys from the stages; kTokens (a prefill: the qfrag kernel's
// shapes and sums, the same bits), several tokens of one sequence per block sharing each key tile.
// kAuto: the kernel named by SPARSEMLA_INDEXER_MMA=staged|regs|qfrag|tokens, else the measured
// default (choose_mma). A kernel asked for on a shape it does not take falls back to kStaged (kTokens:
// to the default).
enum class IndexerMma { kAuto, kStaged, kRegs, kQfrag, kTokens };

// Lightning-indexer scores of T query tokens: score[t][p] = sum_h w[t][h] * relu(q[t][h] . k[p]) for
// p < n_ctx[t] over the keys of sequence seq[t]; entries p >= n_ctx[t] are left unwritten.
//   q: [T, heads, dim] fp32   w: [T, heads] fp32 (scales folded in)   scores: [T, score_stride]
struct IndexerArgs {
  const float* q = nullptr;  // [T, heads, dim]
  // The same queries already rounded to the 16-bit type the mma kernel multiplies (index_queries):
  // where set, the mma kernel copies them straight into shared memory and does not read q; the fma
  // kernel always reads q. index_queries scales fp16 rows by a power of two and divides w by it, so
  // its q16 goes with the w it wrote (the scores are then the same bits as q's, where those are
  // finite and normal in fp16).
  const uint16_t* q16 = nullptr;
  const float* w = nullptr;
  int64_t T = 0;
  int heads = 0;
  int dim = 0;
  const int32_t* seq = nullptr;    // [T]
  const int32_t* n_ctx = nullptr;  // [T] positions visible to the token (its position + 1)
  int64_t max_ctx = 0;             // >= every n_ctx
  PagedRows keys;
  KvDtype dtype = KvDtype::BF16;
  float* scores = nullptr;
  int64_t score_stride = 0;
  // Where set (top_k_counts), the mma kernel also adds each written score of a row with n_ctx >
  // counts.k into the row's histogram of top_k's first digit, so that the top_k after it skips that
  // pass.
  TopKCounts counts;
  // Where prep.pos is set: q and w as their products wrote them, and the kernel does index_queries'
  // work for its token itself (the rope, w_scale, the 16-bit rounding and fp16 scaling; q16 is not
  // read, q and w are not written), the same scores bit for bit; only where
  // indexer_takes_query_prep says so (the qfrag kernel).
  struct QueryPrep {
    RopeTable rope;
    const int64_t* pos = nullptr;  // [T]
    float w_scale = 1.0f;
  } prep;
  // Which of the mma kernels scores them (IndexerMma).
  IndexerMma mma = IndexerMma::kAuto;
  // The call's tokens per run of consecutive tokens of one sequence, on average (T / runs): from
  // kIndexerTokensMinRun (a prefill) the tokens kernel scores them, each key tile read once for up
  // to 8 of them.
  int64_t tokens_per_run = 1;
};
// The shortest runs (IndexerArgs::tokens_per_run, on average) that take the tokens kernel by default:
// a block's worth at 32 heads.
constexpr int64_t kIndexerTokensMinRun = 8;
void indexer_scores(const IndexerArgs& a, IndexerKernel k, Stream s);
// Calls of indexer_scores that enqueued work since the process started (tests: what a forward ran).
int64_t indexer_score_calls();
// The mma kernel indexer_scores(a, IndexerKernel::Mma) runs (never kAuto), and its name ("staged",
// "regs", "qfrag", "tokens"; "auto" for kAuto).
IndexerMma indexer_mma_choice(const IndexerArgs& a);
const char* indexer_mma_name(IndexerMma k);
// Whether indexer_scores(a, k) takes IndexerArgs::prep: the mma kernel it runs is qfrag, and the
// rope fits the heads.
bool indexer_takes_query_prep(const IndexerArgs& a, IndexerKernel k);

// The 16-bit type of the mma indexer's queries: fp16 against fp8 keys (widened exactly to fp16),
// bf16 against bf16 keys.
inline bool index_queries_fp16(KvDtype keys) { return keys == KvDtype::FP8; }

// The indexer's queries and head weights as the scores read them, in one launch: rope on the first
// 2 rope.half values of each head of q (in place, as DeviceRope::apply), w *= w_scale (in place),
// and where q16 is given the rotated queries rounded to nearest in the mma kernel's 16-bit type
// for keys of `keys` (IndexerArgs::q16). In fp16 (fp8 keys) each head's row is first scaled by the
// power of two f that puts its largest value in [2^12, 2^13), and its weight divided by f: the
// scores are unchanged (relu is positively homogeneous; both scalings are exact), and queries whose
// row maxima lie anywhere in [2^-52, 2^77) fit fp16's range (65504) without overflow or subnormals
// (q_factor keeps its exponent within [-64, 64]). The fp32 q is not scaled.
//   q: [T, heads, dim]   w: [T, heads]   q16: [T, heads, dim]
void index_queries(float* q, float* w, int64_t T, int heads, int dim, const RopeTable& rope, const int64_t* pos,
                   float w_scale, KvDtype keys, uint16_t* q16, Stream s);

// Indices of the k largest of scores[t][0 .. n[t]) per row, in ascending order (so the attention
// sums a token's positions in one order on every run); ties at the boundary go to the lower index
// (the CPU top_k's rule). Rows with n[t] <= k list 0 .. n[t]-1. Unused entries are -1.   out: [T, k]
// Rows of up to 4K scores (stride) take one block each, their keys in registers (block path). With a
// workspace, longer rows are shared among many blocks, the row's histograms in global memory:
// for few rows one launch whose blocks, all resident at once, meet at barriers (team path), else
// three launches and the row's last block compacting bit masks of the selection (span path).
enum class TopKPath {
  kAuto,   // the block path for rows up to 4K scores (SPARSEMLA_TOPK_BLOCK=0: not taken); longer
           // ones: the team path where the rows' blocks fit on the device at once, else the span path
  kSpans,  // the span path for every long row
  kTeam,   // the team path for every long row where it fits (else spans), also when SPARSEMLA_TOPK_TEAM=0 is set
  kRows,   // one block per row, reading the row from global memory on every pass
  kBlock,  // one block per row holding its keys in registers, rows up to 16K scores (longer: as kAuto)
};
struct TopKWorkspace {
  // [rows] per-row state (three histograms and two counters, zero between calls), then [rows, 2, cap]
  // words per row: the span path's two bit masks over the row's positions, or the team path's
  // per-block counts and boundary list. One buffer: its address alone says
  // whether a captured CUDA graph's workspace is still in place.
  DeviceBuffer candidates;
  int64_t rows = 0, cap = 0;
  int sm_count = 0;
  int team_blocks = 0;  // blocks of the team kernel resident at once, at the block size the last plan took
  TopKPath path = TopKPath::kAuto;
  // Threads per block of the team path, and of the block path on rows of up to 4K: 256, 512 or 1024
  // (the span's scores spread over them); 0: SPARSEMLA_TOPK_THREADS where set, else the paths' own
  // choice (the block path 1024; the team path the largest whose blocks fit on the device at once).
  int threads = 0;
  TopKPath last_path = TopKPath::kAuto;  // the path the last call took (kSpans, kTeam, kRows or kBlock)
  int64_t count_max = -1;  // top_k_counts counts at most this many scores (T * stride; -1: kTopKCountMax)
  struct Counted {  // top_k_counts' pending call: its histograms are being filled for this top_k
    const float* scores = nullptr;
    int64_t T = 0, stride = 0;
    int k = 0;
  } counted;
  bool last_counted = false;  // whether the last call read histograms filled by the scores' kernel
};
void top_k(const float* scores, int64_t T, int64_t stride, const int32_t* n, int k, int32_t* out, Stream s,
           TopKWorkspace* ws = nullptr);
// The first pass of the next top_k call, done by the kernel that writes its scores: where top_k (same
// scores, T, stride, k and workspace) will take a long-row path and T * stride <= ws->count_max, the
// rows' first-digit histograms in the workspace, to be filled with the scores (IndexerArgs::counts:
// bin order_key(score) >> 21 of each score p < n[t] of the rows with n[t] > k). That top_k then
// reads them instead of counting (the team path: one barrier and one pass over the scores fewer; the
// span path: one launch fewer). An empty result (short rows, no workspace, more scores than
// count_max): top_k counts them itself. The next top_k on ws must be that call (else it throws,
// leaving the rows' state zeroed); a top_k_counts before it was read (an error in between) zeroes
// the state and starts over.
// The bound: counting costs the indexer a few percent (a warp match and a shared-memory table per
// tile), which pays where the top-k's fixed cost dominates (one token at any context up to ~192K,
// or a few at short ones) and not where the indexer does (batch 8 at 32K and more: 1-6 us slower;
// batch 128: 5-13%). H200, docs/PERFORMANCE.md.
constexpr int64_t kTopKCountMax = 196608;
TopKCounts top_k_counts(const float* scores, int64_t T, int64_t stride, int k, Stream s, TopKWorkspace* ws);

// Attention of T query tokens over latent rows. Per token and head, q = [q_lat (kv_lora) | q_pe (rope)]
// in fp32; logits are scale * q . row, softmax over the token's positions, output the weighted sum of
// the rows' first kv_lora values. Positions: selected[t][0..k) (entries < 0 skipped), or every
// position < n_ctx[t] when selected is null (dense).
//   q: [T, heads, kv_lora + rope]   out: [T, heads, kv_lora]
struct AttentionArgs {
  const float* q = nullptr;
  int64_t T = 0;
  int heads = 0;
  int kv_lora = 0;
  int rope = 0;
  float scale = 1.0f;
  const int32_t* seq = nullptr;       // [T]
  const int32_t* n_ctx = nullptr;     // [T]
  const int32_t* selected = nullptr;  // [T, top_k] positions, or null for dense
  int top_k = 0;
  int64_t max_ctx = 0;                // >= every n_ctx (sizes the dense split)
  // Every selection lists its positions before its -1 entries, as top_k writes them: a token has at
  // most n_ctx <= max_ctx positions, so the launch splits only the first min(top_k, max_ctx) entries
  // (at contexts shorter than top_k, no blocks over entries that are all -1), and each token's
  // blocks stop after its first min(top_k, n_ctx) (a prefill's first top_k tokens). False: any order.
  bool selected_front = false;
  PagedRows latent;
  KvDtype dtype = KvDtype::BF16;
  float* out = nullptr;  // [T, heads, kv_lora], 8-byte aligned (float2 stores; 16 lets the Hopper kernel store by bulk copies)
};

// Scratch memory of the split-KV path; grown on demand and kept.
struct AttentionWorkspace {
  DeviceBuffer partial;
  int sm_count = 0;
  int smem_optin = 0;
  // Emulation of a device with this much shared memory per SM (0: off; bench attention
  // --smem-per-sm): the mma kernel's launch asks for more shared memory than it uses, so that this
  // device holds as many of its blocks per SM as that one would (SM12x: 102400, one 99 KB block).
  int smem_per_sm = 0;
  int device_smem_per_sm = 0;  // this device's (queried on first use)
  // The Hopper kernel with an even number of 64-head blocks per token (128 heads; 65-127 padded) and
  // fp8 rows runs its blocks in pairs (thread-block clusters of two) where each block has two 64-row
  // tiles or more: each block of a pair gathers half of every tile and shares it; false: every block
  // gathers all its rows (tests, A/B). SPARSEMLA_MLA_PAIRS=0 in the environment turns pairs off as well.
  // last_cluster: blocks per cluster of the last call's Hopper launch (1, 2 for pairs, or the split
  // count, twice it paired: split_clusters; 0: the last call launched another kernel, or nothing);
  // last_paired: its blocks were paired.
  bool pairs = true;
  int last_cluster = 0;
  bool last_paired = false;
  // The Hopper kernel's splits of a token (2-8 unpaired, 2-4 paired) as one thread-block cluster
  // ((1, 1, S) or (2, 1, S)) that merges them over distributed shared memory, instead of partial rows
  // in global memory and the merge kernel, where the device runs all of the launch's clusters at once
  // (the same bits), with fewer splits where fewer fit or the plan splits unpaired blocks 9-16 ways,
  // unpairing fp8 blocks where only unpaired clusters fit (sparse_mla, wgmma_split_cluster_rule).
  // GLM-5 batch 48 / 64 93 / 114 -> 62 / 73 us, batch 16-40 22-30% faster, DeepSeek-V3.2 bf16 batch
  // 16 / 32 61 / 101 -> 47 / 60 (H100, session 52, runs 106-107); fp8 batch 16 / 24 / 32 58 / 86 /
  // 100 -> 44 / 58 / 70 (H100, session 53, run 112); GLM-5 batch 12 39 -> 28 (run 113, 8 splits
  // forced: the launch's own choice of them not yet timed).
  // false: the merge kernel (tests, A/B); SPARSEMLA_WGMMA_SPLIT_CLUSTERS=1 / 0 turns it on / off for
  // every call. last_split_cluster: the last call merged so (last_cluster is then its split count).
  bool split_clusters = true;
  bool last_split_cluster = false;
  // The mma kernel's bf16 tiles (bf16 or fp8 rows) with 16 or 32 heads per block and two stages: two sets
  // of warps per head group, each taking every other tile of the split, where a split has two tiles
  // or more and the device has the shared memory (sparse_mla_kernels.cuh, TP); false: one set
  // (tests, A/B). SPARSEMLA_MLA_TILE_PAIRS=0 turns them off as well.
  bool tile_pairs = true;
  // What the last call launched, for benchmarks: the kernel ("mma", "mma fp8 rows", "wgmma", "fma"),
  // heads per block, tiles in flight and split-KV blocks per token (0 where they do not apply).
  struct Launch {
    const char* kernel = "";
    int heads_per_block = 0, stages = 0, splits = 0;
  } last;
};
// The mma kernel's launch shape; 0 chooses from the device's SM count and the work.
//   splits: blocks sharing one token's rows (split-KV, merged by a second kernel, or by the Hopper
//   kernel's clusters: split_clusters, which may take fewer); 1: no split.
//   heads_per_block: 16, 32 or 64.
void sparse_mla(const AttentionArgs& a, AttentionKernel k, AttentionWorkspace& ws, Stream s, int splits = 0,
                int heads_per_block = 0);

}  // namespace sparsemla::cuda

namespace sparsemla::cuda {

// The MLA absorption products, one GEMM per head batched (cuBLAS, bf16 inputs, fp32 accumulate):
//   into the latent space:  out[t][h][0..kv_lora) = W_UK_h q_nope[t][h]     W_UK_h: [kv_lora, nope]
//   out of it:              out[t][h][0..v_head)  = W_UV_h o_lat[t][h]      W_UV_h: [v_head, kv_lora]
// Weights are on the device, heads back to back ([H, rows, cols] row-major: attn_k_b / attn_v_b as
// GGUF stores them): bf16, f16 or a quantized type (read in place), or fp32. x is fp32 [T, H,
// x_stride] (its first `cols` values per head are used); out is fp32 [T, H, out_stride] (its first
// `rows` values per head are written). Decode batches read the weights as stored: bf16 rows on a
// tensor-core kernel at 2-8 tokens (and one token of rows of 256+ columns), f16 rows and the rest
// of one token on a head-batched GEMV (both exact weights times x rounded to bf16, fp32 sums);
// quantized (Quant: head_q8_supported) up to 16 tokens by int8 dot products with x quantized per
// head on two levels (absorb_q8.cu). The rest cuBLAS on bf16 weights (f16 widened, quantized rows
// dequantized, into a scratch copy first, rounded to nearest even): bf16 rows from 9 tokens, f16
// from 17, quantized from 17.
enum class HeadWeights { BF16, F16, Quant };
struct HeadBatchedGemm {
  const void* w = nullptr;  // [H, rows, cols] in `form` (fp32 when f32)
  int heads = 0, rows = 0, cols = 0;
  bool f32 = false;  // fp32 weights and activations, fp32 products (the reference's arithmetic)
  HeadWeights form = HeadWeights::BF16;
  gguf::GgmlType type = gguf::GgmlType::BF16;  // Quant: the rows' ggml type
};
// Whether rows x cols per head of type t at w can be read in place as HeadWeights::Quant: the types
// of the int8 decode units (Q8_0, Q4_K, Q5_K, Q6_K, Q2_K, Q3_K, IQ4_XS, IQ2_XXS), whole blocks per
// row, and every head's rows 16-byte aligned.
bool head_q8_supported(gguf::GgmlType t, int rows, int cols, const void* w);
// A rotation that Blas::per_head may do in its own launch (the query's rope beside W_UK, which
// reads another part of the same rows): DeviceRope::apply_to's with width = 2 table.half, the
// same bits. x: [T, H, x_stride], out: [T, H, out_stride], pos: [T].
struct HeadRope {
  const float* x = nullptr;
  int64_t x_stride = 0;
  float* out = nullptr;
  int64_t out_stride = 0;
  const int64_t* pos = nullptr;
  RopeTable table;
};
class Blas {
 public:
  Blas();
  ~Blas();
  Blas(const Blas&) = delete;
  Blas& operator=(const Blas&) = delete;
  // With `rope`, also that rotation, which takes_rope(g, T) must allow (one token on the head GEMV
  // of bf16 / f16 rows: W_UK's); its heads are g's.
  void per_head(const HeadBatchedGemm& g, const float* x, int64_t x_stride, int64_t T, float* out,
                int64_t out_stride, Stream s, const HeadRope* rope = nullptr);
  bool takes_rope(const HeadBatchedGemm& g, int64_t T) const;
  // Its scratch buffer (grown on demand): a captured CUDA graph holds this address.
  const void* scratch() const { return xbf_.get(); }
  const void* weight_scratch() const { return wbf_.get(); }
  // The path of a product: Auto the measured choice (absorb.cu: head_path); the others force one
  // where it takes the shape, else the head GEMV where that fits, else cuBLAS (tests and
  // bench_cuda_matmul --absorb time each):
  // Kernel the head GEMVs (head_gemv; head_gemv_q8 for quantized rows), TensorCore the bf16
  // tensor-core kernel (head_mma_kernel.cuh), Gemm cuBLAS.
  enum class Path { Auto, Kernel, TensorCore, Gemm };
  Path path = Path::Auto;

 private:
  static constexpr size_t kWorkspaceBytes = size_t(32) << 20;
  void* handle_ = nullptr;
  DeviceBuffer workspace_;  // cuBLAS's (cublasSetWorkspace)
  DeviceBuffer xbf_;  // bf16 copy of x
  DeviceBuffer wbf_;  // bf16 copy of f16 or quantized weights for cuBLAS (more than 16 tokens)
};

// fp32 -> bf16 on the device (for weights uploaded once, and activations).
void to_bf16(const float* x, int64_t n, void* out, Stream s);

}  // namespace sparsemla::cuda
