// The public entry points of quant_matmul.h: argument checks, the dispatch table over types, the
// per-device codebook upload and the split-sum kernel of the prefill path.
#include "ops/cuda/quant_matmul.h"
#include "ops/cuda/quant_matmul_q8.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include "gguf/quant_tables.h"
#include "ops/cuda/pdl.cuh"
#include "ops/cuda/prefill_blas.cuh"
#include "ops/cuda/quant_matmul_kernels.cuh"
#include "util/env.h"

namespace sparsemla::cuda {

namespace {

// Every supported type's launchers, in the order of the family files.
const std::vector<TypeKernels>& kernel_table() {
  static const std::vector<TypeKernels> table = [] {
    std::vector<TypeKernels> t;
    for (KernelFamily f : {plain_kernels(), legacy_kernels(), kquant_kernels(), iq_kernels()})
      t.insert(t.end(), f.kernels, f.kernels + f.count);
    return t;
  }();
  return table;
}

const TypeKernels* find_kernels(gguf::GgmlType t) {
  for (const TypeKernels& k : kernel_table())
    if (k.type == t) return &k;
  return nullptr;
}

const TypeKernels& kernels_for(gguf::GgmlType t, const char* what) {
  const TypeKernels* k = find_kernels(t);
  if (!k) {
    std::string names;
    for (const TypeKernels& e : kernel_table()) names += std::string(names.empty() ? "" : ", ") + std::string(gguf::type_name(e.type));
    fail("cuda::{}: no CUDA kernel for ggml type {} (id {}); supported: {}", what, gguf::type_name(t), uint32_t(t), names);
  }
  return *k;
}

// The codebooks in device memory, one copy per device, kept for the life of the process.
struct DeviceState {
  QuantTables tables;
  int sm_count = 0;
};

template <class Entry, size_t N, size_t W>
void append_rows(std::vector<uint8_t>& blob, const Entry (&table)[N][W]) {
  static_assert(sizeof(Entry) == 1);
  const size_t at = blob.size();
  blob.resize(at + N * W);
  std::memcpy(blob.data() + at, table, N * W);
}

DeviceState upload_state(int device) {
  namespace tb = gguf::tables;
  DeviceState st;
  cudaDeviceProp prop{};
  SPARSEMLA_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  st.sm_count = prop.multiProcessorCount;
  // The kernels compute the IQ2/IQ3 sign bytes from their 7-bit index (parity in bit 7).
  for (uint32_t i = 0; i < 128; ++i)
    if (tb::kIq2Signs[i] != (i | ((__builtin_popcount(i) & 1u) << 7)))
      fail("cuda::matmul: internal error: the IQ2 sign table does not follow the parity rule at {}", i);
  std::vector<uint8_t> blob;
  size_t offsets[6];
  offsets[0] = blob.size(), append_rows(blob, tb::kIq2xxsGrid);
  offsets[1] = blob.size(), append_rows(blob, tb::kIq2xsGrid);
  offsets[2] = blob.size(), append_rows(blob, tb::kIq2sGrid);
  offsets[3] = blob.size(), append_rows(blob, tb::kIq3xxsGrid);
  offsets[4] = blob.size(), append_rows(blob, tb::kIq3sGrid);
  offsets[5] = blob.size(), append_rows(blob, tb::kIq1sGrid);
  void* dev = nullptr;
  SPARSEMLA_CUDA_CHECK(cudaMalloc(&dev, blob.size()));
  SPARSEMLA_CUDA_CHECK(cudaMemcpy(dev, blob.data(), blob.size(), cudaMemcpyHostToDevice));
  const uint8_t* base = static_cast<const uint8_t*>(dev);
  st.tables.iq2xxs = reinterpret_cast<const uint2*>(base + offsets[0]);
  st.tables.iq2xs = reinterpret_cast<const uint2*>(base + offsets[1]);
  st.tables.iq2s = reinterpret_cast<const uint2*>(base + offsets[2]);
  st.tables.iq3xxs = reinterpret_cast<const uint32_t*>(base + offsets[3]);
  st.tables.iq3s = reinterpret_cast<const uint32_t*>(base + offsets[4]);
  st.tables.iq1s = reinterpret_cast<const uint2*>(base + offsets[5]);
  std::memcpy(st.tables.iq4nl, tb::kIq4nlValues, 16);
  std::memcpy(st.tables.mxfp4, tb::kMxfp4Values, 16);
  st.tables.iq1_delta = tb::kIq1Delta;
  return st;
}

const DeviceState& device_state() {
  static std::mutex mu;
  static std::map<int, DeviceState> states;
  int device = 0;
  SPARSEMLA_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mu);
  auto it = states.find(device);
  if (it == states.end()) it = states.emplace(device, upload_state(device)).first;
  return it->second;
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// Checks the view against its type and fills the common arguments. The decoders (dequant.cuh)
// assume each block starts at a multiple of `align` bytes: the largest power of 2 up to 16 that
// divides the block size (the kernels' blocks of 8 for the plain types).
MatArgs checked_args(const QuantMatrix& w, const char* what) {
  const auto& tr = gguf::traits(w.type);
  const int64_t granule = tr.block_size == 1 ? 8 : tr.block_size;
  if (w.n_rows <= 0 || w.n_cols <= 0 || w.n_cols % granule != 0)
    fail("cuda::{}: a {} weight of {} rows x {} columns: columns must be a positive multiple of {}", what, tr.name,
         w.n_rows, w.n_cols, granule);
  if (w.n_cols / 8 > INT32_MAX) fail("cuda::{}: {} columns is too many", what, w.n_cols);
  const uint64_t data_bytes = gguf::row_bytes(w.type, uint64_t(w.n_cols));
  const uint64_t block_bytes = uint64_t(tr.type_size) * (tr.block_size == 1 ? 8 : 1);
  if (w.row_bytes < data_bytes || w.row_bytes % tr.type_size != 0)
    fail("cuda::{}: row_bytes {} cannot hold {} columns of {} ({} bytes) as whole blocks", what, w.row_bytes, w.n_cols,
         tr.name, data_bytes);
  const uint64_t align = std::min<uint64_t>(16, block_bytes & (~block_bytes + 1));
  if ((reinterpret_cast<uintptr_t>(w.data) | w.row_bytes) % align != 0)
    fail("cuda::{}: {} rows must start {}-byte aligned (data {}, row_bytes {})", what, tr.name, align, w.data,
         w.row_bytes);
  MatArgs a;
  a.w = static_cast<const uint8_t*>(w.data);
  a.row_bytes = w.row_bytes;
  a.n_rows = w.n_rows;
  a.n_cols = w.n_cols;
  const DeviceState& st = device_state();
  a.tables = st.tables;
  a.sm_count = st.sm_count;
  a.prefetch = pdl::prefetch();
  return a;
}

MatArgs checked_product(const QuantMatrix& w, const float* x, int64_t n_tokens, float* y, const char* what) {
  if (n_tokens < 0) fail("cuda::{}: negative token count {}", what, n_tokens);
  MatArgs a = checked_args(w, what);
  if (!aligned16(x)) fail("cuda::{}: activations {} are not 16-byte aligned", what, static_cast<const void*>(x));
  a.x = x;
  a.y = y;
  a.n_tokens = n_tokens;
  return a;
}

// The product of w with quantized activations (the int8 kernels): checks the type, the activations'
// shape and buffer, and binds them in place of x.
MatArgs checked_q8_product(const QuantMatrix& w, const Q8Activations& x, int64_t n_tokens, float* y,
                           const char* what) {
  if (!q8_supported(w.type))
    fail("cuda::{}: no int8-activation kernel for ggml type {} (id {}); the types with one: {} (use the fp32 "
         "path, matmul_decode)",
         what, gguf::type_name(w.type), uint32_t(w.type), q8_type_names());
  if (n_tokens < 0) fail("cuda::{}: negative token count {}", what, n_tokens);
  MatArgs a = checked_args(w, what);
  if (x.n_cols != w.n_cols)
    fail("cuda::{}: activations of {} columns for a weight of {} columns", what, x.n_cols, w.n_cols);
  if (x.levels != 1 && x.levels != 2) fail("cuda::{}: quantized activations of {} levels (1 or 2)", what, x.levels);
  if (x.n_tokens < 0 || !x.data || !aligned16(x.data) || x.bytes < q8_activation_bytes(x.n_tokens, x.n_cols, x.levels))
    fail("cuda::{}: quantized activations {} ({} bytes for {} tokens) are not a 16-byte aligned buffer of {} bytes",
         what, x.data, x.bytes, x.n_tokens, q8_activation_bytes(x.n_tokens, x.n_cols, x.levels));
  if ((reinterpret_cast<uintptr_t>(y) & 3) != 0)
    fail("cuda::{}: output {} is not 4-byte aligned", what, static_cast<const void*>(y));
  const auto* base = static_cast<const uint8_t*>(x.data);
  a.xq = reinterpret_cast<const int8_t*>(base);
  if (x.levels == 2) a.xr = reinterpret_cast<const int8_t*>(base + q8_scales_offset(x.n_tokens, x.n_cols, 1));
  a.xb = reinterpret_cast<const int2*>(base + q8_scales_offset(x.n_tokens, x.n_cols, x.levels));
  a.y = y;
  a.n_tokens = n_tokens;
  return a;
}

// The activations of a product: fp32 rows (x) or quantized ones (q, the int8 kernels).
struct Input {
  const float* x = nullptr;
  const Q8Activations* q = nullptr;
  MatArgs args(const QuantMatrix& w, int64_t n_tokens, float* y, const char* what) const {
    return q ? checked_q8_product(w, *q, n_tokens, y, what) : checked_product(w, x, n_tokens, y, what);
  }
  // Activation rows the product may read: the quantized ones must hold them.
  void check_rows(int64_t rows, const char* what) const {
    if (q && rows > q->n_tokens)
      fail("cuda::{}: the products read {} activation rows; the quantized activations hold {}", what, rows,
           q->n_tokens);
  }
};

__global__ void sum_splits_kernel(const float* parts, int splits, int64_t n, float* y) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float s = parts[i];
    for (int k = 1; k < splits; ++k) s += parts[k * n + i];
    y[i] = s;
  }
}

}  // namespace

const QuantTables& device_quant_tables() { return device_state().tables; }

void sum_splits(const float* parts, int splits, int64_t n, float* y, cudaStream_t s) {
  sum_splits_kernel<<<unsigned(std::min<int64_t>((n + 255) / 256, 65535)), 256, 0, s>>>(parts, splits, n, y);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

bool supported(gguf::GgmlType t) { return find_kernels(t) != nullptr; }

namespace {
// On unless SPARSEMLA_PREFILL_BLAS=0 (or set_prefill_blas(false)).
std::atomic<bool>& prefill_blas_flag() {
  static std::atomic<bool> on{env_switch("SPARSEMLA_PREFILL_BLAS") != 0};
  return on;
}
}  // namespace

bool prefill_blas_enabled() { return prefill_blas_flag().load(std::memory_order_relaxed); }
void set_prefill_blas(bool on) { prefill_blas_flag().store(on); }

// The crossovers measured on an H100 (docs/PERFORMANCE.md, session 38; bench_cuda_matmul --prefill,
// every type at 64-4096 tokens on the GLM-5 shapes): BF16 rows, read in place, win from 64 tokens
// (1.8-2.1x there); every other type, whose rows are dequantized at 83-96% of copy bandwidth, from
// 128 (1.0-1.7x there; at 64 tokens 0.65-1.2x).
int64_t blas_min_tokens(gguf::GgmlType t) { return t == gguf::GgmlType::BF16 ? 64 : kBlasMinTokensMax; }

void prefill_blas_warm_up(Stream s) {
  if (prefill_blas_enabled()) warm_up_blas(static_cast<cudaStream_t>(s));
}

void matmul_decode(const QuantMatrix& w, const float* x, int64_t n_tokens, float* y, Stream s) {
  const TypeKernels& k = kernels_for(w.type, "matmul_decode");
  const MatArgs a = checked_product(w, x, n_tokens, y, "matmul_decode");
  if (n_tokens > 0) k.decode(a, static_cast<cudaStream_t>(s));
}

void matmul_prefill(const QuantMatrix& w, const float* x, int64_t n_tokens, float* y, Stream s) {
  const TypeKernels& k = kernels_for(w.type, "matmul_prefill");
  const MatArgs a = checked_product(w, x, n_tokens, y, "matmul_prefill");
  if (n_tokens > 0) k.prefill(a, static_cast<cudaStream_t>(s));
}

namespace {

// y = W x as prefill_blas takes it: checked, with the type's bf16 rows (BF16 rows read in place).
BlasProduct blas_product(const QuantMatrix& w, const float* x, int64_t n_tokens, float* y, const char* op) {
  const TypeKernels& k = kernels_for(w.type, op);
  return {checked_product(w, x, n_tokens, y, op), k.to_bf16, w.type == gguf::GgmlType::BF16 && w.row_bytes % 16 == 0};
}

}  // namespace

bool matmul_prefill_blas(const QuantMatrix& w, const float* x, int64_t n_tokens, float* y, Stream s,
                         int64_t chunk_rows) {
  const BlasProduct p = blas_product(w, x, n_tokens, y, "matmul_prefill_blas");
  if (chunk_rows < 0) fail("cuda::matmul_prefill_blas: negative chunk of {} rows", chunk_rows);
  return prefill_blas_many(&p, 1, static_cast<cudaStream_t>(s), chunk_rows);
}

bool matmul_f32_blas(const QuantMatrix& w, const float* x, int64_t n_tokens, float* y, Stream s) {
  const MatArgs a = checked_product(w, x, n_tokens, y, "matmul_f32_blas");
  return w.type == gguf::GgmlType::F32 && prefill_blas_f32(a, static_cast<cudaStream_t>(s));
}

bool mma_decode_supported(gguf::GgmlType t) { return t == gguf::GgmlType::Q4_K || t == gguf::GgmlType::Q6_K; }

void matmul_decode_mma(const QuantMatrix& w, const float* x, int64_t n_tokens, float* y, Stream s) {
  if (!mma_decode_supported(w.type))
    fail("cuda::matmul_decode_mma: no tensor-core decode kernel for {} (q4_K and q6_K have one)",
         gguf::type_name(w.type));
  const MatArgs a = checked_product(w, x, n_tokens, y, "matmul_decode_mma");
  if (n_tokens > 0) launch_gemv_mma(w.type, a, static_cast<cudaStream_t>(s));
}

int64_t mma_min_tokens(gguf::GgmlType t) {
  if (t == gguf::GgmlType::Q4_K) return 2;
  if (t == gguf::GgmlType::Q6_K) return 3;
  return kDecodeMaxTokens + 1;
}

bool mma_one_token_supported(gguf::GgmlType t) { return t == gguf::GgmlType::Q4_K; }

bool mma_one_token_takes(const QuantMatrix& w) {
  return mma_one_token_supported(w.type) && w.n_cols <= kOneTokenMaxCols;
}

void matmul_decode_mma_one(const QuantMatrix& w, const float* x, float* y, Stream s) {
  if (!mma_one_token_supported(w.type))
    fail("cuda::matmul_decode_mma_one: no one-token tensor-core kernel for {} (q4_K has one)", gguf::type_name(w.type));
  const MatArgs a = checked_product(w, x, 1, y, "matmul_decode_mma_one");
  launch_gemv_mma_one(w.type, a, static_cast<cudaStream_t>(s));
}

void matmul(const QuantMatrix& w, const float* x, int64_t n_tokens, float* y, Stream s) {
  if (n_tokens == 1 && mma_one_token_takes(w))
    matmul_decode_mma_one(w, x, y, s);
  else if (n_tokens >= mma_min_tokens(w.type) && n_tokens <= kDecodeMaxTokens)
    matmul_decode_mma(w, x, n_tokens, y, s);
  else if (n_tokens <= kDecodeMaxTokens)
    matmul_decode(w, x, n_tokens, y, s);
  else if (n_tokens < blas_min_tokens(w.type) || !prefill_blas_enabled() || !matmul_prefill_blas(w, x, n_tokens, y, s))
    matmul_prefill(w, x, n_tokens, y, s);
}

namespace {

bool same_shape(const QuantMatrix& a, const QuantMatrix& b) {
  return a.type == b.type && a.n_rows == b.n_rows && a.n_cols == b.n_cols && a.row_bytes == b.row_bytes;
}

static_assert(kMaxProducts == MatArgs::kMaxMore + 1, "matmul_many's products fit one launch");

// a with b's product (checked as a's: same activations, type and columns) added to its launch.
MatArgs with_product(MatArgs a, const MatArgs& b) {
  if (a.n_more == MatArgs::kMaxMore) fail("cuda: at most {} products in one launch", MatArgs::kMaxMore + 1);
  a.more[a.n_more++] = {b.w, b.y, b.n_rows, b.row_bytes, b.shared_w};
  return a;
}

}  // namespace

void matmul_many(const QuantMatrix* w, float* const* y, int n, const float* x, int64_t n_tokens, Stream s,
                 bool precise) {
  if (n < 0 || n > kMaxProducts) fail("cuda::matmul_many: {} products (at most {})", n, kMaxProducts);
  auto alone = [&](int i) {
    if (precise) matmul_decode(w[i], x, n_tokens, y[i], s);
    else matmul(w[i], x, n_tokens, y[i], s);
  };
  bool done[kMaxProducts] = {};
  // At prefill sizes, the products that take cuBLAS (matmul: blas_min_tokens) share one bf16
  // rounding of x: each the bits of matmul alone.
  if (!precise && n_tokens > kDecodeMaxTokens && n > 1 && prefill_blas_enabled()) {
    BlasProduct p[kMaxProducts];
    int idx[kMaxProducts], nb = 0;
    for (int i = 0; i < n; ++i)
      if (n_tokens >= blas_min_tokens(w[i].type) && (nb == 0 || w[i].n_cols == p[0].a.n_cols)) {
        p[nb] = blas_product(w[i], x, n_tokens, y[i], "matmul_many");
        idx[nb++] = i;
      }
    if (nb > 1 && prefill_blas_many(p, nb, static_cast<cudaStream_t>(s)))
      for (int j = 0; j < nb; ++j) done[idx[j]] = true;
  }
  for (int i = 0; i < n; ++i) {
    if (done[i]) continue;
    done[i] = true;
    // At one token, the later products of w[i]'s type and columns join its launch.
    MatArgs a;
    int joined = 0;
    for (int j = i + 1; j < n && n_tokens == 1; ++j) {
      if (done[j] || w[j].type != w[i].type || w[j].n_cols != w[i].n_cols) continue;
      if (joined == 0) a = checked_product(w[i], x, 1, y[i], "matmul_many");
      a = with_product(a, checked_product(w[j], x, 1, y[j], "matmul_many"));
      done[j] = true;
      ++joined;
    }
    if (joined == 0) {
      alone(i);
      continue;
    }
    if (!precise && mma_one_token_takes(w[i])) launch_gemv_mma_one(w[i].type, a, static_cast<cudaStream_t>(s));
    else kernels_for(w[i].type, "matmul_many").decode(a, static_cast<cudaStream_t>(s));
  }
}

void matmul_many_q8(const QuantMatrix* w, float* const* y, int n, const Q8Activations& x, Stream s,
                    bool one_token_kernel) {
  if (n < 0 || n > kMaxProducts) fail("cuda::matmul_many_q8: {} products (at most {})", n, kMaxProducts);
  const Input in{nullptr, &x};
  bool done[kMaxProducts] = {};
  for (int i = 0; i < n; ++i) {
    if (done[i]) continue;
    done[i] = true;
    MatArgs a = in.args(w[i], x.n_tokens, y[i], "matmul_many_q8");
    // At one token, the later products of w[i]'s type and columns join its launch.
    for (int j = i + 1; j < n && x.n_tokens == 1; ++j) {
      if (done[j] || w[j].type != w[i].type || w[j].n_cols != w[i].n_cols) continue;
      a = with_product(a, in.args(w[j], 1, y[j], "matmul_many_q8"));
      done[j] = true;
    }
    if (a.n_tokens == 0) continue;
    if (one_token_kernel && a.n_tokens == 1 && q8_one_token_supported(w[i].type))
      launch_q8_one(w[i].type, a, static_cast<cudaStream_t>(s));
    else
      launch_q8(w[i].type, a, static_cast<cudaStream_t>(s));
  }
}

void matmul_decode_q8(const QuantMatrix& w, const Q8Activations& x, float* y, Stream s, bool one_token_kernel) {
  matmul_many_q8(&w, &y, 1, x, s, one_token_kernel);
}

void matmul_pair(const QuantMatrix& w1, const QuantMatrix& w2, const float* x, int64_t n_tokens, float* y1, float* y2,
                 Stream s, bool precise) {
  const QuantMatrix w[2] = {w1, w2};
  float* const y[2] = {y1, y2};
  matmul_many(w, y, 2, x, n_tokens, s, precise);
}

namespace {

// The expert entry points' decode kernel: the tensor-core one when asked for and the type has it.
void launch_decode(const TypeKernels& k, const MatArgs& a, bool tensor_cores, Stream s) {
  if (tensor_cores && mma_decode_supported(k.type)) launch_gemv_mma(k.type, a, static_cast<cudaStream_t>(s));
  else k.decode(a, static_cast<cudaStream_t>(s));
}

}  // namespace

namespace {

// `shared`: the shared expert's matrix run as pair n_pairs (null: none), from activation row x_row.
MatArgs expert_args(const QuantMatrix& w, int64_t rows_per_expert, const int32_t* expert_ids, int64_t n_pairs,
                    const Input& x, int64_t x_div, float* y, ExpertKernel kernel, const char* op,
                    const QuantMatrix* shared = nullptr, int64_t x_row = 0) {
  if (kernel == ExpertKernel::kOneToken && !x.q && !mma_one_token_supported(w.type))
    fail("cuda::{}: no one-token tensor-core kernel for {} (q4_K has one)", op, gguf::type_name(w.type));
  if (rows_per_expert <= 0 || w.n_rows % rows_per_expert != 0)
    fail("cuda::{}: {} rows are not whole experts of {} rows", op, w.n_rows, rows_per_expert);
  if (x_div <= 0) fail("cuda::{}: x_div must be > 0, got {}", op, x_div);
  const int64_t grid_rows = n_pairs + (shared ? 1 : 0);
  if (n_pairs < 0 || grid_rows > 65535) fail("cuda::{}: {} pairs (at most 65535 per call)", op, grid_rows);
  MatArgs a = x.args(w, grid_rows, y, op);
  x.check_rows((n_pairs + x_div - 1) / x_div, op);
  a.n_rows = rows_per_expert;
  a.expert_ids = expert_ids;
  a.x_div = x_div;
  if (shared) {
    if (!expert_shaped(w, rows_per_expert, *shared))
      fail("cuda::{}: the shared expert ({} x {} {}) is not of the experts' shape ({} x {} {})", op, shared->n_rows,
           shared->n_cols, gguf::type_name(shared->type), rows_per_expert, w.n_cols, gguf::type_name(w.type));
    if (x_row < 0) fail("cuda::{}: the shared expert's activation row {} < 0", op, x_row);
    x.check_rows(x_row + 1, op);
    a.shared_w = x.args(*shared, 1, y, op).w;
    a.shared_pair = n_pairs;
    a.shared_x_row = x_row;
  }
  return a;
}

void launch_experts(const TypeKernels& k, const MatArgs& a, ExpertKernel kernel, Stream s) {
  if (a.n_tokens == 0) return;
  if (a.xq && kernel == ExpertKernel::kOneToken && q8_one_token_supported(k.type))
    launch_q8_one(k.type, a, static_cast<cudaStream_t>(s));
  else if (a.xq) launch_q8(k.type, a, static_cast<cudaStream_t>(s));
  else if (kernel == ExpertKernel::kOneToken) launch_gemv_mma_one(k.type, a, static_cast<cudaStream_t>(s));
  else launch_decode(k, a, kernel == ExpertKernel::kTensorCores, s);
}

}  // namespace

bool expert_shaped(const QuantMatrix& experts, int64_t rows_per_expert, const QuantMatrix& m) {
  return m.type == experts.type && m.n_cols == experts.n_cols && m.n_rows == rows_per_expert &&
         m.row_bytes == experts.row_bytes;
}

namespace {

void experts_one(const QuantMatrix& w, int64_t rows_per_expert, const int32_t* expert_ids, int64_t n_pairs,
                 const Input& x, int64_t x_div, float* y, Stream s, ExpertKernel kernel, const SharedPair* shared,
                 const char* op) {
  const TypeKernels& k = kernels_for(w.type, op);
  if (shared && (!shared->w || shared->w2)) fail("cuda::{}: a shared expert is one matrix (SharedPair::w)", op);
  launch_experts(k,
                 expert_args(w, rows_per_expert, expert_ids, n_pairs, x, x_div, y, kernel, op,
                             shared ? shared->w : nullptr, shared ? shared->x_row : 0),
                 kernel, s);
}

void experts_pair(const QuantMatrix& w1, const QuantMatrix& w2, int64_t rows_per_expert, const int32_t* expert_ids,
                  int64_t n_pairs, const Input& x, int64_t x_div, float* y1, float* y2, Stream s, ExpertKernel kernel,
                  const SharedPair* shared, const char* op) {
  if (shared && (!shared->w || !shared->w2)) fail("cuda::{}: a shared expert pair has two matrices (w, w2)", op);
  if ((!x.q && kernel == ExpertKernel::kTensorCores) || !same_shape(w1, w2)) {
    const SharedPair s1{shared ? shared->w : nullptr, nullptr, shared ? shared->x_row : 0};
    const SharedPair s2{shared ? shared->w2 : nullptr, nullptr, s1.x_row};
    experts_one(w1, rows_per_expert, expert_ids, n_pairs, x, x_div, y1, s, kernel, shared ? &s1 : nullptr, op);
    experts_one(w2, rows_per_expert, expert_ids, n_pairs, x, x_div, y2, s, kernel, shared ? &s2 : nullptr, op);
    return;
  }
  const TypeKernels& k = kernels_for(w1.type, op);
  const int64_t x_row = shared ? shared->x_row : 0;
  const MatArgs a = expert_args(w1, rows_per_expert, expert_ids, n_pairs, x, x_div, y1, kernel, op,
                                shared ? shared->w : nullptr, x_row);
  launch_experts(k,
                 with_product(a, expert_args(w2, rows_per_expert, expert_ids, n_pairs, x, x_div, y2, kernel, op,
                                             shared ? shared->w2 : nullptr, x_row)),
                 kernel, s);
}

}  // namespace

void matmul_experts(const QuantMatrix& w, int64_t rows_per_expert, const int32_t* expert_ids, int64_t n_pairs,
                    const float* x, int64_t x_div, float* y, Stream s, ExpertKernel kernel, const SharedPair* shared) {
  experts_one(w, rows_per_expert, expert_ids, n_pairs, Input{x, nullptr}, x_div, y, s, kernel, shared,
              "matmul_experts");
}

void matmul_experts_pair(const QuantMatrix& w1, const QuantMatrix& w2, int64_t rows_per_expert,
                         const int32_t* expert_ids, int64_t n_pairs, const float* x, int64_t x_div, float* y1,
                         float* y2, Stream s, ExpertKernel kernel, const SharedPair* shared) {
  experts_pair(w1, w2, rows_per_expert, expert_ids, n_pairs, Input{x, nullptr}, x_div, y1, y2, s, kernel, shared,
               "matmul_experts_pair");
}

// (On quantized activations kOneToken asks for the one-token int8 kernel where the type has one.)
void matmul_experts_q8(const QuantMatrix& w, int64_t rows_per_expert, const int32_t* expert_ids, int64_t n_pairs,
                       const Q8Activations& x, int64_t x_div, float* y, Stream s, const SharedPair* shared,
                       bool one_token_kernel) {
  experts_one(w, rows_per_expert, expert_ids, n_pairs, Input{nullptr, &x}, x_div, y, s,
              one_token_kernel ? ExpertKernel::kOneToken : ExpertKernel::kFp32, shared, "matmul_experts_q8");
}

void matmul_experts_pair_q8(const QuantMatrix& w1, const QuantMatrix& w2, int64_t rows_per_expert,
                            const int32_t* expert_ids, int64_t n_pairs, const Q8Activations& x, int64_t x_div,
                            float* y1, float* y2, Stream s, const SharedPair* shared, bool one_token_kernel) {
  experts_pair(w1, w2, rows_per_expert, expert_ids, n_pairs, Input{nullptr, &x}, x_div, y1, y2, s,
               one_token_kernel ? ExpertKernel::kOneToken : ExpertKernel::kFp32, shared, "matmul_experts_pair_q8");
}

namespace {

MatArgs group_args(const QuantMatrix& w, int64_t rows_per_expert, const ExpertGroups& g, const Input& x,
                   int64_t x_div, float* y, const char* op) {
  if (rows_per_expert <= 0 || w.n_rows % rows_per_expert != 0)
    fail("cuda::{}: {} rows are not whole experts of {} rows", op, w.n_rows, rows_per_expert);
  if (x_div <= 0) fail("cuda::{}: x_div must be > 0, got {}", op, x_div);
  if (!g.offsets || !g.active || !g.n_active) fail("cuda::{}: offsets, active and n_active are required", op);
  const int64_t n_experts = w.n_rows / rows_per_expert;
  if (g.max_groups < 0 || g.max_groups > std::min<int64_t>(n_experts, 65535) || g.max_slots < 0)
    fail("cuda::{}: {} groups of up to {} slots over {} experts", op, g.max_groups, g.max_slots, n_experts);
  MatArgs a = x.args(w, g.max_groups, y, op);
  a.n_rows = rows_per_expert;
  a.x_div = x_div;
  a.group_offsets = g.offsets;
  a.group_active = g.active;
  a.group_count = g.n_active;
  a.group_perm = g.perm;
  a.group_tokens_max = g.max_slots;
  return a;
}

}  // namespace

void matmul_expert_groups(const QuantMatrix& w, int64_t rows_per_expert, const ExpertGroups& g, const float* x,
                          int64_t x_div, float* y, Stream s, bool tensor_cores) {
  const TypeKernels& k = kernels_for(w.type, "matmul_expert_groups");
  const MatArgs a = group_args(w, rows_per_expert, g, Input{x}, x_div, y, "matmul_expert_groups");
  if (g.max_groups > 0 && g.max_slots > 0) launch_decode(k, a, tensor_cores, s);
}

void matmul_expert_groups_q8(const QuantMatrix& w, int64_t rows_per_expert, const ExpertGroups& g,
                             const Q8Activations& x, int64_t x_div, float* y, Stream s) {
  const MatArgs a = group_args(w, rows_per_expert, g, Input{nullptr, &x}, x_div, y, "matmul_expert_groups_q8");
  if (g.max_groups > 0 && g.max_slots > 0) launch_q8(w.type, a, static_cast<cudaStream_t>(s));
}

namespace {
std::atomic<int64_t> g_tile_launches{0};
}  // namespace

void matmul_expert_tiles(const QuantMatrix& w, const QuantMatrix* w2, int64_t rows_per_expert, const ExpertTile* tiles,
                         int64_t n_tiles, int width, const float* x, float* y, float* y2, Stream s) {
  const char* op = "matmul_expert_tiles";
  const TypeKernels& k = kernels_for(w.type, op);
  if (width != 32 && width != 64 && width != 128) fail("cuda::{}: tiles of {} tokens (32, 64 or 128)", op, width);
  if (n_tiles < 0 || n_tiles > 65535) fail("cuda::{}: {} tiles (at most 65535 per call)", op, n_tiles);
  if (rows_per_expert <= 0 || w.n_rows % rows_per_expert != 0)
    fail("cuda::{}: {} rows are not whole experts of {} rows", op, w.n_rows, rows_per_expert);
  if (n_tiles > 0 && !tiles) fail("cuda::{}: {} tiles without a tile list", op, n_tiles);
  if (w2 && !same_shape(w, *w2))
    fail("cuda::{}: the second weight ({} x {} {}) is not of the first's shape ({} x {} {})", op, w2->n_rows,
         w2->n_cols, gguf::type_name(w2->type), w.n_rows, w.n_cols, gguf::type_name(w.type));
  if (w2 && !y2) fail("cuda::{}: a second weight without its output", op);
  MatArgs a = checked_product(w, x, 0, y, op);
  a.n_rows = rows_per_expert;
  if (w2) a = with_product(a, checked_product(*w2, x, 0, y2, op));
  if (n_tiles == 0) return;
  k.prefill_groups(a, tiles, int(n_tiles), width, static_cast<cudaStream_t>(s));
  g_tile_launches.fetch_add(1);
}

int64_t expert_tile_launches() { return g_tile_launches.load(); }

void dequantize_rows(const QuantMatrix& w, const int32_t* rows, int64_t n, float* out, Stream s) {
  const TypeKernels& k = kernels_for(w.type, "dequantize_rows");
  if (n < 0 || n > INT32_MAX) fail("cuda::dequantize_rows: bad row count {}", n);
  const MatArgs a = checked_args(w, "dequantize_rows");
  if (!aligned16(out)) fail("cuda::dequantize_rows: output {} is not 16-byte aligned", static_cast<const void*>(out));
  if (n > 0) k.rows(a, rows, n, out, static_cast<cudaStream_t>(s));
}

void dequantize_bf16(const QuantMatrix& w, int64_t row0, int64_t n, void* out, Stream s) {
  const TypeKernels& k = kernels_for(w.type, "dequantize_bf16");
  const MatArgs a = checked_args(w, "dequantize_bf16");
  if (w.n_cols > INT32_MAX) fail("cuda::dequantize_bf16: {} columns (at most {})", w.n_cols, INT32_MAX);
  if (row0 < 0 || n < 0 || row0 + n > w.n_rows)
    fail("cuda::dequantize_bf16: rows [{}, {}) of a weight of {} rows", row0, row0 + n, w.n_rows);
  if (!aligned16(out)) fail("cuda::dequantize_bf16: output {} is not 16-byte aligned", out);
  if (n > 0) k.to_bf16(a, row0, n, static_cast<__nv_bfloat16*>(out), static_cast<cudaStream_t>(s));
}

}  // namespace sparsemla::cuda
