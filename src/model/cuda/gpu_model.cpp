#include "model/cuda/gpu_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <tuple>
#include <type_traits>

#include "gguf/ggml_types.h"
#include "model/cuda/gpu_ops.h"
#include "model/model.h"
#include "ops/cpu/matmul.h"
#include "ops/cuda/moe_router.h"
#include "ops/cuda/small_ops.h"
#include "ops/device.h"
#include "util/error.h"
#include "util/env.h"
#include "util/half.h"

namespace sparsemla::model {

using cuda::QuantMatrix;

namespace {

constexpr uint64_t kAlign = 256;  // every device array starts on a 256-byte boundary
uint64_t align_up(uint64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// Device memory the load and cache checks leave for what they do not count: the CUDA context,
// cuBLAS's workspace, the attention's split-KV partials, the bf16 copy of one layer's f16 W_UK or
// W_UV that batches of more than 16 tokens widen (Blas::per_head), and the cuBLAS prefill's
// stream-ordered scratch (its 32 MiB workspace, one product's activations in bf16 and up to 64 MiB
// of bf16 rows: ~200 MiB for a 4096-token chunk of GLM-5; where it cannot be had, the product takes
// the tile kernel).
constexpr uint64_t kReserve = uint64_t(768) << 20;
// Indexer scores are computed for as many tokens at once as fit in this many bytes ([tokens, context]).
constexpr uint64_t kScoreBytes = uint64_t(256) << 20;

std::string bytes_str(uint64_t b) {
  if (b >= (uint64_t(1) << 30)) return fmt::format("{:.2f} GiB", double(b) / double(uint64_t(1) << 30));
  if (b >= (uint64_t(1) << 20)) return fmt::format("{:.1f} MiB", double(b) / double(1 << 20));
  return fmt::format("{:.1f} KiB", double(b) / 1024.0);
}

// Rows [first, first + count) of a device matrix (one routed expert of a stacked tensor).
QuantMatrix rows(const QuantMatrix& m, int64_t first, int64_t count) {
  QuantMatrix r = m;
  r.data = static_cast<const char*>(m.data) + uint64_t(first) * m.row_bytes;
  r.n_rows = count;
  return r;
}

// The weights in one device allocation. Binding runs twice through the same calls: once to measure
// (no device memory is touched and every pointer is null), then to upload into the allocation.
class Arena {
 public:
  void begin_upload(cuda::DeviceBuffer& buf) {
    buf_ = &buf;
    end_ = 0;
    quantized = absorption = vectors = 0;
    placed_.clear();
  }
  uint64_t bytes() const { return end_; }

  // A matrix as the file stores it; a column slice (a tensor-parallel shard of the input
  // dimension) is packed into whole rows of its width. A view bound twice (an output head tied to
  // the embedding) is uploaded once.
  QuantMatrix matrix(const ops::Weight& w, const std::string& name) {
    if (!w.data) fail("GPU model: tensor {} is not bound", name);
    if (!cuda::supported(w.type))
      fail("GPU model: {} is stored as {}, which has no CUDA matrix kernel", name, gguf::type_name(w.type));
    const uint64_t packed = gguf::row_bytes(w.type, uint64_t(w.n_cols));
    QuantMatrix q{w.type, w.n_cols, w.n_rows, packed, nullptr};
    const auto key = std::make_tuple(static_cast<const void*>(w.data), w.n_rows, w.n_cols);
    auto it = placed_.find(key);
    if (it != placed_.end()) {
      q.data = at(it->second);
      return q;
    }
    const uint64_t bytes = uint64_t(w.n_rows) * packed;
    const uint64_t off = place(bytes);
    placed_[key] = off;
    quantized += bytes;
    if (buf_ && bytes) {
      if (w.contiguous()) {
        buf_->upload(w.data, bytes, off);
      } else {
        std::vector<uint8_t> rows(bytes);
        for (int64_t r = 0; r < w.n_rows; ++r) std::memcpy(rows.data() + uint64_t(r) * packed, w.row(r), packed);
        buf_->upload(rows.data(), bytes, off);
      }
    }
    q.data = at(off);
    show_progress();
    return q;
  }

  const float* vec(const std::vector<float>& v) {
    const uint64_t bytes = v.size() * sizeof(float);
    const uint64_t off = place(bytes);
    vectors += bytes;
    if (buf_ && bytes) buf_->upload(v.data(), bytes, off);
    show_progress();
    return static_cast<const float*>(at(off));
  }

  // n absorption weights made by `fill`: bf16 (rounded to nearest even), or fp32 as made when
  // f32_absorption (precise mode); only computed when uploading.
  const void* absorb(uint64_t n, const std::function<void(float*)>& fill) {
    const uint64_t size = f32_absorption ? 4 : 2;
    const uint64_t off = place(n * size);
    absorption += n * size;
    if (buf_) {
      std::vector<float> f(n);
      fill(f.data());
      if (f32_absorption) {
        buf_->upload(f.data(), n * 4, off);
      } else {
        std::vector<uint16_t> b(n);
        for (uint64_t i = 0; i < n; ++i) b[i] = f32_to_bf16(f[i]);
        buf_->upload(b.data(), n * 2, off);
      }
    }
    show_progress();
    return at(off);
  }
  bool f32_absorption = false;
  bool absorb_in_place = true;     // bf16 / f16 W_UK / W_UV read as stored (GpuModelOptions::absorb_in_place)
  bool absorb_quantized = false;   // ... and quantized ones (GpuModelOptions::absorb_quantized_in_place)
  std::string progress_label;  // uploads print their progress under this label ("" : silent)

  uint64_t quantized = 0, absorption = 0, vectors = 0;

 private:
  uint64_t place(uint64_t bytes) {
    const uint64_t off = end_;
    end_ = align_up(end_ + bytes);
    return off;
  }
  // After each upload, while uploading more than a GiB: "uploading weights to GPU 0: 3.2 / 7.4 GiB"
  // on stderr, every 5%.
  void show_progress() {
    if (!buf_ || progress_label.empty()) return;
    const uint64_t total = buf_->bytes();
    if (total < (uint64_t(1) << 30)) return;
    const int pct = int(end_ * 100 / total);
    if (pct / 5 == shown_ / 5 && end_ < total) return;
    shown_ = pct;
    const double gib = double(uint64_t(1) << 30);
    std::fprintf(stderr, "\r%s: %.1f / %.1f GiB", progress_label.c_str(), double(std::min(end_, total)) / gib,
                 double(total) / gib);
    if (end_ >= total) std::fprintf(stderr, "\n");
  }
  void* at(uint64_t off) const { return buf_ ? buf_->as<char>() + off : nullptr; }

  cuda::DeviceBuffer* buf_ = nullptr;
  uint64_t end_ = 0;
  int shown_ = -5;
  std::map<std::tuple<const void*, int64_t, int64_t>, uint64_t> placed_;  // (data, rows, cols) -> offset
};

}  // namespace

// ---- the cache ----

uint64_t GpuCache::bytes_per_token(const kv::CacheShape& shape, int32_t kv_lora, cuda::KvDtype dtype,
                                   const std::vector<bool>& layer_keys) {
  const int32_t rope = shape.latent_dim - kv_lora;
  int64_t key_layers = 0;
  for (int32_t l = 0; l < shape.n_layers; ++l)
    key_layers += shape.idx_dim > 0 && (layer_keys.empty() || layer_keys[size_t(l)]);
  uint64_t b = uint64_t(shape.n_layers) * uint64_t(cuda::latent_row_bytes(dtype, kv_lora, rope));
  if (key_layers) b += uint64_t(key_layers) * uint64_t(cuda::index_key_row_bytes(dtype, shape.idx_dim));
  return b;
}

GpuCache::GpuCache(const kv::CacheShape& shape, int32_t kv_lora, cuda::KvDtype dtype, std::vector<bool> layer_keys)
    : BlockAllocator(kv::checked_cache_shape(shape).block_size, shape.n_blocks), shape_(shape), kv_lora_(kv_lora),
      dtype_(dtype) {
  if (kv_lora <= 0 || kv_lora > shape.latent_dim)
    fail("GPU KV cache: kv_lora {} does not fit the latent row of {}", kv_lora, shape.latent_dim);
  if (!layer_keys.empty() && layer_keys.size() != size_t(shape.n_layers))
    fail("GPU KV cache: {} layer flags for {} layers", layer_keys.size(), shape.n_layers);
  latent_row_ = cuda::latent_row_bytes(dtype, kv_lora, shape.latent_dim - kv_lora);
  if (uint64_t(n_slots()) >= 0xffffffffull)  // the attention kernels keep slot numbers in 32 bits
    fail("GPU KV cache: {} slots per layer, more than the attention kernels address (2^32 - 1)", n_slots());
  int32_t n_keys = 0;
  key_index_.assign(size_t(shape.n_layers), -1);
  for (int32_t l = 0; l < shape.n_layers; ++l)
    if (shape.idx_dim > 0 && (layer_keys.empty() || layer_keys[size_t(l)])) key_index_[size_t(l)] = n_keys++;
  if (n_keys) key_row_ = cuda::index_key_row_bytes(dtype, shape.idx_dim);
  latent_ = cuda::DeviceBuffer(size_t(shape.n_layers) * size_t(n_slots()) * size_t(latent_row_));
  latent_.zero();
  if (n_keys) {
    keys_ = cuda::DeviceBuffer(size_t(n_keys) * size_t(n_slots()) * size_t(key_row_));
    keys_.zero();
  }
}

// MoE batches of up to this many tokens run without a host synchronization (and so in a decode
// graph): one token per (token, expert) pair, more grouped by expert on the device.
constexpr int64_t kSyncFreeTokens = 64;
// The fewest tokens of an expert's group that a prefill sends to the grouped prefill kernel
// (GpuModelOptions::expert_tiles); smaller groups take the decode kernels, as matmul does.
constexpr int64_t kTileMinTokens = cuda::kDecodeMaxTokens + 1;
// A prefill's expert products that take cuBLAS run on their group's tokens rounded up to a multiple
// of this (the rows after a group are the next groups', written again after it): cuBLAS chooses its
// kernel per shape, and a shape's first call costs 0.1-1 ms of host time (its heuristics, kernels
// loaded), which groups of every size from 128 tokens up paid over and over (a 32K prompt in
// 4096-token forwards: 20-50 ms of host time per forward in the experts' loops, the GPU waiting;
// the same prompt again, its shapes seen, 44.0K -> 54.7K tokens/s; H100, docs/PERFORMANCE.md).
constexpr int64_t kBlasTokenQuantum = 64;

// ---- device state ----

struct GpuModel::Layer {
  const float* attn_norm = nullptr;  // [H]
  const float* ffn_norm = nullptr;   // [H]
  // MLA
  QuantMatrix q_a, q_b, q, kv_a_mqa, output;
  const float* q_a_norm = nullptr;   // [q_lora]
  const float* kv_a_norm = nullptr;  // [kv_lora]
  cuda::HeadBatchedGemm uk;          // bf16 (fp32 in precise mode) [n_head, kv_lora, nope]: W_UK per head
  cuda::HeadBatchedGemm uv;          // bf16 [n_head, v_head, kv_lora]: W_UV per head
  // indexer (full-indexer layers in sparse mode)
  bool indexer = false;
  QuantMatrix idx_q_b, idx_k, idx_proj;
  const float* idx_k_norm_w = nullptr;  // [idx_dim]
  const float* idx_k_norm_b = nullptr;  // [idx_dim]
  // FFN
  bool moe = false;
  QuantMatrix gate, up, down;                 // dense MLP
  QuantMatrix gate_inp;                       // {H, E} router
  const float* exp_probs_b = nullptr;         // [E]
  QuantMatrix gate_exps, up_exps, down_exps;  // experts stacked by rows
  bool shared = false;
  QuantMatrix gate_shexp, up_shexp, down_shexp;
};

struct GpuModel::Workspace {
  // activations, fp32
  float* h = nullptr;       // [T, H] residual stream
  float* x = nullptr;       // [T, H] normed input of the current block
  float* attn = nullptr;    // [T, H] block output (attention, then FFN)
  float* qr = nullptr;      // [T, q_lora]
  float* q = nullptr;       // [T, n_head, nope + rope]
  float* kv = nullptr;      // [T, kv_lora + rope]
  float* qfull = nullptr;   // [T, n_head, kv_lora + rope]: absorbed q_nope | q_pe
  float* olat = nullptr;    // [T, n_head, kv_lora]
  float* o = nullptr;       // [T, n_head * v_head]
  float* ik = nullptr;      // [T, idx_dim]
  float* iq = nullptr;      // [T, idx_heads, idx_dim]
  uint16_t* iq16 = nullptr;  // [T, idx_heads, idx_dim]: iq rounded for the mma indexer (IndexerArgs::q16)
  float* iw = nullptr;      // [T, idx_heads]
  float* scores = nullptr;  // [score_rows, max_ctx]
  float* g = nullptr;       // [T * ffn_width]
  float* u = nullptr;       // [T * ffn_width]
  float* ye = nullptr;      // [T * k, H] tokens gathered by expert
  float* oe = nullptr;      // [T * k, H] expert outputs, same order
  float* rlog = nullptr;    // [T, E] router logits
  float* rw = nullptr;      // [T, k] routing weights
  float* rows_h = nullptr;  // [R, H]
  float* rows_n = nullptr;  // [R, H]
  float* logits = nullptr;  // [R, V] (sharded: [R, the rank's V])
  float* gathered = nullptr;  // [n_ranks, R, the rank's V]: every rank's logits (sharded only)
  // int32
  int32_t* sel = nullptr;       // [T, top_k] positions chosen by the last full indexer layer
  int32_t* ids = nullptr;       // [T] token ids
  int32_t* seq = nullptr;       // [T] sequence of each token
  int32_t* nctx = nullptr;      // [T] positions visible to each token (pos + 1)
  int32_t* tables = nullptr;    // [n_seq, max_blocks]
  int32_t* out_rows = nullptr;  // [R]
  int32_t* rids = nullptr;      // [T, k] routed experts
  int32_t* lids = nullptr;      // [T, k] the same as this rank's experts, -1 for others' (sharded only)
  int32_t* counts = nullptr;    // [E]
  int32_t* offsets = nullptr;   // [E + 1]
  int32_t* perm = nullptr;      // [T * k]
  int32_t* inv = nullptr;       // [T * k]
  int32_t* active = nullptr;    // [E] experts with tokens (the grouped decode path)
  int32_t* n_active = nullptr;  // [1]
  cuda::ExpertTile* tiles = nullptr;  // [2 (T * k / 128 + E)] the prefill's expert tiles (cuda::expert_tiles)
  // int64
  int64_t* pos = nullptr;    // [T]
  int64_t* slots = nullptr;  // [T]
  void* group_ws = nullptr;  // moe_group scratch
  char* q8[2] = {nullptr, nullptr};  // int8 activations (GpuModel::quantized), q8_bytes each
  size_t q8_bytes = 0;
};

namespace {

struct WsDims {
  int64_t T = 0, R = 0, table_entries = 0, score_rows = 0, max_ctx = 0;
  bool sharded = false;
  int64_t gathered = 0;  // sharded: n_ranks * R * the rank's vocabulary; 0 otherwise
};

// Places every array of a forward's workspace; with base null it only measures. Returns the bytes.
uint64_t layout_workspace(const HParams& hp, bool sparse, const WsDims& d, char* base, GpuModel::Workspace* w) {
  uint64_t end = 0;
  auto take = [&](auto*& p, int64_t n) {
    using T = std::remove_pointer_t<std::remove_reference_t<decltype(p)>>;
    const uint64_t off = end;
    end = align_up(end + uint64_t(std::max<int64_t>(n, 0)) * sizeof(T));
    p = base ? reinterpret_cast<T*>(base + off) : nullptr;
  };
  GpuModel::Workspace scratch;
  GpuModel::Workspace& ws = w ? *w : scratch;
  const int64_t T = d.T, H = hp.n_embd, nh = hp.n_head, kvl = hp.kv_lora_rank, rope = hp.qk_rope;
  const int64_t qk = hp.qk_nope + rope, E = hp.n_expert, k = hp.n_expert_used;
  const int64_t ih = sparse ? hp.idx_heads : 0, id = sparse ? hp.idx_dim : 0;
  const int64_t ffn_width = std::max({int64_t(hp.n_ff), int64_t(hp.n_ff_exp) * hp.n_expert_shared,
                                      int64_t(hp.n_ff_exp) * k});
  take(ws.h, T * H);
  take(ws.x, T * H);
  take(ws.attn, T * H);
  take(ws.qr, T * hp.q_lora_rank);
  take(ws.q, T * nh * qk);
  take(ws.kv, T * (kvl + rope));
  take(ws.qfull, T * nh * (kvl + rope));
  take(ws.olat, T * nh * kvl);
  take(ws.o, T * nh * hp.v_head);
  take(ws.ik, T * id);
  take(ws.iq, T * ih * id);
  take(ws.iq16, T * ih * id);
  take(ws.iw, T * ih);
  take(ws.scores, sparse ? d.score_rows * d.max_ctx : 0);
  // (One token's routed pairs and, as pair k, its shared expert: ffn's one-token path.)
  // (The expert rows: kBlasTokenQuantum rows more, which a prefill's padded cuBLAS products may write.)
  const int64_t slots = E > 0 ? T * k + kBlasTokenQuantum : 0;
  take(ws.g, std::max({T * ffn_width, (k + 1) * hp.n_ff_exp, slots * hp.n_ff_exp}));
  take(ws.u, std::max({T * ffn_width, (k + 1) * hp.n_ff_exp, slots * hp.n_ff_exp}));
  take(ws.ye, slots * H);
  take(ws.oe, std::max({T * k, k + 1, slots}) * H);
  take(ws.rlog, T * E);
  take(ws.rw, T * k);
  take(ws.rows_h, d.R * H);
  take(ws.rows_n, d.R * H);
  take(ws.logits, d.R * int64_t(hp.n_vocab));
  take(ws.gathered, d.gathered);
  take(ws.sel, sparse ? T * int64_t(hp.idx_top_k) : 0);
  take(ws.ids, T);
  take(ws.seq, T);
  take(ws.nctx, T);
  take(ws.tables, d.table_entries);
  take(ws.out_rows, d.R);
  take(ws.rids, T * k);
  take(ws.lids, d.sharded ? T * k : 0);
  take(ws.counts, E);
  take(ws.offsets, E + 1);
  take(ws.perm, T * k);
  take(ws.inv, T * k);
  take(ws.active, E);
  take(ws.n_active, E > 0 ? 1 : 0);
  take(ws.tiles, E > 0 ? 2 * (T * k / 128 + E) : 0);  // (gate / up's, then down's)
  take(ws.pos, T);
  take(ws.slots, T);
  char* group = nullptr;
  take(group, E > 0 ? int64_t(cuda::moe_group_workspace_bytes(T * k, E)) : 0);
  ws.group_ws = group;
  // Int8 activations of the decode products: the widest input a product of <= kDecodeMaxTokens
  // rows reads (a layer's input, q_a's output, the heads' outputs, an FFN's hidden layer, one
  // token's expert pairs, the output head's rows).
  const int64_t Tq = std::min(T, cuda::kDecodeMaxTokens);
  const int64_t widest = std::max({H, int64_t(hp.q_lora_rank), nh * int64_t(hp.v_head), ffn_width});
  // (The expert pairs: k and the shared expert's.)
  // (Two levels: GpuModelOptions::q8_two_level.)
  // (And the grouped experts of a batch of up to kSyncFreeTokens: its rows, then its pairs.)
  const int64_t Tg = std::min(T, kSyncFreeTokens);
  ws.q8_bytes = std::max({cuda::q8_activation_bytes(Tq, widest, 2), cuda::q8_activation_bytes(k + 1, int64_t(hp.n_ff_exp), 2),
                          cuda::q8_activation_bytes(std::min(d.R, cuda::kDecodeMaxTokens), H, 2),
                          cuda::q8_activation_bytes(Tg, H, 2), cuda::q8_activation_bytes(Tg * k, int64_t(hp.n_ff_exp), 2)});
  take(ws.q8[0], int64_t(ws.q8_bytes));
  take(ws.q8[1], int64_t(ws.q8_bytes));
  return end;
}

int64_t score_rows_for(int64_t T, int64_t max_ctx) {
  return std::clamp<int64_t>(int64_t(kScoreBytes / (uint64_t(std::max<int64_t>(max_ctx, 1)) * 4)), 1, std::max<int64_t>(T, 1));
}

}  // namespace

// The context bound a decode graph is captured for: powers of two from 256 to 64K, then multiples
// of 16K (a 131,073-token context gets 147,456, not 262,144: the indexer's grid and the scores'
// stride follow the bound).
static int64_t context_bucket(int64_t ctx) {
  constexpr int64_t kPow2Up = int64_t(1) << 16, kStep = int64_t(1) << 14;
  if (ctx > kPow2Up) return (ctx + kStep - 1) / kStep * kStep;
  int64_t b = 256;
  while (b < ctx) b *= 2;
  return b;
}

struct GraphKey {
  int64_t T = 0, ctx = 0;
  const void* cache = nullptr;
  int64_t slots = 0;
  int format = 0;
  bool operator<(const GraphKey& o) const {
    return std::tie(T, ctx, cache, slots, format) < std::tie(o.T, o.ctx, o.cache, o.slots, o.format);
  }
};

struct GpuModel::State {
  gpu::OwnedStream stream;
  cuda::DeviceBuffer weights;
  std::vector<Layer> layers;  // [n_layer]
  QuantMatrix token_embd, output;
  const float* output_norm = nullptr;
  std::unique_ptr<cuda::DeviceRope> rope;
  cuda::Blas blas;
  cuda::AttentionWorkspace attn_ws;
  cuda::TopKWorkspace topk_ws;
  cuda::IndexerKernel idx_kernel[kFormats] = {cuda::IndexerKernel::Fma, cuda::IndexerKernel::Fma, cuda::IndexerKernel::Fma};
  cuda::AttentionKernel attn_kernel[kFormats] = {cuda::AttentionKernel::Fma, cuda::AttentionKernel::Fma,
                                                 cuda::AttentionKernel::Fma};
  std::string unusable[kFormats];  // why a cache format has no GPU path ("" when it has one)
  // the current forward
  cuda::DeviceBuffer ws_buf;
  WsDims ws_dims;
  Workspace ws;
  int64_t T = 0, max_ctx = 0;
  std::vector<RunSegment> index_segments;  // the indexer's calls (run_segments)
  int32_t max_blocks = 0, block_size = 0;
  bool selection_made = false;  // ws.sel holds this forward's selection (a full indexer layer ran)
  Decisions* record = nullptr;  // the current forward's choices go here when set
  std::vector<int32_t> host_counts;  // [E]
  std::vector<cuda::ExpertTile> host_tiles;  // the prefill's expert tiles before their upload to ws.tiles
  std::vector<int32_t> host_small;           // the prefill's experts of few tokens, before their upload to ws.active
  cuda::DeviceBuffer sample_buf;     // sample(): the rows' parameters, the ids, the sampler's scratch
  std::unique_ptr<gpu::StepTimer> timer;  // SPARSEMLA_STEP_PROFILE=1: device time by operation
  cuda::Q8Activations q8[2];              // the int8 activations of ws.q8 (GpuModel::quantized)
  const float* prequantized[2] = {nullptr, nullptr};  // q8[slot] holds this input, quantized by its writer (producer_q8)
  bool profiling = false;                 // this forward is a decode step, timed
  // Decode graphs by (batch size, context bucket, cache, cache format); an empty graph: not capturable.
  std::map<GraphKey, gpu::Graph> graphs;
  int64_t graph_captures = 0, graph_replays = 0;
  int64_t rope_in_wuk = 0;  // GpuModel::rope_in_wuk_launches
  int64_t index_queries_in_scores = 0;  // GpuModel::index_queries_in_scores_launches
  std::string graph_error;  // why the last capture that failed failed
  // The addresses of every buffer the graphs use that grows on demand. Buffers only grow, so the
  // graphs stay valid while these are unchanged; when an eager step moved one, they are dropped.
  std::array<const void*, 5> buffers() const {
    return {ws_buf.get(), attn_ws.partial.get(), topk_ws.candidates.get(), blas.scratch(), blas.weight_scratch()};
  }
  std::array<const void*, 5> graph_buffers = {};
  void eager_step_done() {
    if (buffers() != graph_buffers) {
      graphs.clear();
      graph_buffers = buffers();
    }
  }
  // Branches of the step (GpuModelOptions::side_stream): launches go to `side` while `on_side` is
  // set, so that they run beside the main stream's.
  gpu::SideStream side;
  bool on_side = false;
  cuda::Stream s() const { return on_side ? side.get() : stream.get(); }
};

namespace {

// The absorption weights' types the head-batched products read in place.
std::optional<cuda::HeadWeights> head_weights_form(gguf::GgmlType t) {
  switch (t) {
    case gguf::GgmlType::BF16: return cuda::HeadWeights::BF16;
    case gguf::GgmlType::F16: return cuda::HeadWeights::F16;
    default: return std::nullopt;
  }
}

// Binds every main layer's weights on the device (the next-n layers are not run).
void bind(Arena& a, const ModelWeights& w, const HParams& hp, bool sparse, GpuModel::State& st) {
  const int64_t nh = hp.n_head, nope = hp.qk_nope, vh = hp.v_head, kvl = hp.kv_lora_rank;
  st.token_embd = a.matrix(w.token_embd, "token_embd.weight");
  st.output = a.matrix(w.output, "output.weight");
  st.output_norm = a.vec(w.output_norm);
  st.layers.assign(hp.n_layer, GpuModel::Layer{});
  for (uint32_t il = 0; il < hp.n_layer; ++il) {
    const LayerWeights& L = w.layers[il];
    GpuModel::Layer& d = st.layers[il];
    auto n = [il](const char* s) { return fmt::format("blk.{}.{}", il, s); };
    d.attn_norm = a.vec(L.attn_norm);
    d.ffn_norm = a.vec(L.ffn_norm);
    const MlaWeights& m = L.mla;
    if (hp.q_lora_rank > 0) {
      d.q_a = a.matrix(m.q_a, n("attn_q_a.weight"));
      d.q_a_norm = a.vec(m.q_a_norm);
      d.q_b = a.matrix(m.q_b, n("attn_q_b.weight"));
    } else {
      d.q = a.matrix(m.q, n("attn_q.weight"));
    }
    d.kv_a_mqa = a.matrix(m.kv_a_mqa, n("attn_kv_a_mqa.weight"));
    d.kv_a_norm = a.vec(m.kv_a_norm);
    d.output = a.matrix(m.output, n("attn_output.weight"));
    // W_UK_h [kv_lora][nope] and W_UV_h [v_head][kv_lora] per head, as the CPU's mla_attend uses them:
    // attn_k_b / attn_v_b read in place where they are bf16 or f16, or (absorb_quantized) a type of
    // the int8 head product (Q8_0, the K-quants, IQ4_XS, IQ2_XXS: cuda::head_q8_supported), in fast
    // mode, else a bf16 copy (fp32 in precise mode; also for the older attn_kv_b, whose rows
    // interleave the two). Q8_0 read in place with fp32 activations measured slower than its bf16
    // copy (H200, GLM-5 W_UK: 10.2 against 7.1 us; session 27); the int8 head product is not yet
    // measured.
    const auto in_place = [&](const ops::Weight& wt, int64_t rows, int64_t cols, const std::string& name,
                              cuda::HeadBatchedGemm& g) {
      std::optional<cuda::HeadWeights> form = head_weights_form(wt.type);
      // (The arena places every matrix 16-byte aligned.)
      if (!form && a.absorb_quantized && cuda::head_q8_supported(wt.type, int(rows), int(cols), nullptr))
        form = cuda::HeadWeights::Quant;
      if (!a.absorb_in_place || a.f32_absorption || m.legacy_kv_b || !form) return false;
      if (wt.n_rows != nh * rows || wt.n_cols != cols || cols % 8 != 0) return false;
      g = {a.matrix(wt, name).data, int(nh), int(rows), int(cols), false, *form, wt.type};
      return true;
    };
    if (!in_place(m.k_b, kvl, nope, n("attn_k_b.weight"), d.uk))
      d.uk = {a.absorb(uint64_t(nh * kvl * nope),
                   [&](float* out) {
                     if (!m.legacy_kv_b) {
                       for (int64_t r = 0; r < nh * kvl; ++r) ops::dequantize_row(m.k_b, r, out + r * nope);
                       return;
                     }
                     std::vector<float> row(static_cast<size_t>(kvl));
                     for (int64_t h = 0; h < nh; ++h)
                       for (int64_t i = 0; i < nope; ++i) {
                         ops::dequantize_row(m.kv_b, h * (nope + vh) + i, row.data());
                         for (int64_t c = 0; c < kvl; ++c) out[(h * kvl + c) * nope + i] = row[size_t(c)];
                       }
                   }),
            int(nh), int(kvl), int(nope), a.f32_absorption};
    if (!in_place(m.v_b, vh, kvl, n("attn_v_b.weight"), d.uv))
      d.uv = {a.absorb(uint64_t(nh * vh * kvl),
                   [&](float* out) {
                     for (int64_t h = 0; h < nh; ++h)
                       for (int64_t j = 0; j < vh; ++j) {
                         const int64_t r = m.legacy_kv_b ? h * (nope + vh) + nope + j : h * vh + j;
                         ops::dequantize_row(m.legacy_kv_b ? m.kv_b : m.v_b, r, out + (h * vh + j) * kvl);
                       }
                   }),
            int(nh), int(vh), int(kvl), a.f32_absorption};
    if (sparse && L.indexer.present) {
      d.indexer = true;
      d.idx_q_b = a.matrix(L.indexer.q_b, n("indexer.attn_q_b.weight"));
      d.idx_k = a.matrix(L.indexer.k, n("indexer.attn_k.weight"));
      d.idx_proj = a.matrix(L.indexer.proj, n("indexer.proj.weight"));
      d.idx_k_norm_w = a.vec(L.indexer.k_norm_w);
      d.idx_k_norm_b = a.vec(L.indexer.k_norm_b);
    }
    const FfnWeights& f = L.ffn;
    d.moe = f.moe;
    if (!f.moe) {
      d.gate = a.matrix(f.gate, n("ffn_gate.weight"));
      d.up = a.matrix(f.up, n("ffn_up.weight"));
      d.down = a.matrix(f.down, n("ffn_down.weight"));
    } else {
      d.gate_inp = a.matrix(f.gate_inp, n("ffn_gate_inp.weight"));
      d.exp_probs_b = a.vec(f.exp_probs_b);
      d.gate_exps = a.matrix(f.gate_exps, n("ffn_gate_exps.weight"));
      d.up_exps = a.matrix(f.up_exps, n("ffn_up_exps.weight"));
      d.down_exps = a.matrix(f.down_exps, n("ffn_down_exps.weight"));
      d.shared = f.gate_shexp.data != nullptr;
      if (d.shared) {
        d.gate_shexp = a.matrix(f.gate_shexp, n("ffn_gate_shexp.weight"));
        d.up_shexp = a.matrix(f.up_shexp, n("ffn_up_shexp.weight"));
        d.down_shexp = a.matrix(f.down_shexp, n("ffn_down_shexp.weight"));
      }
    }
  }
}

}  // namespace

GpuModel::GpuModel() = default;
GpuModel::~GpuModel() {
  if (st_ && st_->timer) std::fprintf(stderr, "%s: %s", mem_.device.c_str(), st_->timer->report().c_str());
}

void GpuModel::mark(const char* label) {
  if (st_->timer && st_->profiling) st_->timer->mark(label);
}

bool GpuModel::side_stream_on() const { return opts_.side_stream && !(st_->timer && st_->profiling); }

std::unique_ptr<GpuModel> GpuModel::load(const Model& cpu, const GpuModelOptions& opts) {
  return load_impl(cpu, nullptr, opts);
}

std::unique_ptr<GpuModel> GpuModel::load_shard(const Model& cpu, const GpuShard& shard, const GpuModelOptions& opts) {
  if (!shard.weights) fail("GPU model: a shard without weights");
  if (shard.n_ranks < 1 || shard.rank < 0 || shard.rank >= shard.n_ranks)
    fail("GPU model: rank {} of {} ranks", shard.rank, shard.n_ranks);
  const HParams& hp = cpu.hparams();
  if (shard.n_head == 0 || shard.n_head > hp.n_head)
    fail("GPU model: a shard of {} heads of {}", shard.n_head, hp.n_head);
  if (shard.vocab_count <= 0 || shard.vocab_count * shard.n_ranks != int64_t(hp.n_vocab))
    fail("GPU model: a vocabulary slice of {} rows for {} ranks and {} tokens", shard.vocab_count, shard.n_ranks,
         hp.n_vocab);
  return load_impl(cpu, &shard, opts);
}

void GpuModel::set_collectives(GpuCollectives c) { coll_ = std::move(c); }

cuda::Stream GpuModel::stream() const { return st_->s(); }
int64_t GpuModel::graph_captures() const { return st_->graph_captures; }
int64_t GpuModel::graph_replays() const { return st_->graph_replays; }
int64_t GpuModel::rope_in_wuk_launches() const { return st_->rope_in_wuk; }
int64_t GpuModel::index_queries_in_scores_launches() const { return st_->index_queries_in_scores; }
const std::string& GpuModel::graph_error() const { return st_->graph_error; }

void GpuModel::reduce(float* data, int64_t n) {
  if (!sharded()) return;
  coll_.all_reduce_sum(data, n);
}

std::unique_ptr<GpuModel> GpuModel::load_impl(const Model& cpu, const GpuShard* shard, const GpuModelOptions& opts) {
  std::string why;
  const std::vector<ops::DeviceInfo> devs = ops::list_devices(&why);
  if (!ops::built_with_cuda()) fail("--device cuda: this build has no CUDA");
  if (devs.empty()) fail("--device cuda: no CUDA device ({})", why);
  if (opts.device < 0 || size_t(opts.device) >= devs.size())
    fail("--device cuda: device {} does not exist ({} found)", opts.device, devs.size());
  const ops::DeviceInfo& dev = devs[size_t(opts.device)];
  gpu::set_device(dev.index);
  gpu::keep_stream_ordered_memory(kReserve / 2);  // (within what the memory checks leave)

  std::unique_ptr<GpuModel> g(new GpuModel());
  g->device_ = dev.index;
  g->hp_ = cpu.hparams();
  g->ahp_ = cpu.hparams();
  if (shard) {
    g->shard_ = *shard;
    g->ahp_.n_head = shard->n_head;
  }
  g->spec_ = &cpu.spec();
  g->attention_ = cpu.attention();
  g->opts_ = opts;
  // SPARSEMLA_CUDA_GRAPHS=0 turns the decode graphs off without a rebuild (comparisons, debugging).
  if (env_off("SPARSEMLA_CUDA_GRAPHS")) g->opts_.cuda_graphs = false;
  if (env_off("SPARSEMLA_SIDE_STREAM")) g->opts_.side_stream = false;
  if (const int q = env_switch("SPARSEMLA_INDEX_QB_SIDE"); q >= 0) g->opts_.index_qb_side = q == 1;
  if (const int q = env_switch("SPARSEMLA_ROPE_IN_WUK"); q >= 0) g->opts_.rope_in_wuk = q == 1;
  if (const int q = env_switch("SPARSEMLA_INDEX_QUERIES_IN_SCORES"); q >= 0) g->opts_.index_queries_in_scores = q == 1;
  if (env_off("SPARSEMLA_Q8_ACTIVATIONS")) g->opts_.q8_two_level = false;
  if (env_off("SPARSEMLA_ABSORB_IN_PLACE")) g->opts_.absorb_in_place = false;
  if (env_off("SPARSEMLA_SHORT_CONTEXT_DENSE")) g->opts_.short_context_dense = false;
  if (const int q = env_switch("SPARSEMLA_ABSORB_QUANT"); q >= 0) g->opts_.absorb_quantized_in_place = q == 1;
  if (const int q = env_switch("SPARSEMLA_EXPERT_TILES"); q >= 0) g->opts_.expert_tiles = q == 1;
  if (const char* m = std::getenv("SPARSEMLA_EXPERT_TILES_MAX"); m && *m) g->opts_.expert_tiles_max = std::atoll(m);

  // SPARSEMLA_STEP_PROFILE=1: events between the operations of every decode step (graphs off), and the
  // device time by operation printed to stderr when the model goes away. Each step waits behind a
  // 20 ms hold kernel (SPARSEMLA_STEP_PROFILE_HOLD_US) while the host enqueues it, so the times are
  // the device's work without the host's launch gaps.
  const char* profile = std::getenv("SPARSEMLA_STEP_PROFILE");
  const bool step_profile = profile && std::string(profile) == "1";
  if (step_profile) g->opts_.cuda_graphs = false;
  const HParams& hp = g->hp_;
  const HParams& ahp = g->ahp_;
  const ModelWeights& weights = shard ? *shard->weights : cpu.weights();
  const bool sparse = g->attention_ == AttentionMode::Sparse && hp.has_indexer();

  // Kernels for every cache format; the options' one must have a GPU path.
  cuda::IndexerKernel idx_kernel[kFormats] = {};
  cuda::AttentionKernel attn_kernel[kFormats] = {};
  std::string unusable[kFormats];
  auto problem = [&](int f) {
    ops::AttentionProblem p = ops::attention_problem(ahp, &dev, sparse, format_of(f) == cuda::KvDtype::FP8);
    p.f32_cache = format_of(f) == cuda::KvDtype::F32;
    return p;
  };
  for (int f = 0; f < kFormats; ++f) {
    const ops::AttentionProblem p = problem(f);
    g->plans_[f] = ops::select_backends(p);
    if (!cuda::attention_kernel_named(g->plans_[f].get("attention").chosen, &attn_kernel[f]))
      unusable[f] = "no GPU attention kernel";
    if (sparse) {
      const std::string idx = g->plans_[f].get("indexer").chosen;
      if (idx == "cuda-mma") idx_kernel[f] = cuda::IndexerKernel::Mma;
      else if (idx == "cuda-fma") idx_kernel[f] = cuda::IndexerKernel::Fma;
      else unusable[f] = "no GPU indexer kernel";
      if (g->plans_[f].get("top-k").chosen != "cuda-radix") unusable[f] = "no GPU top-k kernel";
    }
    if (opts.precise) {  // the fp32 FMA kernels where they take the shape
      for (const ops::Candidate& c : g->plans_[f].get("attention").candidates)
        if (c.name == "cuda-fma" && c.supported) attn_kernel[f] = cuda::AttentionKernel::Fma;
      if (sparse)
        for (const ops::Candidate& c : g->plans_[f].get("indexer").candidates)
          if (c.name == "cuda-fma" && c.supported) idx_kernel[f] = cuda::IndexerKernel::Fma;
    }
    if (!unusable[f].empty()) unusable[f] += ":\n" + ops::format_plan(p, g->plans_[f]);
  }
  const int fi = format_index(opts.kv_cache);
  if (opts.verbose) {
    std::fprintf(stderr, "%s", ops::format_plan(problem(fi), g->plans_[fi]).c_str());
    if (opts.precise) std::fprintf(stderr, "  precise mode: fp32 matrix products and the fp32 FMA attention / indexer kernels\n");
  }
  if (!unusable[fi].empty()) fail("--device cuda with a {} cache: {}", cuda::kv_dtype_name(opts.kv_cache), unusable[fi]);

  // Measure, check against free memory, then upload.
  Arena measure;
  measure.f32_absorption = opts.precise;
  measure.absorb_in_place = g->opts_.absorb_in_place;
  measure.absorb_quantized = g->opts_.absorb_quantized_in_place;
  auto st = std::make_unique<State>();
  bind(measure, weights, ahp, sparse, *st);
  uint64_t free_b = 0, total_b = 0;
  gpu::memory_info(&free_b, &total_b);
  g->mem_.device = fmt::format("GPU {} ({})", dev.index, dev.name);
  if (shard) g->mem_.device += fmt::format(", rank {} of {}", shard->rank, shard->n_ranks);
  g->mem_.total = total_b;
  g->mem_.quantized = measure.quantized;
  g->mem_.absorption = measure.absorption;
  g->mem_.vectors = measure.vectors;
  g->mem_.workspace_tokens = std::max<int64_t>(1, opts.max_batch_tokens);
  {
    WsDims d;
    d.T = g->mem_.workspace_tokens;
    d.R = opts.max_logit_rows > 0 ? std::min(d.T, opts.max_logit_rows) : d.T;
    d.max_ctx = std::max<int64_t>(1, opts.min_cache_tokens);
    d.table_entries = d.T * ((d.max_ctx + 15) / 16);
    d.score_rows = score_rows_for(d.T, d.max_ctx);
    d.sharded = shard != nullptr;
    if (shard) d.gathered = d.R * hp.n_vocab;
    g->mem_.workspace_estimate = layout_workspace(ahp, sparse, d, nullptr, nullptr);
  }
  const uint64_t min_cache = uint64_t(std::max<int64_t>(0, opts.min_cache_tokens)) * g->cache_bytes_per_token();
  const uint64_t need = measure.bytes() + min_cache + g->mem_.workspace_estimate + kReserve;
  if (need > free_b)
    fail("not enough memory on {}: the model needs {} of weights ({} of matrices as stored, {} of W_UK/W_UV "
         "copies (bf16, fp32 in precise mode; none for bf16 / f16 ones), {} of fp32 vectors) + {} for a KV "
         "cache of {} tokens ({}, {} per token) + {} of workspace for {}-token forwards + {} of reserve = {}, "
         "and {} of its {} are free",
         g->mem_.device, bytes_str(measure.bytes()), bytes_str(measure.quantized), bytes_str(measure.absorption),
         bytes_str(measure.vectors), bytes_str(min_cache), opts.min_cache_tokens, cuda::kv_dtype_name(opts.kv_cache),
         bytes_str(g->cache_bytes_per_token()), bytes_str(g->mem_.workspace_estimate), g->mem_.workspace_tokens,
         bytes_str(kReserve), bytes_str(need), bytes_str(free_b), bytes_str(total_b));

  st->weights = cuda::DeviceBuffer(measure.bytes());
  Arena up;
  up.f32_absorption = opts.precise;
  up.absorb_in_place = g->opts_.absorb_in_place;
  up.absorb_quantized = g->opts_.absorb_quantized_in_place;
  up.begin_upload(st->weights);
  up.progress_label = fmt::format("uploading weights to {}", g->mem_.device);
  bind(up, weights, ahp, sparse, *st);
  st->rope = std::make_unique<cuda::DeviceRope>(cpu.rope());
  if (step_profile) {
    const char* hold = std::getenv("SPARSEMLA_STEP_PROFILE_HOLD_US");
    st->timer = std::make_unique<gpu::StepTimer>(st->s(), hold ? std::atoi(hold) : 20000);
  }
  for (int f = 0; f < kFormats; ++f) {
    st->idx_kernel[f] = idx_kernel[f];
    st->attn_kernel[f] = attn_kernel[f];
    st->unusable[f] = unusable[f];
  }
  g->st_ = std::move(st);
  if (!opts.precise) cuda::prefill_blas_warm_up(g->st_->s());  // (the precise mode never takes cuBLAS)
  gpu::memory_info(&free_b, &total_b);
  g->mem_.free_after_load = free_b;
  return g;
}

kv::CacheShape GpuModel::cache_shape(int32_t n_blocks, int32_t block_size) const {
  return cache_shape_for(hp_, n_blocks, block_size);
}

namespace {

// Layers that store index keys: those that run their own indexer in sparse mode.
std::vector<bool> key_layers(const HParams& hp, AttentionMode mode) {
  std::vector<bool> keys(hp.n_layer, false);
  if (mode != AttentionMode::Sparse || !hp.has_indexer()) return keys;
  for (uint32_t l = 0; l < hp.n_layer; ++l) keys[l] = l < hp.idx_full.size() ? bool(hp.idx_full[l]) : true;
  return keys;
}

}  // namespace

uint64_t GpuModel::cache_bytes_per_token() const {
  return GpuCache::bytes_per_token(cache_shape(1, 1), int32_t(hp_.kv_lora_rank), opts_.kv_cache,
                                   key_layers(hp_, attention_));
}

int64_t GpuModel::cache_capacity_tokens() const {
  uint64_t free_b = 0, total_b = 0;
  gpu::memory_info(&free_b, &total_b);
  const uint64_t held = mem_.workspace_estimate + kReserve;
  return free_b > held ? int64_t((free_b - held) / cache_bytes_per_token()) : 0;
}

std::string GpuModel::memory_report() const {
  const uint64_t per_token = cache_bytes_per_token();
  return fmt::format(
      "{}: weights {} ({} matrices as stored, {} W_UK/W_UV copies, {} fp32 vectors); KV cache {} per token ({}, {} "
      "layers), room for {} tokens in the free memory; workspace {} for {}-token forwards; {} of {} free",
      mem_.device, bytes_str(mem_.weights()), bytes_str(mem_.quantized), bytes_str(mem_.absorption),
      bytes_str(mem_.vectors), bytes_str(per_token), cuda::kv_dtype_name(opts_.kv_cache), hp_.n_layer,
      cache_capacity_tokens(), bytes_str(mem_.workspace_estimate), mem_.workspace_tokens,
      bytes_str([] {
        uint64_t f = 0, t = 0;
        gpu::memory_info(&f, &t);
        return f;
      }()),
      bytes_str(mem_.total));
}

GpuCache GpuModel::make_cache(int32_t n_blocks, int32_t block_size) const {
  gpu::set_device(device_);
  const kv::CacheShape shape = kv::checked_cache_shape(cache_shape(n_blocks, block_size));
  const int64_t tokens = int64_t(n_blocks) * block_size;
  const uint64_t bytes = uint64_t(tokens) * cache_bytes_per_token();
  uint64_t free_b = 0, total_b = 0;
  gpu::memory_info(&free_b, &total_b);
  if (bytes + kReserve > free_b)
    fail("KV cache of {} tokens ({} blocks of {}) needs {} on {} ({}, {} per token), but only {} of {} are free "
         "beside the weights ({}); at most about {} tokens fit",
         tokens, n_blocks, block_size, bytes_str(bytes), mem_.device, cuda::kv_dtype_name(opts_.kv_cache),
         bytes_str(cache_bytes_per_token()), bytes_str(free_b), bytes_str(total_b), bytes_str(mem_.weights()),
         free_b > kReserve ? (free_b - kReserve) / cache_bytes_per_token() : 0);
  return GpuCache(shape, int32_t(hp_.kv_lora_rank), opts_.kv_cache, key_layers(hp_, attention_));
}

// ---- forward ----

FlatBatch GpuModel::check_batch(const std::vector<SeqInput>& batch, const kv::BlockAllocator& cache, uint32_t n_vocab) {
  FlatBatch b = flatten_batch(batch, cache, n_vocab);
  const int32_t bs = cache.block_size();
  for (size_t s = 0; s < batch.size(); ++s) {
    const std::vector<int32_t>& t = *batch[s].block_table;
    const int64_t used = (batch[s].pos0 + int64_t(batch[s].tokens.size()) + bs - 1) / bs;
    if (int64_t(t.size()) < used)
      fail("forward: sequence {} reaches block {}, its block table has {}", s, used - 1, t.size());
    for (int64_t i = 0; i < used; ++i)
      if (t[size_t(i)] < 0 || t[size_t(i)] >= cache.n_blocks())
        fail("forward: sequence {} maps block {} to {}, outside the cache's {} blocks", s, i, t[size_t(i)],
             cache.n_blocks());
  }
  return b;
}

void GpuModel::forward(const std::vector<SeqInput>& batch, GpuCache& cache, std::vector<float>& logits,
                       Decisions* record) {
  const int64_t R = enqueue(batch, cache, record);
  if (R == 0) return;
  const int64_t V = hp_.n_vocab;
  const size_t base = logits.size();
  logits.resize(base + size_t(R * V));
  gpu::download(logits.data() + base, logit_rows(R), size_t(R * V) * sizeof(float), st_->s());
}

// The enqueued forward's logits as rows of [n_vocab]: ws.logits, where a sharded model first puts
// every rank's gathered slice ([N, R, Vr] in ws.gathered) in its columns.   [R, V]
const float* GpuModel::logit_rows(int64_t R) {
  Workspace& w = st_->ws;
  if (sharded()) {
    const int64_t V = hp_.n_vocab, Vr = shard_.vocab_count;
    for (int64_t k = 0; k < shard_.n_ranks; ++k)
      gpu::copy_columns(w.gathered + k * R * Vr, Vr, w.logits + k * Vr, V, Vr, R, st_->s());
  }
  return w.logits;
}

void GpuModel::sample(const std::vector<SeqInput>& batch, GpuCache& cache, const std::vector<cuda::RowSampling>& params,
                      std::vector<int32_t>& ids) {
  const HParams& hp = hp_;
  int64_t rows = 0;
  for (const SeqInput& in : batch) rows += in.all_logits ? int64_t(in.tokens.size()) : 1;
  if (int64_t(params.size()) != rows)
    fail("GPU sample: {} sampling rows for a batch that returns {} logits rows", params.size(), rows);
  const int64_t R = enqueue(batch, cache, nullptr);
  if (R == 0) return;
  State& st = *st_;
  const cuda::Stream s = st.s();
  const int64_t V = hp.n_vocab;
  const float* rows_of_logits = logit_rows(R);
  const uint64_t need = uint64_t(R) * sizeof(cuda::RowSampling) + kAlign + uint64_t(R) * 4 + kAlign +
                        cuda::sampling_workspace_bytes(R, V);
  if (need > st.sample_buf.bytes()) st.sample_buf = cuda::DeviceBuffer(need);
  char* base = st.sample_buf.as<char>();
  auto* dparams = reinterpret_cast<cuda::RowSampling*>(base);
  auto* dids = reinterpret_cast<int32_t*>(base + align_up(uint64_t(R) * sizeof(cuda::RowSampling)));
  void* scratch = base + align_up(uint64_t(R) * sizeof(cuda::RowSampling)) + align_up(uint64_t(R) * 4);
  gpu::upload_async(dparams, params.data(), size_t(R) * sizeof(cuda::RowSampling), s);
  cuda::sample(rows_of_logits, R, V, dparams, scratch, dids, s);
  const size_t at = ids.size();
  ids.resize(at + size_t(R));
  gpu::download(ids.data() + at, dids, size_t(R) * 4, s);
}

// Checks the batch, lays out and fills the workspace, and enqueues the forward (replaying a decode
// graph where one fits). Returns the logits rows, left in ws.logits ([R, V]; sharded: every rank's
// slice in ws.gathered, [N, R, Vr]).
int64_t GpuModel::enqueue(const std::vector<SeqInput>& batch, GpuCache& cache, Decisions* record) {
  gpu::set_device(device_);  // the calling thread may not be the one that loaded the model
  State& st = *st_;
  const HParams& hp = hp_;
  const kv::CacheShape& cs = cache.shape();
  if (cs.n_layers != int32_t(hp.n_layer) || cs.latent_dim != int32_t(hp.kv_lora_rank + hp.qk_rope) ||
      cache.kv_lora() != int32_t(hp.kv_lora_rank))
    fail("GPU forward: the cache ({} layers, latent {}) was not made for this model ({} layers, latent {})",
         cs.n_layers, cs.latent_dim, hp.n_layer, hp.kv_lora_rank + hp.qk_rope);
  const int fi = format_index(cache.dtype());
  if (!st.unusable[fi].empty()) fail("GPU forward with a {} cache: {}", cuda::kv_dtype_name(cache.dtype()), st.unusable[fi]);
  const FlatBatch b = check_batch(batch, cache, hp.n_vocab);
  const int64_t T = int64_t(b.toks.size()), R = int64_t(b.out_rows.size());
  if (T == 0) return 0;
  const bool sparse = attention_ == AttentionMode::Sparse && hp.has_indexer();
  if (sharded() && (!coll_.all_reduce_sum || !coll_.all_gather))
    fail("GPU forward: rank {} has no collectives", shard_.rank);

  // A decode step (one new token per sequence, the MoE without host synchronization, nothing
  // recorded) replays a CUDA graph captured for its batch size and context bucket: the kernels are
  // launched with the bucket as their context bound (each token still sees only its own positions).
  bool graph = opts_.cuda_graphs && !record && (!sharded() || coll_.capturable) && T <= kSyncFreeTokens;
  bool decode = true;
  for (const SeqInput& in : batch) decode = decode && in.tokens.size() == 1;
  graph = graph && decode;
  st.profiling = decode;  // the step profile covers decode steps only

  // Metadata of the batch, on the host first.
  const int32_t bs = cache.block_size();
  const int64_t n_seq = int64_t(batch.size());
  int64_t max_ctx = 1;
  for (const TokenRef& tok : b.toks) {
    if (tok.pos + 1 > INT32_MAX) fail("forward: position {} is too large", tok.pos);
    max_ctx = std::max(max_ctx, tok.pos + 1);
  }
  if (graph) max_ctx = context_bucket(max_ctx);
  const int32_t max_blocks = int32_t((max_ctx + bs - 1) / bs);
  std::vector<int32_t> tables(size_t(n_seq * max_blocks), 0);
  for (int64_t s = 0; s < n_seq; ++s) {
    const SeqInput& in = batch[size_t(s)];
    const int64_t used = (in.pos0 + int64_t(in.tokens.size()) + bs - 1) / bs;
    std::copy_n(in.block_table->begin(), used, tables.begin() + s * max_blocks);
  }
  std::vector<int32_t> ids(b.ids), seq(static_cast<size_t>(T)), nctx(static_cast<size_t>(T)),
      out_rows(static_cast<size_t>(R));
  std::vector<int64_t> pos(static_cast<size_t>(T)), slots(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) {
    const TokenRef& tok = b.toks[size_t(t)];
    seq[size_t(t)] = tok.seq;
    pos[size_t(t)] = tok.pos;
    slots[size_t(t)] = tok.slot;
    nctx[size_t(t)] = int32_t(tok.pos + 1);
  }
  for (int64_t r = 0; r < R; ++r) out_rows[size_t(r)] = int32_t(b.out_rows[size_t(r)]);
  if (sharded())  // this rank's rows of the embedding; -1 (a zero row) for the others'
    for (int32_t& id : ids)
      id = id >= shard_.vocab_first && id < shard_.vocab_first + shard_.vocab_count ? int32_t(id - shard_.vocab_first)
                                                                                    : -1;

  // The workspace, grown when this forward needs more than the last (which ends every graph: they
  // hold its addresses).
  WsDims d;
  d.T = T;
  d.R = R;
  d.table_entries = n_seq * max_blocks;
  d.max_ctx = max_ctx;
  d.score_rows = sparse ? score_rows_for(T, max_ctx) : 0;
  d.sharded = sharded();
  if (d.sharded) d.gathered = int64_t(shard_.n_ranks) * R * shard_.vocab_count;
  const uint64_t need = layout_workspace(ahp_, sparse, d, nullptr, nullptr);
  if (need > st.ws_buf.bytes()) st.ws_buf = cuda::DeviceBuffer(need + need / 4);
  layout_workspace(ahp_, sparse, d, st.ws_buf.as<char>(), &st.ws);
  st.ws_dims = d;
  st.T = T;
  st.max_ctx = max_ctx;
  st.index_segments = run_segments(batch, cuda::kIndexerTokensMinRun);
  st.max_blocks = max_blocks;
  st.block_size = bs;
  st.record = record;
  if (record) record->layers.assign(hp.n_layer, LayerDecisions{});
  Workspace& w = st.ws;
  const cuda::Stream s = st.s();
  gpu::upload_async(w.ids, ids.data(), size_t(T) * 4, s);
  gpu::upload_async(w.seq, seq.data(), size_t(T) * 4, s);
  gpu::upload_async(w.nctx, nctx.data(), size_t(T) * 4, s);
  gpu::upload_async(w.tables, tables.data(), tables.size() * 4, s);
  gpu::upload_async(w.out_rows, out_rows.data(), size_t(R) * 4, s);
  gpu::upload_async(w.pos, pos.data(), size_t(T) * 8, s);
  gpu::upload_async(w.slots, slots.data(), size_t(T) * 8, s);

  if (!graph) {
    run_step(cache);
    if (st.timer && st.profiling) st.timer->collect();
    st.eager_step_done();
  } else {
    const GraphKey key{T, max_ctx, cache.latent(0), cache.n_slots(), fi};
    st.eager_step_done();  // the workspace may have moved above
    auto it = st.graphs.find(key);
    if (it != st.graphs.end() && !it->second.empty()) {
      it->second.launch(s);
      ++st.graph_replays;
    } else {
      // First time at this key: run it eagerly (which also makes every lazily grown workspace its
      // final size), then capture the same work for the next steps. A step that cannot be captured
      // runs eagerly from then on (an empty graph marks it).
      run_step(cache);
      st.eager_step_done();
      it = st.graphs.find(key);
      if (it == st.graphs.end()) {
        gpu::Graph g;
        try {
          gpu::Graph::begin_capture(s);
          run_step(cache);
          g = gpu::Graph::end_capture(s);
          ++st.graph_captures;
        } catch (const Error& e) {
          gpu::Graph::abandon_capture(s);
          st.graph_error = fmt::format("batch {} at context {}: {}", T, max_ctx, e.what());
          if (opts_.verbose) std::fprintf(stderr, "CUDA graph for batch %lld at context %lld not captured: %s\n",
                                          static_cast<long long>(T), static_cast<long long>(max_ctx), e.what());
        }
        st.graphs.emplace(key, std::move(g));
      }
    }
  }
  return R;
}

// The device work of one forward over the workspace as forward() laid it out and filled it: every
// layer, then the output head on the requested rows into ws.logits (sharded: every rank's slice
// gathered into ws.gathered). Enqueues only (a CUDA graph captures it), except where the MoE reads
// its expert counts back or choices are recorded.
void GpuModel::run_step(GpuCache& cache) {
  State& st = *st_;
  const HParams& hp = hp_;
  Workspace& w = st.ws;
  const cuda::Stream s = st.s();
  const int64_t H = hp.n_embd, T = st.T, R = st.ws_dims.R;
  st.selection_made = false;
  mark("begin");
  cuda::dequantize_rows(st.token_embd, w.ids, T, w.h, s);
  reduce(w.h, T * H);
  // Each norm writing x quantizes it for its readers as it writes it where it can (producer_q8).
  int lv = 0;
  cuda::Q8Activations* nq = producer_q8(w.x, T, H, 0, attention_readers(st.layers[0]), &lv);
  cuda::rms_norm(w.h, H, st.layers[0].attn_norm, T, H, hp.rms_eps, w.x, H, s, nq, lv);
  mark("embedding");
  for (uint32_t il = 0; il < hp.n_layer; ++il) {
    const Layer& L = st.layers[il];
    attention_layer(L, int32_t(il), cache);
    reduce(w.attn, T * H);
    nq = producer_q8(w.x, T, H, 0, ffn_readers(L), &lv);
    cuda::add_rms_norm(w.h, w.attn, L.ffn_norm, T, H, hp.rms_eps, w.x, s, nq, lv);
    mark("attention: output all-reduce, norm");
    ffn(L, int32_t(il));
    reduce(w.attn, T * H);
    if (il + 1 < hp.n_layer) {
      const Layer& next = st.layers[il + 1];
      nq = producer_q8(w.x, T, H, 0, attention_readers(next), &lv);
      cuda::add_rms_norm(w.h, w.attn, next.attn_norm, T, H, hp.rms_eps, w.x, s, nq, lv);
    } else {
      cuda::add(w.h, w.attn, T * H, s);
    }
    mark("ffn: all-reduce, residual, norm");
  }
  // The output head, on the requested rows only.
  if (R == 0) return;
  gpu::gather_rows(w.h, H, w.out_rows, 1, R, w.rows_h, s);
  nq = producer_q8(w.rows_n, R, H, 0, {&st.output}, &lv);
  cuda::rms_norm(w.rows_h, H, st.output_norm, R, H, hp.rms_eps, w.rows_n, H, s, nq, lv);
  product(st.output, w.rows_n, R, w.logits, quantized(w.rows_n, R, H, 0, {&st.output}));
  if (sharded()) coll_.all_gather(w.logits, R * shard_.vocab_count, w.gathered);
  mark("output head");
}

// attn = attention(x) for every new token, after writing their latent rows (and, on full indexer
// layers, their index keys and the selection that this and the following shared layers use).
void GpuModel::attention_layer(const Layer& L, int32_t il, GpuCache& cache) {
  State& st = *st_;
  Workspace& w = st.ws;
  const HParams& hp = hp_;
  const cuda::Stream s = st.s();
  const int64_t T = st.T, nh = ahp_.n_head, nope = hp.qk_nope, rope = hp.qk_rope, kvl = hp.kv_lora_rank;
  const int64_t qk = nope + rope, lat = kvl + rope;
  const bool sparse = attention_ == AttentionMode::Sparse && hp.has_indexer();
  // Every token's positions are at most top_k: the indexer would select them all, in order
  // (GpuModelOptions::short_context_dense); its keys are still written for longer contexts.
  const bool all_rows = sparse && opts_.short_context_dense && st.max_ctx <= hp.idx_top_k;
  const bool select = sparse && !all_rows;

  // The products first, those of the layer input and then those of q_a's normed output, each
  // input quantized once (slot 0: x, until the output projection; slot 1: qr): products in a row
  // overlap each other's start (pdl.cuh), the small operations on their outputs follow.
  const bool index = sparse && L.indexer;
  const bool score = select && L.indexer;
  // (At one token those of one type share a launch: product_many.)
  const cuda::Q8Activations* qx = quantized(w.x, T, hp.n_embd, 0, attention_readers(L));
  {
    const QuantMatrix* mats[3];
    float* outs[3];
    int n = 0;
    if (hp.q_lora_rank > 0) mats[n] = &L.q_a, outs[n++] = w.qr;
    mats[n] = &L.kv_a_mqa, outs[n++] = w.kv;
    if (index) mats[n] = &L.idx_k, outs[n++] = w.ik;
    product_many(mats, outs, n, w.x, T, qx);
  }
  // The indexer's branch and the latent rows run beside the query path on the side stream (except
  // under the step profile, whose marks time one stream): the head weights' product, the index keys
  // and the latent rows once the first products are done; the indexer's q_b product, queries, scores
  // and top-k once q_a's norm is (GpuModelOptions::index_qb_side; else once q_b's product, shared
  // with the indexer's, is). The attention kernel waits for both.
  const bool branch = index && side_stream_on();
  const auto to_side = [&] {
    if (!branch) return;
    st.side.fork(s);
    st.on_side = true;
  };
  const auto to_main = [&] { st.on_side = false; };
  struct MainAgain {  // an error part way leaves the launches on the main stream
    State& st;
    ~MainAgain() { st.on_side = false; }
  } main_again{st};
  bool branch_indexed = false;  // the indexer ran with its q_b product on the side stream
  to_side();
  if (score) product(L.idx_proj, w.x, T, w.iw, qx);
  mark("attention: q_a, kv_a, q_b and the indexer's products");
  if (index) index_keys(L, il, cache);
  // The latent rows [rmsnorm(c) | rope(k_pe)] into the cache (one launch).
  cuda::write_latent_normed(w.kv, L.kv_a_norm, hp.rms_eps, st.rope->table(spec_->main_rope), w.pos, w.slots, T,
                            cache.dtype(), int(kvl), int(rope), cache.latent(il), cache.latent_row_bytes(), st.s());
  mark("attention: norms, rope, cache rows");
  to_main();
  if (hp.q_lora_rank > 0) {
    const int64_t ql = hp.q_lora_rank;
    int lv = 0;
    // (The indexer's q_b stays a reader even where it is skipped: qr is quantized as it would be
    // for it, so q_b's product is the same either way.)
    const Readers qr_readers{&L.q_b, index ? &L.idx_q_b : nullptr};
    cuda::Q8Activations* nq = producer_q8(w.qr, T, ql, 1, qr_readers, &lv);
    cuda::rms_norm(w.qr, ql, L.q_a_norm, T, ql, hp.rms_eps, w.qr, ql, s, nq, lv);
    const cuda::Q8Activations* qqr = quantized(w.qr, T, ql, 1, qr_readers);
    if (score && branch && opts_.index_qb_side) {
      // The indexer's q_b and everything after it on the side stream, q_b's product on the main one.
      to_side();
      product(L.idx_q_b, w.qr, T, w.iq, qqr);
      indexer(il, cache);
      to_main();
      product(L.q_b, w.qr, T, w.q, qqr);
      branch_indexed = true;
    } else {
      const QuantMatrix* mats[2] = {&L.q_b, &L.idx_q_b};
      float* outs[2] = {w.q, w.iq};
      product_many(mats, outs, score ? 2 : 1, w.qr, T, qqr);
    }
  } else {
    product(L.q, w.x, T, w.q, qx);  // no q_a, so no indexer (hparams refuses one)
  }
  mark("attention: q_a, kv_a, q_b and the indexer's products");

  if (score && !branch_indexed) {
    to_side();
    indexer(il, cache);
    to_main();
  }
  if (index) st.selection_made = true;
  if (sparse && !st.selection_made)
    fail("GPU forward: layer {} shares the indexer selection, but no earlier layer has an indexer", il);

  // q per head [q_nope | rope(q_pe)], absorbed into the latent space: qfull = [W_UK_h q_nope | q_pe].
  const cuda::HeadRope hr{w.q + nope, qk, w.qfull + kvl, lat, w.pos, st.rope->table(spec_->main_rope)};
  const bool rope_in_wuk = opts_.rope_in_wuk && st.rope->dims() == rope && st.blas.takes_rope(L.uk, T);
  if (!rope_in_wuk) st.rope->apply_to(w.q + nope, qk, w.qfull + kvl, lat, rope, T, nh, w.pos, spec_->main_rope, s);
  st.blas.per_head(L.uk, w.q, qk, T, w.qfull, lat, s, rope_in_wuk ? &hr : nullptr);
  st.rope_in_wuk += rope_in_wuk;
  mark("attention: rope, W_UK absorption");
  if (branch) st.side.join(s);
  if (sparse && st.record) {
    auto& out = st.record->layers[size_t(il)].selected;
    out.assign(size_t(T), {});
    if (all_rows) {  // every position of the token's context
      std::vector<int32_t> nctx(static_cast<size_t>(T));
      gpu::download(nctx.data(), w.nctx, nctx.size() * sizeof(int32_t), s);
      for (int64_t t = 0; t < T; ++t)
        for (int32_t p = 0; p < nctx[size_t(t)]; ++p) out[size_t(t)].push_back(p);
    } else {
      const int64_t k = hp.idx_top_k;
      std::vector<int32_t> sel(size_t(T * k));
      gpu::download(sel.data(), w.sel, sel.size() * sizeof(int32_t), s);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t i = 0; i < k; ++i)
          if (sel[size_t(t * k + i)] >= 0) out[size_t(t)].push_back(sel[size_t(t * k + i)]);
    }
  }

  cuda::AttentionArgs a;
  a.q = w.qfull;
  a.T = T;
  a.heads = int(nh);
  a.kv_lora = int(kvl);
  a.rope = int(rope);
  a.scale = hp.softmax_scale();
  a.seq = w.seq;
  a.n_ctx = w.nctx;
  a.selected = select ? w.sel : nullptr;
  a.top_k = select ? int(hp.idx_top_k) : 0;
  a.max_ctx = st.max_ctx;
  a.selected_front = select;  // top_k's order
  a.latent = {cache.latent(il), cache.latent_row_bytes(), w.tables, st.max_blocks, st.block_size};
  a.dtype = cache.dtype();
  a.out = w.olat;
  cuda::sparse_mla(a, st.attn_kernel[format_index(cache.dtype())], st.attn_ws, s);
  mark(select ? "attention: sparse MLA kernel" : "attention: dense MLA kernel");

  // Out of the latent space per head, then the output projection.
  st.blas.per_head(L.uv, w.olat, kvl, T, w.o, hp.v_head, s);
  product(L.output, w.o, T, w.attn, quantized(w.o, T, nh * int64_t(hp.v_head), 0, {&L.output}));
  mark("attention: W_UV, output projection");
}

// The index keys of a full layer's new tokens (attention_layer: ws.ik, layernorm, rope), into the
// cache in one launch; at least two launches before the scores kernel, which reads its keys before
// waiting for the kernel before it (pdl.cuh).
void GpuModel::index_keys(const Layer& L, int32_t il, GpuCache& cache) {
  State& st = *st_;
  Workspace& w = st.ws;
  const HParams& hp = hp_;
  if (!cache.has_keys(il)) fail("GPU forward: the cache holds no index keys for layer {}", il);
  const cuda::RopeTable rt = st.rope->table(spec_->indexer_rope);
  cuda::write_index_keys_normed(w.ik, L.idx_k_norm_w, L.idx_k_norm_b, 1e-6f, rt, w.pos, w.slots, st.T, cache.dtype(),
                                int(hp.idx_dim), cache.keys(il), cache.key_row_bytes(), st.s());
}

// The lightning indexer of a full layer, after its products and index_keys (attention_layer:
// queries ws.iq, head weights ws.iw): selects for each token the top-k positions of its sequence
// into ws.sel.
void GpuModel::indexer(int32_t il, GpuCache& cache) {
  State& st = *st_;
  Workspace& w = st.ws;
  const HParams& hp = hp_;
  const cuda::Stream s = st.s();
  const int64_t T = st.T, heads = hp.idx_heads, dim = hp.idx_dim;
  const cuda::RopeTable rt = st.rope->table(spec_->indexer_rope);

  // queries (qr @ q_b): rope on the first rope dims of each head, and for the mma kernel rounded to
  // its 16-bit type; weights with both scales folded in (index_queries' launch, or the scores
  // kernel's prologue: index_queries_in_scores)
  const int fi = format_index(cache.dtype());
  const bool mma = st.idx_kernel[fi] == cuda::IndexerKernel::Mma;
  const float w_scale = 1.0f / std::sqrt(float(heads) * float(dim));
  const int64_t chunk = st.ws_dims.score_rows;
  const int k = int(hp.idx_top_k);
  auto args_for = [&](const RunSegment& seg, int64_t t0, int64_t n) {
    cuda::IndexerArgs a;
    a.q = w.iq + t0 * heads * dim;
    a.q16 = mma ? w.iq16 + t0 * heads * dim : nullptr;
    a.w = w.iw + t0 * heads;
    a.T = n;
    a.heads = int(heads);
    a.dim = int(dim);
    a.seq = w.seq + t0;
    a.n_ctx = w.nctx + t0;
    a.max_ctx = st.max_ctx;
    a.keys = {cache.keys(il), cache.key_row_bytes(), w.tables, st.max_blocks, st.block_size};
    a.dtype = cache.dtype();
    a.scores = w.scores;
    a.score_stride = st.max_ctx;
    a.tokens_per_run = seg.tokens_per_run;
    return a;
  };
  // The queries' rope and scales done by the scores' kernel (GpuModelOptions::index_queries_in_scores)
  // where one call scores every token and its kernel takes them (the call's arguments, counts
  // included, decided first); else their own launch.
  bool prep = false, decided = false;
  cuda::IndexerArgs first;
  if (opts_.index_queries_in_scores && mma && st.index_segments.size() == 1 && st.index_segments[0].begin == 0 &&
      st.index_segments[0].end == T && T <= chunk) {
    first = args_for(st.index_segments[0], 0, T);
    first.counts = cuda::top_k_counts(w.scores, T, st.max_ctx, k, s, &st.topk_ws);
    decided = true;
    cuda::IndexerArgs p = first;
    p.q16 = nullptr;
    p.prep = {rt, w.pos, w_scale};
    if (cuda::indexer_takes_query_prep(p, st.idx_kernel[fi])) first = p, prep = true;
  }
  if (!prep) {
    cuda::index_queries(w.iq, w.iw, T, int(heads), int(dim), rt, w.pos, w_scale, cache.dtype(), mma ? w.iq16 : nullptr,
                        s);
    mark("indexer: queries, rope");
  }
  st.index_queries_in_scores += prep;

  // Each segment of the batch (prefill chunks, decode tokens) in calls of its own, of at most the
  // scores' rows each.
  for (const RunSegment& seg : st.index_segments) {
    for (int64_t t0 = seg.begin; t0 < seg.end; t0 += chunk) {
      const int64_t n = std::min(chunk, seg.end - t0);
      cuda::IndexerArgs a = decided ? first : args_for(seg, t0, n);
      // The top-k's first histogram counted by the mma kernel as it writes the scores (one pass fewer).
      if (mma && !decided) a.counts = cuda::top_k_counts(w.scores, n, st.max_ctx, k, s, &st.topk_ws);
      cuda::indexer_scores(a, st.idx_kernel[fi], s);
      mark("indexer: scores kernel");
      // In ascending position order: the attention sums a token's positions in one order on every run.
      cuda::top_k(w.scores, n, st.max_ctx, w.nctx + t0, k, w.sel + t0 * k, s, &st.topk_ws);
      mark("indexer: top-k");
    }
  }
}

int GpuModel::q8_levels(gguf::GgmlType t) const {
  if (opts_.precise || !cuda::q8_supported(t)) return 0;
  if (opts_.int8_activations) return 1;
  if (!opts_.q8_two_level) return 0;
  // Q8_0 and Q5_K: the types without a multi-token tensor-core decode kernel, whose fp32 kernel the
  // int8 one beats at every token count (docs/PERFORMANCE.md, session 24).
  if (t == gguf::GgmlType::Q8_0 || t == gguf::GgmlType::Q5_K) return 2;
  // Q2_K, Q3_K, IQ4_XS and IQ2_XXS (no tensor-core decode kernel either): the dp4a kernel, staged at
  // one token.
  if (t == gguf::GgmlType::Q2_K || t == gguf::GgmlType::Q3_K || t == gguf::GgmlType::IQ4_XS ||
      t == gguf::GgmlType::IQ2_XXS)
    return 2;
  // Q4_K in a one-token step: the one-token int8 tensor-core kernel (session 25); at 2-8 tokens
  // its bf16 tensor-core kernel stays faster than the dp4a one.
  if (t == gguf::GgmlType::Q4_K && st_->T == 1) return 2;
  // Q6_K in a one-token step: the dp4a kernel with staged loads (session 26; the Q6_K output head
  // 307 -> 265 us, a 2-layer Q4_K_M GLM-5-width step 0.709 -> 0.669 ms). At 3-8 tokens its bf16
  // tensor-core kernel stays.
  if (t == gguf::GgmlType::Q6_K && st_->T == 1) return 2;
  // IQ3_XXS, IQ3_S, IQ2_XS, IQ2_S, IQ1_S, IQ1_M, Q4_0 and IQ4_NL (the types of GLM-5's UD-IQ1 / IQ2
  // / IQ3 files and the legacy 32-blocks; no tensor-core decode kernel): the dp4a kernel at two
  // levels, 1.3-2.5x their fp32 kernel at one token on the GLM-5 shapes (session 32, H200: 6144 x
  // 16384 IQ3_XXS 58.5 -> 31.8 us, IQ1_S 49.0 -> 23.3, Q4_0 39.0 -> 20.6; the 154880 x 6144 head
  // IQ2_XS 414 -> 192, IQ1_S 428 -> 173), ahead or even at 2-8 tokens (IQ2_XS / IQ3_XXS 6144 x
  // 16384 at 8 tokens 160 / 162 -> 100 / 106 us; 8 experts 56 / 70 -> 31 / 35); a 2-layer
  // GLM-5-width step 1.07 -> 0.69 ms (IQ2_XS) and 1.08 -> 0.50 ms (IQ1_S).
  switch (t) {
    case gguf::GgmlType::IQ3_XXS:
    case gguf::GgmlType::IQ3_S:
    case gguf::GgmlType::IQ2_XS:
    case gguf::GgmlType::IQ2_S:
    case gguf::GgmlType::IQ1_S:
    case gguf::GgmlType::IQ1_M:
    case gguf::GgmlType::Q4_0:
    case gguf::GgmlType::IQ4_NL: return 2;
    default: return 0;
  }
}

bool GpuModel::takes_q8(const cuda::Q8Activations* q, const QuantMatrix& w, int64_t T) const {
  return q && q->n_tokens == T && q->n_cols == w.n_cols && q8_levels(w.type) != 0;
}

void GpuModel::product(const QuantMatrix& w, const float* x, int64_t T, float* y, const cuda::Q8Activations* q) {
  if (takes_q8(q, w, T))
    cuda::matmul_decode_q8(w, *q, y, st_->s(), /*one_token_kernel=*/true);
  else if (opts_.precise)
    cuda::matmul_decode(w, x, T, y, st_->s());
  else
    cuda::matmul(w, x, T, y, st_->s());
}

// Products of one input: at one token one launch per type (cuda::matmul_many), the same bits as one
// product each.
// With quantized activations, the products of types with an int8 kernel take it (one launch per
// type at one token: cuda::matmul_many_q8) and the others the float kernels.
void GpuModel::product_many(const QuantMatrix* const* w, float* const* y, int n, const float* x, int64_t T,
                            const cuda::Q8Activations* q) {
  if (n > cuda::kMaxProducts) {
    for (int i = 0; i < n; ++i) product(*w[i], x, T, y[i], q);
    return;
  }
  QuantMatrix mq[cuda::kMaxProducts], mf[cuda::kMaxProducts];
  float* yq[cuda::kMaxProducts];
  float* yf[cuda::kMaxProducts];
  int nq = 0, nf = 0;
  for (int i = 0; i < n; ++i) {
    if (takes_q8(q, *w[i], T))
      mq[nq] = *w[i], yq[nq++] = y[i];
    else
      mf[nf] = *w[i], yf[nf++] = y[i];
  }
  if (nq > 0) cuda::matmul_many_q8(mq, yq, nq, *q, st_->s(), /*one_token_kernel=*/true);
  if (nf > 0) cuda::matmul_many(mf, yf, nf, x, T, st_->s(), opts_.precise);
}

GpuModel::Readers::Readers(std::initializer_list<const QuantMatrix*> l) {
  if (l.size() > size_t(kMax)) fail("GpuModel: {} readers of one input (at most {})", l.size(), kMax);
  for (const QuantMatrix* p : l) m[n++] = p;
}

int GpuModel::input_levels(int64_t T, int64_t n_cols, const Readers& readers, int64_t max_rows) const {
  int levels = 0;
  for (int i = 0; i < readers.n; ++i) {
    const QuantMatrix* m = readers.m[i];
    if (m && m->data && m->n_cols == n_cols) levels = std::max(levels, q8_levels(m->type));
  }
  if (levels == 0 || T < 1 || T > max_rows || n_cols % cuda::kQ8ActBlock != 0 ||
      cuda::q8_activation_bytes(T, n_cols, levels) > st_->ws.q8_bytes)
    return 0;
  return levels;
}

const cuda::Q8Activations* GpuModel::quantized(const float* x, int64_t T, int64_t n_cols, int slot,
                                                const Readers& readers, int64_t max_rows) {
  State& st = *st_;
  const bool done = st.prequantized[slot] == x;  // by the norm that wrote x (producer_q8)
  st.prequantized[slot] = nullptr;
  const int levels = input_levels(T, n_cols, readers, max_rows);
  if (levels == 0) return nullptr;
  cuda::Q8Activations& q = st.q8[slot];
  if (done && q.n_tokens == T && q.n_cols == n_cols && q.levels == levels) return &q;
  q.data = st.ws.q8[slot];
  q.bytes = st.ws.q8_bytes;
  cuda::quantize_activations(x, T, n_cols, q, st.s(), levels);
  return &q;
}

cuda::Q8Activations* GpuModel::producer_q8(const float* x, int64_t T, int64_t n_cols, int slot, const Readers& readers,
                                           int* levels, int64_t max_rows) {
  State& st = *st_;
  st.prequantized[slot] = nullptr;
  *levels = input_levels(T, n_cols, readers, max_rows);
  if (*levels == 0) return nullptr;
  cuda::Q8Activations& q = st.q8[slot];
  q.data = st.ws.q8[slot];
  q.bytes = st.ws.q8_bytes;
  st.prequantized[slot] = x;
  return &q;
}

GpuModel::Readers GpuModel::attention_readers(const Layer& L) const {
  const bool index = attention_ == AttentionMode::Sparse && hp_.has_indexer() && L.indexer;
  return {&L.q_a, &L.kv_a_mqa, index ? &L.idx_k : nullptr, index ? &L.idx_proj : nullptr, &L.q};
}

GpuModel::Readers GpuModel::ffn_readers(const Layer& L) const {
  if (!L.moe) return {&L.gate, &L.up};
  return {&L.gate_exps, &L.up_exps, L.shared ? &L.gate_shexp : nullptr, L.shared ? &L.up_shexp : nullptr};
}

void GpuModel::mlp(const QuantMatrix& gate, const QuantMatrix& up, const QuantMatrix& down, const float* y, int64_t T,
                   float* out, const cuda::Q8Activations* qy) {
  State& st = *st_;
  const cuda::Stream s = st.s();
  const int64_t F = gate.n_rows;
  if (F == 0) {  // a rank that holds none of this FFN's columns adds zeros
    gpu::fill_bytes(out, 0, size_t(T * down.n_rows) * sizeof(float), s);
    return;
  }
  if (!qy) qy = quantized(y, T, gate.n_cols, 0, {&gate, &up});
  const QuantMatrix* mats[2] = {&gate, &up};
  float* outs[2] = {st.ws.g, st.ws.u};
  product_many(mats, outs, 2, y, T, qy);
  int lv = 0;
  cuda::Q8Activations* gq = producer_q8(st.ws.g, T, F, 1, {&down}, &lv);
  cuda::silu_mul(st.ws.g, st.ws.u, T * F, s, gq, F, lv);
  product(down, st.ws.g, T, out, quantized(st.ws.g, T, F, 1, {&down}));
}

// attn = ffn(x): the dense MLP, or the routed experts plus the shared ones.
//
// Routed experts, three ways:
//  - one token: each of its k (token, expert) pairs' gate, up and down products in one launch
//    (cuda::matmul_experts reads the expert ids on the device).
//  - up to kSyncFreeTokens tokens: the pairs grouped by expert on the device (cuda::moe_group, with
//    the list of experts that have tokens), then one launch per product over those experts
//    (cuda::matmul_expert_groups): each expert's weights are read once for all its tokens, and
//    nothing waits for the host. Each pair is summed as the one-token product sums it, so in
//    precise mode (fp32 kernels) these two paths give the same bits; the fast mode takes the
//    tensor-core kernel for groups and, at one token, the one-token kernel for Q4_K (faster, and
//    closer to fp32), so its bits differ between batch 1 and a batch.
//  - larger batches (prefill): the per-expert token counts are read back to the host (one
//    synchronization per MoE layer) and the tokens gathered by expert. In the fast mode
//    (GpuModelOptions::expert_tiles) the groups of up to 8 tokens take one launch per product of the
//    grouped decode kernels, those of 9 up to the type's cuBLAS threshold one launch per tile width
//    of the prefill kernel (cuda::matmul_expert_tiles), and each larger group cuBLAS, on its tokens
//    rounded up to kBlasTokenQuantum. Otherwise (precise mode, or expert_tiles off) each expert
//    with tokens runs cuda::matmul (matmul_decode) over its rows of the stacked expert tensors.
void GpuModel::ffn(const Layer& L, int32_t il) {
  State& st = *st_;
  Workspace& w = st.ws;
  const HParams& hp = hp_;
  const cuda::Stream s = st.s();
  const int64_t T = st.T, H = hp.n_embd;
  if (!L.moe) {
    mlp(L.gate, L.up, L.down, w.x, T, w.attn);
    mark("ffn: dense MLP");
    return;
  }
  const int64_t k = hp.n_expert_used, Fe = hp.n_ff_exp;
  // The experts this model holds: all, or a rank's range (expert parallel).
  const int64_t E = sharded() && shard_.experts.count >= 0 ? shard_.experts.count : hp.n_expert;
  // Router logits in fp32 at every batch size (the decode kernel; at prefill sizes in the fast mode,
  // where the cuBLAS prefill is on, cuBLAS's fp32 GEMM, no tensor-core rounding): the routing is a
  // discrete choice, and fp32 keeps it where the CPU's is.
  if (T < cuda::kF32BlasMinTokens || opts_.precise || !cuda::prefill_blas_enabled() ||
      !cuda::matmul_f32_blas(L.gate_inp, w.x, T, w.rlog, s))
    cuda::matmul_decode(L.gate_inp, w.x, T, w.rlog, s);
  cuda::moe_route(hp, w.rlog, L.exp_probs_b, T, w.rids, w.rw, s);
  mark("moe: router");
  if (st.record) {
    std::vector<int32_t> ids(size_t(T * k));
    std::vector<float> wts(size_t(T * k));
    gpu::download(ids.data(), w.rids, ids.size() * sizeof(int32_t), s);
    gpu::download(wts.data(), w.rw, wts.size() * sizeof(float), s);
    LayerDecisions& d = st.record->layers[size_t(il)];
    for (int64_t t = 0; t < T; ++t) {
      d.experts.emplace_back(ids.begin() + t * k, ids.begin() + (t + 1) * k);
      d.weights.emplace_back(wts.begin() + t * k, wts.begin() + (t + 1) * k);
    }
  }
  // Expert ids as this model's: the router's, or a rank's own with -1 for the others'.
  const int32_t* ids = w.rids;
  if (sharded()) {
    gpu::localize_experts(w.rids, T * k, int32_t(shard_.experts.first), int32_t(E), w.lids, s);
    ids = w.lids;
  }
  const auto shared = [&] {
    if (L.shared) mlp(L.gate_shexp, L.up_shexp, L.down_shexp, w.x, T, w.attn);
    else gpu::fill_bytes(w.attn, 0, size_t(T * H) * sizeof(float), s);
    mark("moe: shared expert");
  };
  if (T == 1) {
    const cuda::Q8Activations* qx = quantized(w.x, 1, H, 0, ffn_readers(L));
    // The shared expert as pair k of the routed products (no launches of its own; the combine adds
    // its output row first, as it adds the shared MLP's output otherwise), where it has one routed
    // expert's types and shapes (the same bits either way).
    const bool fold = L.shared && L.gate_exps.type == L.up_exps.type &&
                      cuda::expert_shaped(L.gate_exps, Fe, L.gate_shexp) &&
                      cuda::expert_shaped(L.up_exps, Fe, L.up_shexp) && cuda::expert_shaped(L.down_exps, H, L.down_shexp);
    if (L.shared && !fold) mlp(L.gate_shexp, L.up_shexp, L.down_shexp, w.x, T, w.attn, qx);
    else if (!L.shared) gpu::fill_bytes(w.attn, 0, size_t(T * H) * sizeof(float), s);
    mark("moe: shared expert");
    const cuda::SharedPair up_pair{&L.gate_shexp, &L.up_shexp, 0}, down_pair{&L.down_shexp, nullptr, k};
    const int64_t pairs = fold ? k + 1 : k;
    const auto kernel = [&](const QuantMatrix& m) {
      return !opts_.precise && cuda::mma_one_token_takes(m) ? cuda::ExpertKernel::kOneToken : cuda::ExpertKernel::kFp32;
    };
    const auto int8 = [&](const cuda::Q8Activations* q, const QuantMatrix& m) { return q && q8_levels(m.type) != 0; };
    if (L.gate_exps.type == L.up_exps.type) {  // gate and up in one launch (one kernel choice)
      if (int8(qx, L.gate_exps))
        cuda::matmul_experts_pair_q8(L.gate_exps, L.up_exps, Fe, ids, k, *qx, k, w.g, w.u, s, fold ? &up_pair : nullptr,
                                     true);
      else
        cuda::matmul_experts_pair(L.gate_exps, L.up_exps, Fe, ids, k, w.x, k, w.g, w.u, s, kernel(L.gate_exps),
                                  fold ? &up_pair : nullptr);
    } else {
      for (const auto& [m, y] : {std::pair{&L.gate_exps, w.g}, std::pair{&L.up_exps, w.u}}) {
        if (int8(qx, *m)) cuda::matmul_experts_q8(*m, Fe, ids, k, *qx, k, y, s, nullptr, true);
        else cuda::matmul_experts(*m, Fe, ids, k, w.x, k, y, s, kernel(*m));
      }
    }
    // (k + 1 rows with the shared expert folded: more than a decode product's kDecodeMaxTokens.)
    const Readers down_readers{&L.down_exps, fold ? &L.down_shexp : nullptr};
    int lv = 0;
    cuda::Q8Activations* gq = producer_q8(w.g, pairs, Fe, 1, down_readers, &lv, pairs);
    cuda::silu_mul(w.g, w.u, pairs * Fe, s, gq, Fe, lv);
    const cuda::Q8Activations* qg = quantized(w.g, pairs, Fe, 1, down_readers, pairs);
    if (int8(qg, L.down_exps))
      cuda::matmul_experts_q8(L.down_exps, H, ids, k, *qg, 1, w.oe, s, fold ? &down_pair : nullptr, true);
    else
      cuda::matmul_experts(L.down_exps, H, ids, k, w.g, 1, w.oe, s, kernel(L.down_exps), fold ? &down_pair : nullptr);
    // Outputs are in pair order: the combine's permutation is the identity (null).
    gpu::moe_combine(w.oe, nullptr, k, ids, w.rw, T, int(k), H, w.inv, w.attn, s, fold ? w.oe + k * H : nullptr);
    mark("moe: routed experts (one token)");
    return;
  }
  if (T <= kSyncFreeTokens) {
    cuda::moe_group(ids, T * k, E, w.counts, w.offsets, w.perm, w.group_ws, s, w.active, w.n_active);
    shared();
    const int64_t P = T * k;
    cuda::ExpertGroups g;
    g.offsets = w.offsets;
    g.active = w.active;
    g.n_active = w.n_active;
    g.perm = w.perm;
    g.max_groups = std::min(E, P);
    g.max_slots = T;
    // The tensor-core decode kernel in the fast mode: its time hardly grows with a group's tokens,
    // and at every batch of 2-64 it beat the fp32 kernel on the GLM-5-width model (H200: a MoE
    // layer at batch 8 0.96 against 1.26 ms, at 32 1.99 against 3.41; docs/PERFORMANCE.md).
    // Types that take int8 activations (Q8_0 in the fast mode: q8_levels) take the int8 kernel.
    const bool tc = !opts_.precise;
    const cuda::Q8Activations* qx = quantized(w.x, T, H, 0, {&L.gate_exps, &L.up_exps}, kSyncFreeTokens);
    const auto groups = [&](const QuantMatrix& m, int64_t rows, const float* x, const cuda::Q8Activations* q,
                            int64_t x_div, float* y) {
      if (q && q8_levels(m.type) != 0) cuda::matmul_expert_groups_q8(m, rows, g, *q, x_div, y, s);
      else cuda::matmul_expert_groups(m, rows, g, x, x_div, y, s, tc);
    };
    groups(L.gate_exps, Fe, w.x, qx, k, w.g);
    groups(L.up_exps, Fe, w.x, qx, k, w.u);
    // (All P slots quantized: those past the routed ones hold stale but finite values, never read.)
    int lv = 0;
    cuda::Q8Activations* gq = producer_q8(w.g, P, Fe, 1, {&L.down_exps}, &lv, kSyncFreeTokens * k);
    cuda::silu_mul(w.g, w.u, P * Fe, s, gq, Fe, lv);
    g.perm = nullptr;  // the down products read the grouped rows in place
    const cuda::Q8Activations* qg = quantized(w.g, P, Fe, 1, {&L.down_exps}, kSyncFreeTokens * k);
    groups(L.down_exps, H, w.g, qg, 1, w.oe);
    // Entries left out of the grouping (other ranks' experts) are -1 in perm and add nothing.
    gpu::moe_combine(w.oe, w.perm, P, ids, w.rw, T, int(k), H, w.inv, w.attn, s);
    mark("moe: routed experts (grouped on the device)");
    return;
  }
  cuda::moe_group(ids, T * k, E, w.counts, w.offsets, w.perm, w.group_ws, s);
  st.host_counts.resize(size_t(E));
  gpu::download(st.host_counts.data(), w.counts, size_t(E) * sizeof(int32_t), s);
  // The groups that take the grouped prefill kernel (expert_tiles), their tiles uploaded while the
  // stream is empty (a copy from pageable memory waits for the stream); the others one product each.
  const auto tiles_below = [&](const QuantMatrix& m) -> int64_t {
    if (opts_.precise || !opts_.expert_tiles) return 0;
    if (opts_.expert_tiles_max > 0) return opts_.expert_tiles_max;
    return cuda::prefill_blas_enabled() ? cuda::blas_min_tokens(m.type) : INT64_MAX;
  };
  const int64_t gu_below = std::min(tiles_below(L.gate_exps), tiles_below(L.up_exps)), down_below = tiles_below(L.down_exps);
  const cuda::ExpertTileLists gu_tiles = cuda::expert_tiles(st.host_counts.data(), E, kTileMinTokens, gu_below);
  const cuda::ExpertTileLists down_tiles = cuda::expert_tiles(st.host_counts.data(), E, kTileMinTokens, down_below);
  st.host_tiles.clear();
  for (const cuda::ExpertTileLists* l : {&gu_tiles, &down_tiles})
    for (const auto& v : l->of_width) st.host_tiles.insert(st.host_tiles.end(), v.begin(), v.end());
  gpu::upload_async(w.tiles, st.host_tiles.data(), st.host_tiles.size() * sizeof(cuda::ExpertTile), s);
  // With the tiles, the groups of up to kDecodeMaxTokens tokens take one launch per product too: the
  // decode kernels grouped by expert (cuda::matmul_expert_groups, the decode batches' path) over the
  // list of those experts, in w.active / w.n_active (which only the decode batches use otherwise).
  const bool few_grouped = gu_below > 0;
  st.host_small.clear();
  if (few_grouped)
    for (int64_t e = 0; e < E; ++e)
      if (const int32_t c = st.host_counts[size_t(e)]; c > 0 && c < kTileMinTokens) st.host_small.push_back(int32_t(e));
  const int32_t n_small = int32_t(st.host_small.size());
  if (n_small > 0) {
    gpu::upload_async(w.active, st.host_small.data(), st.host_small.size() * sizeof(int32_t), s);
    gpu::upload_async(w.n_active, &n_small, sizeof(int32_t), s);
  }
  shared();

  int64_t n_routed = 0;
  for (int32_t c : st.host_counts) n_routed += c;
  if (n_routed == 0) return;
  gpu::gather_rows(w.x, H, w.perm, int32_t(k), n_routed, w.ye, s);
  // One launch per tile width of the tiled groups' products (m2: a second product in the launch).
  const cuda::ExpertTile* next_tiles = w.tiles;
  const auto tiled = [&](const cuda::ExpertTileLists& l, const QuantMatrix& m, const QuantMatrix* m2, int64_t rows,
                         const float* x, float* y, float* y2) {
    for (int i = 0; i < 3; ++i)  // (at most 65535 tiles a launch)
      for (int64_t n = int64_t(l.of_width[i].size()); n > 0;) {
        const int64_t part = std::min<int64_t>(n, 65535);
        cuda::matmul_expert_tiles(m, m2, rows, next_tiles, part, cuda::kExpertTileWidths[i], x, y, y2, s);
        next_tiles += part;
        n -= part;
      }
  };
  // Whether a group of n tokens is in a grouped launch (tiles below `below`, or the few-token one).
  const auto in_group_launch = [&](int64_t n, int64_t below) {
    return (n >= kTileMinTokens && n < below) || (few_grouped && n < kTileMinTokens);
  };
  // The few-token groups' launch (rows in grouped order, in place: no perm).
  cuda::ExpertGroups few;
  few.offsets = w.offsets;
  few.active = w.active;
  few.n_active = w.n_active;
  few.max_groups = n_small;
  few.max_slots = kTileMinTokens - 1;
  const auto few_products = [&](const QuantMatrix& m, int64_t rows, const float* x, float* y) {
    if (n_small > 0) cuda::matmul_expert_groups(m, rows, few, x, 1, y, s, /*tensor_cores=*/true);
  };
  // The groups that take cuBLAS on their tokens rounded up to kBlasTokenQuantum: the rows past a
  // group are later groups' (or the kBlasTokenQuantum spare rows past the last), whose products all
  // run after it: the expert loops go in expert order, before the tiles.
  const auto padded = [&](int64_t n, const QuantMatrix& m) {
    const bool blas = !opts_.precise && cuda::prefill_blas_enabled() && n >= cuda::blas_min_tokens(m.type);
    return blas ? (n + kBlasTokenQuantum - 1) / kBlasTokenQuantum * kBlasTokenQuantum : n;
  };
  int64_t off = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = st.host_counts[size_t(e)];
    if (n > 0 && !in_group_launch(n, gu_below)) {
      // (One call: at cuBLAS sizes the two share the activations' bf16 rounding.)
      const QuantMatrix gate = rows(L.gate_exps, e * Fe, Fe), up = rows(L.up_exps, e * Fe, Fe);
      const QuantMatrix* mats[2] = {&gate, &up};
      float* outs[2] = {w.g + off * Fe, w.u + off * Fe};
      product_many(mats, outs, 2, w.ye + off * H, std::max(padded(n, gate), padded(n, up)), nullptr);
    }
    off += n;
  }
  few_products(L.gate_exps, Fe, w.ye, w.g);
  few_products(L.up_exps, Fe, w.ye, w.u);
  if (L.gate_exps.type == L.up_exps.type) {
    tiled(gu_tiles, L.gate_exps, &L.up_exps, Fe, w.ye, w.g, w.u);
  } else {
    const cuda::ExpertTile* first = next_tiles;
    tiled(gu_tiles, L.gate_exps, nullptr, Fe, w.ye, w.g, nullptr);
    next_tiles = first;
    tiled(gu_tiles, L.up_exps, nullptr, Fe, w.ye, w.u, nullptr);
  }
  cuda::silu_mul(w.g, w.u, n_routed * Fe, s);
  off = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = st.host_counts[size_t(e)];
    if (n > 0 && !in_group_launch(n, down_below))
      product(rows(L.down_exps, e * H, H), w.g + off * Fe, padded(n, L.down_exps), w.oe + off * H);
    off += n;
  }
  few_products(L.down_exps, H, w.g, w.oe);
  tiled(down_tiles, L.down_exps, nullptr, H, w.g, w.oe, nullptr);
  gpu::moe_combine(w.oe, w.perm, n_routed, ids, w.rw, T, int(k), H, w.inv, w.attn, s);
  mark("moe: shared + routed experts (grouped)");
}

}  // namespace sparsemla::model
