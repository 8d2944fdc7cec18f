// The whole model on one GPU: the same forward as model::Model (model/forward.cpp), every layer on
// the device, over a paged bf16 or fp8 KV cache in device memory. Plain C++ (no CUDA headers);
// built only with CUDA (SPARSEMLA_HAVE_CUDA).
//
// Weights are uploaded once, as the GGUF file stores them (quantized matrices are read in place by
// cuda::matmul); the per-head absorption matrices W_UK / W_UV are read in place when bf16 or f16,
// else become bf16 copies (fp32 in precise mode); norms and biases are fp32. Activations are fp32
// between the operations.
//
// Host synchronization: one per MoE layer (the per-expert token counts are read back to size the
// expert products) and one at the end (the logits are copied to the host).
#pragma once
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "kv/block_allocator.h"
#include "kv/paged_cache.h"
#include "model/arch/arch.h"
#include "model/batch.h"
#include "model/blocks/ffn.h"
#include "model/decisions.h"
#include "model/forward.h"
#include "model/hparams.h"
#include "ops/cuda/attention.h"
#include "ops/cuda/buffer.h"
#include "ops/cuda/quant_matmul.h"
#include "ops/cuda/quant_matmul_q8.h"
#include "ops/cuda/sampling.h"
#include "ops/select/select.h"

namespace sparsemla::model {

class Model;

// The KV cache in device memory: per layer and slot a latent row and (on layers that run their own
// indexer) an index key, in the formats of ops/cuda/attention.h. Blocks, slots and block tables are
// kv::PagedCache's (the same BlockAllocator), so a host block table means the same slots in both.
class GpuCache : public kv::BlockAllocator {
 public:
  // layer_keys[l]: layer l stores index keys (empty: every layer does when shape.idx_dim > 0).
  GpuCache(const kv::CacheShape& shape, int32_t kv_lora, cuda::KvDtype dtype, std::vector<bool> layer_keys = {});

  const kv::CacheShape& shape() const { return shape_; }
  cuda::KvDtype dtype() const { return dtype_; }
  int32_t kv_lora() const { return kv_lora_; }
  int64_t latent_row_bytes() const { return latent_row_; }
  int64_t key_row_bytes() const { return key_row_; }
  bool has_keys(int32_t layer) const { return key_index_[size_t(layer)] >= 0; }
  void* latent(int32_t layer) const {  // [n_slots, latent_row_bytes]
    return latent_.as<char>() + int64_t(layer) * n_slots() * latent_row_;
  }
  void* keys(int32_t layer) const {  // [n_slots, key_row_bytes]; null without keys
    const int32_t k = key_index_[size_t(layer)];
    return k < 0 ? nullptr : keys_.as<char>() + int64_t(k) * n_slots() * key_row_;
  }
  uint64_t bytes() const { return latent_.bytes() + keys_.bytes(); }
  // Device bytes of one token's rows over all layers.
  static uint64_t bytes_per_token(const kv::CacheShape& shape, int32_t kv_lora, cuda::KvDtype dtype,
                                  const std::vector<bool>& layer_keys);

 private:
  kv::CacheShape shape_;
  int32_t kv_lora_ = 0;
  cuda::KvDtype dtype_;
  int64_t latent_row_ = 0, key_row_ = 0;
  std::vector<int32_t> key_index_;  // [n_layers] index into keys_, -1 without keys
  cuda::DeviceBuffer latent_;       // [n_layers, n_slots, latent_row]
  cuda::DeviceBuffer keys_;         // [layers with keys, n_slots, key_row]
};

// The GPU cache formats, indexed: bf16, fp8, f32.
inline constexpr int kFormats = 3;
inline int format_index(cuda::KvDtype d) { return d == cuda::KvDtype::FP8 ? 1 : d == cuda::KvDtype::F32 ? 2 : 0; }
inline cuda::KvDtype format_of(int i) {
  return i == 1 ? cuda::KvDtype::FP8 : i == 2 ? cuda::KvDtype::F32 : cuda::KvDtype::BF16;
}

struct GpuModelOptions {
  cuda::KvDtype kv_cache = cuda::KvDtype::BF16;  // the format make_cache() uses
  int device = 0;
  bool verbose = false;            // print the backend table at load
  int64_t min_cache_tokens = 1024; // load refuses unless a cache of this many tokens fits beside the weights
  int64_t max_batch_tokens = 512;  // the forward size the workspace estimate at load is made for
  // Rows a forward asks logits for, at most (the estimate's logits rows; 0: max_batch_tokens). A
  // server's forwards ask one per sequence (its max_seqs); a larger forward grows the workspace then.
  int64_t max_logit_rows = 0;
  // fp32 matrix products at every batch size (the decode kernels) and the fp32 FMA attention and
  // indexer kernels, instead of bf16 tensor-core products for prefill: slower, and the closest the
  // GPU comes to the CPU's arithmetic (what the tests compare strictly). The caches stay as chosen.
  bool precise = false;
  // Decode batches (up to cuda::kDecodeMaxTokens = 8 tokens) multiply the weights of every type with
  // an int8 kernel (cuda::q8_supported: Q8_0, Q2_K-Q6_K, Q4_0, IQ4_NL, IQ4_XS and the IQ1-IQ3
  // types; those of session 30 not yet run on a GPU) with activations quantized to int8 blocks of 32
  // (dp4a, ops/cuda/quant_matmul_q8.h; llama.cpp's scheme): about 3x fewer instructions per weight
  // than the fp32 kernels, more loads in flight than the one-token tensor-core kernel; decode steps
  // 7-10% shorter on the GLM-5-width test model (H200, session 18), at ~1e-2 relative error per
  // product from the activations' rounding (the bundled model's perplexity +0.2%). Off by default:
  // the fp32-activation products are what the accuracy targets are stated for.
  // `--int8-activations`; never in precise mode.
  bool int8_activations = false;
  // In the fast mode, decode products (up to 8 tokens, and the experts of batches up to 64) of Q8_0,
  // Q5_K, Q2_K, Q3_K, Q4_0 and the IQ types take their activations as two-level int8 blocks
  // (x ~ (d / 254)(254 q + r), ops/cuda/quant_matmul_q8.h): ~3e-5 relative per value, closer to the
  // fp32 activations than the bf16 ones of the tensor-core kernels (~2e-3). These types have no
  // tensor-core decode kernel, and the dp4a kernel beats their fp32 one (H200, output head at one
  // token: Q8_0 91% of copy bandwidth against 75%, Q5_K 56% against 41%, 1.6-2.4x at 8 tokens,
  // session 24; Q2_K / Q3_K / IQ4_XS / IQ2_XXS 181 / 187 / 280 / 187 us against 278 / 415 / 440 /
  // 422, faster at 2-8 tokens but for Q3_K and IQ2_XXS at a few shapes, within 5%, session 29;
  // docs/PERFORMANCE.md); so do IQ3_XXS, IQ3_S, IQ2_XS, IQ2_S, IQ1_S, IQ1_M, Q4_0 and IQ4_NL
  // (1.3-2.5x their fp32 kernel at one token, ahead or even at 2-8; session 32). In one-token
  // steps Q4_K and Q6_K take them too; Q4_K and Q5_K
  // go through the one-token int8 tensor-core kernel (session 25), Q6_K through the dp4a kernel
  // with staged loads (session 26). An input is quantized only where such a product reads it, by the
  // kernel that writes it where that can (the norms, SiLU x up). Off: the fp32 kernels and Q4_K's
  // bf16 one-token kernel, as before.
  // SPARSEMLA_Q8_ACTIVATIONS=0 turns it off without a rebuild; never in precise mode.
  bool q8_two_level = true;
  // Decode steps replay CUDA graphs (one per batch size and context bucket), captured the first
  // time each is seen. Off: every step launches its kernels one by one (vLLM's --enforce-eager).
  bool cuda_graphs = true;
  // The indexer's branch of each attention layer (its head weights' product, index keys, queries,
  // scores and top-k, and the latent cache rows) on a second stream beside the query path (q_a's
  // norm, q_b, rope, W_UK), joined before the attention kernel. Off: one stream, the same results
  // bit for bit. SPARSEMLA_SIDE_STREAM=0 turns it off without a rebuild; the step profile
  // (SPARSEMLA_STEP_PROFILE=1) runs without it.
  bool side_stream = true;
  // With side_stream, the indexer's q_b product also runs on the side stream, right after q_a's norm,
  // beside q_b's on the main stream, instead of in one launch with q_b's: the indexer's queries,
  // scores and top-k (the longer path at contexts past top_k) start once the smaller product is done.
  // Off: q_b and the indexer's q_b in one launch (cuda::matmul_many_q8), the branch after it. The
  // same results bit for bit either way. SPARSEMLA_INDEX_QB_SIDE=0 / 1 sets it without a rebuild.
  // Opt-in until timed on a GPU (written in session 54 without one; docs/PERFORMANCE.md "Session
  // 54", scripts/device/pending_checks.sh phase s54).
  bool index_qb_side = false;
  // The query's rope (into q's latent-space row) done by W_UK's launch where that product takes it
  // (cuda::Blas::takes_rope: one token on the head GEMV), one launch fewer; the same bits. Off: its
  // own launch before W_UK. SPARSEMLA_ROPE_IN_WUK=0 / 1 sets it without a rebuild. Opt-in until
  // timed on a GPU (as index_qb_side; its kernel is checked by the host emulation in CI).
  bool rope_in_wuk = false;
  // The indexer's queries rotated, scaled and rounded by the scores' kernel for its token
  // (cuda::IndexerArgs::prep) where one call scores the whole forward on the qfrag kernel (decode
  // steps), instead of by index_queries' own launch before it: one launch fewer on the indexer's
  // path; the same scores bit for bit. SPARSEMLA_INDEX_QUERIES_IN_SCORES=0 / 1 sets it without a
  // rebuild. Opt-in until timed on a GPU (its kernel is checked by the host emulation in CI).
  bool index_queries_in_scores = false;
  // attn_k_b / attn_v_b stored as bf16 or f16 are read in place by the absorption products (fast
  // mode; no W_UK / W_UV copies on the device). Off: bf16 copies, as for the other types (tests,
  // A/B; the same bits for bf16 files). SPARSEMLA_ABSORB_IN_PLACE=0 turns it off without a rebuild.
  bool absorb_in_place = true;
  // With absorb_in_place, also those stored as a type of the int8 head product (Q8_0, the K-quants,
  // IQ4_XS, IQ2_XXS: cuda::head_q8_supported): int8 dot products at up to 16 tokens, a bf16 copy
  // per call for larger batches; a GLM-5 Q4_K_M layer reads 13.6 MB where its copies are 29.4. Off
  // by default: measured as fast as the copies at batch 1 (H200, session 32: Nsight 48.5 against
  // 49.8 us per step of 3 layers) and 15.8 MB per GLM-5 layer smaller, but slower from 4 tokens
  // (Q6_K rows 2x at 16) and, past 16, by the per-call dequantization; the copies also take the
  // tensor-core kernel at 2-8 tokens (docs/PERFORMANCE.md, "Session 32").
  // SPARSEMLA_ABSORB_QUANT=1 / 0 turns it on / off without a rebuild.
  bool absorb_quantized_in_place = false;
  // A prefill's routed experts (fast mode): the groups of 9 tokens up to `expert_tiles_max` (0: the
  // cuBLAS threshold of the weight's type, cuda::blas_min_tokens, where the cuBLAS prefill is on;
  // else every group) all go through one launch of the prefill kernel per tile width
  // (cuda::matmul_expert_tiles: gate and up together, then down), without column splits, instead
  // of one product (and split sum) per expert; and the groups of up to 8 tokens through one launch
  // per product of the grouped decode kernels. Off: one product per expert for every group.
  // SPARSEMLA_EXPERT_TILES=0 / 1 and SPARSEMLA_EXPERT_TILES_MAX=N set them without a rebuild.
  bool expert_tiles = true;
  int64_t expert_tiles_max = 0;
  // Sparse mode, where every token of a forward has at most top_k positions (its bound: the decode
  // graph's context bucket, else the longest context): the indexer would select all of them, in
  // order, so its queries, head weights, scores and top-k are skipped and the attention goes over
  // each token's context (the same rows in the same order; the index keys are still written).
  // Off: the indexer runs at every context. SPARSEMLA_SHORT_CONTEXT_DENSE=0 turns it off without a
  // rebuild.
  bool short_context_dense = true;
};

// One rank's part of the model under tensor parallelism (dist/cuda/sharded_gpu_model.h makes it, by
// the plan of dist/shard_plan.h): the rank's views of the weights, checked by dist::bind_shard, and
// what they hold. Column slices (attn_output, ffn_down) are packed into whole matrices on upload.
struct GpuShard {
  const ModelWeights* weights = nullptr;   // the rank's views into the model's tensors
  int rank = 0, n_ranks = 1;
  uint32_t n_head = 0;                     // attention heads the views hold
  ExpertRange experts;                     // routed experts they hold
  int64_t vocab_first = 0, vocab_count = 0;  // rows of token_embd and output they hold
};

// How a rank sums and gathers with the others: device pointers, enqueued on the model's stream()
// (NCCL), or done before returning (host-staged). Set by the sharded model after load.
struct GpuCollectives {
  std::function<void(float*, int64_t)> all_reduce_sum;            // data [n], in place
  std::function<void(const float*, int64_t, float*)> all_gather;  // in [n] -> out [n_ranks * n], rank order
  bool capturable = false;  // enqueue-only on the stream (NCCL): a CUDA graph may capture them
};

// What the GPU holds, in bytes, as measured at load.
struct GpuMemory {
  std::string device;
  uint64_t total = 0;
  uint64_t quantized = 0;         // matrices as the file stores them
  uint64_t absorption = 0;        // W_UK / W_UV copies (bf16, fp32 in precise mode; none for bf16 / f16 files)
  uint64_t vectors = 0;           // fp32 norms and biases
  uint64_t weights() const { return quantized + absorption + vectors; }
  uint64_t free_after_load = 0;
  uint64_t workspace_estimate = 0;  // one forward of max_batch_tokens tokens
  int64_t workspace_tokens = 0;
};

class GpuModel {
 public:
  // Uploads `cpu`'s weights (its attention mode, hyperparameters and arch too); `cpu` need not
  // outlive the GpuModel. Throws Error before allocating anything when the weights, a cache of
  // min_cache_tokens and the workspace do not fit in the device's free memory, when a weight's
  // type has no CUDA kernel, or when the device has no GPU kernel for an attention operation.
  static std::unique_ptr<GpuModel> load(const Model& cpu, const GpuModelOptions& opts = {});
  // One rank of a tensor-parallel group: `shard`'s weights instead of the whole model's. forward()
  // needs set_collectives() first.
  static std::unique_ptr<GpuModel> load_shard(const Model& cpu, const GpuShard& shard, const GpuModelOptions& opts = {});
  void set_collectives(GpuCollectives c);
  bool sharded() const { return shard_.n_ranks > 1 || shard_.weights != nullptr; }
  const GpuShard& shard() const { return shard_; }
  cuda::Stream stream() const;
  ~GpuModel();
  GpuModel(const GpuModel&) = delete;
  GpuModel& operator=(const GpuModel&) = delete;

  const HParams& hparams() const { return hp_; }
  AttentionMode attention() const { return attention_; }
  cuda::KvDtype kv_dtype() const { return opts_.kv_cache; }
  int device() const { return opts_.device; }
  const ops::BackendPlan& plan(cuda::KvDtype d) const { return plans_[format_index(d)]; }
  const GpuMemory& memory() const { return mem_; }
  // Decode graphs captured and replayed so far.
  int64_t graph_captures() const;
  int64_t graph_replays() const;
  const std::string& graph_error() const;  // why the last failed capture failed ("" when none did)
  // W_UK launches enqueued (eager or captured) that did the query's rope too (rope_in_wuk).
  int64_t rope_in_wuk_launches() const;
  // Indexer score launches enqueued that did the queries' rope and scales too (index_queries_in_scores).
  int64_t index_queries_in_scores_launches() const;

  // Cache geometry, device bytes per token, and the tokens of cache that free memory holds now
  // (after the workspace estimate), in the format of the options.
  kv::CacheShape cache_shape(int32_t n_blocks, int32_t block_size = 16) const;
  uint64_t cache_bytes_per_token() const;
  int64_t cache_capacity_tokens() const;
  // One line on the device's memory: weights, cache per token and capacity in tokens, workspace.
  std::string memory_report() const;

  // A device cache of n_blocks blocks in the options' format; throws Error with the numbers when it
  // does not fit in free memory.
  GpuCache make_cache(int32_t n_blocks, int32_t block_size = 16) const;

  // Model::forward on the GPU: runs the new tokens of every sequence, writing their cache rows, and
  // appends logits rows ([n_vocab] each, copied to the host) in batch order: every token of a
  // sequence with all_logits, else its last token. `record` receives the discrete choices the GPU
  // made (model/decisions.h: the CPU forward can follow them); recording reads them back to the
  // host layer by layer, for tests and debugging.
  void forward(const std::vector<SeqInput>& batch, GpuCache& cache, std::vector<float>& logits,
               Decisions* record = nullptr);
  // forward(), then one token sampled on the GPU for each logits row (ops/cuda/sampling.h), with
  // that row's parameters; only the ids come back to the host (appended to `ids`). Sharded: every
  // rank samples the same ids from the same gathered logits.   params: [logits rows]
  void sample(const std::vector<SeqInput>& batch, GpuCache& cache, const std::vector<cuda::RowSampling>& params,
              std::vector<int32_t>& ids);
  // The checks forward() makes before touching the device (token ids, block tables inside the
  // cache), and the flattened batch; throws Error naming the sequence.
  static FlatBatch check_batch(const std::vector<SeqInput>& batch, const kv::BlockAllocator& cache, uint32_t n_vocab);

  struct Layer;      // one layer's device weights
  struct Workspace;  // activations and metadata of one forward, in one device allocation
  struct State;      // the device objects: stream, weights, RoPE table, cuBLAS, workspace

 private:
  GpuModel();
  static std::unique_ptr<GpuModel> load_impl(const Model& cpu, const GpuShard* shard, const GpuModelOptions& opts);
  void reduce(float* data, int64_t n);  // the ranks' partial sums; nothing unsharded
  void mark(const char* label);          // SPARSEMLA_STEP_PROFILE: the time since the last mark is `label`'s
  bool side_stream_on() const;  // GpuModelOptions::side_stream, and no step profile running
  int64_t enqueue(const std::vector<SeqInput>& batch, GpuCache& cache, Decisions* record);
  const float* logit_rows(int64_t R);  // the enqueued forward's logits, [R, n_vocab] on the device
  void run_step(GpuCache& cache);        // the device work of one forward (enqueue() lays it out)
  void attention_layer(const Layer& L, int32_t il, GpuCache& cache);
  void index_keys(const Layer& L, int32_t il, GpuCache& cache);  // after attention_layer's first products
  void indexer(int32_t il, GpuCache& cache);                     // after index_keys and q_b's product
  void ffn(const Layer& L, int32_t il);
  // y = x W^T by the options' kernels.   x: [T, w.n_cols]   y: [T, w.n_rows]
  // With q (x quantized by quantized()), the int8-activation product where W's type takes it.
  void product(const cuda::QuantMatrix& w, const float* x, int64_t T, float* y,
               const cuda::Q8Activations* q = nullptr);
  // The int8 activation levels a decode product of this weight type takes (0: fp32 activations):
  // 1 for every type with an int8 kernel under int8_activations, else 2 for the types without a
  // tensor-core decode kernel (Q8_0, Q5_K, Q2_K, Q3_K, the IQ types, Q4_0), and for Q4_K and Q6_K in
  // one-token steps (q8_two_level). One-token products take the one-token int8
  // tensor-core kernel where the type has one (cuda::q8_one_token_supported).
  int q8_levels(gguf::GgmlType t) const;
  // Whether the product of w on T tokens takes the quantized activations q.
  bool takes_q8(const cuda::Q8Activations* q, const cuda::QuantMatrix& w, int64_t T) const;
  // y_i = x W_i^T for the n products of one input (at one token, one launch per type).
  void product_many(const cuda::QuantMatrix* const* w, float* const* y, int n, const float* x, int64_t T,
                    const cuda::Q8Activations* q);
  // The products that read one input (null entries: none).
  struct Readers {
    static constexpr int kMax = 6;
    const cuda::QuantMatrix* m[kMax] = {};
    int n = 0;
    Readers(std::initializer_list<const cuda::QuantMatrix*> l);
  };
  // The int8 levels an input [T, n_cols] of these readers is quantized to (the most any takes:
  // q8_levels); 0 where none takes any (precise mode, T past max_rows, n_cols not whole blocks of
  // 32, no such weight type, or more than the workspace holds).
  int input_levels(int64_t T, int64_t n_cols, const Readers& readers, int64_t max_rows) const;
  // x [T, n_cols] quantized to int8 blocks into workspace slot `slot` (0 or 1), for `readers`, the
  // products that read x, at input_levels; null where that is 0 (max_rows: the decode products'
  // kDecodeMaxTokens; the grouped experts' rows and pairs pass theirs). Where the norm that wrote
  // x quantized it already (producer_q8) at those levels, no launch.
  const cuda::Q8Activations* quantized(const float* x, int64_t T, int64_t n_cols, int slot, const Readers& readers,
                                       int64_t max_rows = cuda::kDecodeMaxTokens);
  // For a kernel about to write x [T, n_cols] (a norm, SiLU x up): slot `slot`'s activations to
  // quantize x into as it writes it, at the levels quantized() will ask for these readers
  // (*levels), or null (none).
  cuda::Q8Activations* producer_q8(const float* x, int64_t T, int64_t n_cols, int slot, const Readers& readers,
                                   int* levels, int64_t max_rows = cuda::kDecodeMaxTokens);
  // The readers of a layer's normed input before attention, and before its FFN.
  Readers attention_readers(const Layer& L) const;
  Readers ffn_readers(const Layer& L) const;
  // out = down(silu(gate y) * up y)   y, out: [T, H]   (qy: y quantized already, or null)
  void mlp(const cuda::QuantMatrix& gate, const cuda::QuantMatrix& up, const cuda::QuantMatrix& down, const float* y,
           int64_t T, float* out, const cuda::Q8Activations* qy = nullptr);

  HParams hp_;
  HParams ahp_;  // hp_ with n_head = the heads this model holds (all, unless sharded)
  GpuShard shard_;
  int device_ = 0;  // the CUDA device it lives on
  GpuCollectives coll_;
  const ArchSpec* spec_ = nullptr;
  AttentionMode attention_ = AttentionMode::Sparse;
  GpuModelOptions opts_;
  ops::BackendPlan plans_[kFormats];  // per cache format (format_index)
  GpuMemory mem_;
  std::unique_ptr<State> st_;
};

}  // namespace sparsemla::model
