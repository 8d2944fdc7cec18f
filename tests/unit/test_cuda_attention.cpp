// The attention-side CUDA kernels (cache writes, lightning indexer, top-k, sparse MLA, absorption)
// against the CPU reference on fresh random inputs, over paged caches with shuffled block tables.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "gpu_test_util.h"
#include "mla_test_inputs.h"
#include "util/half.h"

// FP8 E4M3 conversions on the CPU are the reference for the fp8 caches: run them everywhere.
TEST(Fp8E4m3, EveryCodeRoundTripsAndRoundingIsNearestEven) {
  using namespace sparsemla;
  for (int c = 0; c < 256; ++c) {
    const uint8_t code = uint8_t(c);
    const float v = fp8_e4m3_to_f32(code);
    if (std::isnan(v)) {
      EXPECT_TRUE((c & 0x7f) == 0x7f) << c;
      continue;
    }
    if (c == 0x80) {  // -0
      EXPECT_EQ(f32_to_fp8_e4m3(v), 0x80);
      continue;
    }
    EXPECT_EQ(f32_to_fp8_e4m3(v), code) << "code " << c << " value " << v;
  }
  EXPECT_EQ(fp8_e4m3_to_f32(0x7e), 448.0f);
  EXPECT_EQ(fp8_e4m3_to_f32(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(f32_to_fp8_e4m3(1000.0f), 0x7e);   // saturates
  EXPECT_EQ(f32_to_fp8_e4m3(-1000.0f), 0xfe);
  // Halfway between 1.0 (0x38) and 1.125 (0x39): to the even code 0x38; 1.1875 -> 0x3a (1.25).
  EXPECT_EQ(f32_to_fp8_e4m3(1.0625f), 0x38);
  EXPECT_EQ(f32_to_fp8_e4m3(1.1875f), 0x3a);
  // Every midpoint between neighbouring positive codes goes to the even one; just off it, to the nearer.
  for (int c = 0; c < 0x7e; ++c) {
    const float a = fp8_e4m3_to_f32(uint8_t(c)), b = fp8_e4m3_to_f32(uint8_t(c + 1));
    const float mid = (a + b) / 2;
    EXPECT_EQ(f32_to_fp8_e4m3(mid), (c % 2 == 0) ? c : c + 1) << c;
    EXPECT_EQ(f32_to_fp8_e4m3(std::nextafter(mid, 0.0f)), c) << c;
    EXPECT_EQ(f32_to_fp8_e4m3(std::nextafter(mid, 1e9f)), c + 1) << c;
  }
}

#if SPARSEMLA_HAVE_CUDA

#include "model/blocks/indexer.h"
#include "ops/cpu/attention.h"
#include "ops/cpu/basic.h"
#include "ops/cpu/matmul.h"
#include "ops/cpu/rope.h"
#include "model/hparams.h"
#include "util/error.h"
#include "ops/cuda/attention.h"
#include "ops/cuda/attention_smem.h"
#include "ops/cuda/buffer.h"
#include "paged_test_util.h"
#include "quant_test_util.h"
#include "rope_test_util.h"

namespace sparsemla {
namespace {

using cuda::DeviceBuffer;
using cuda::KvDtype;

// Under compute-sanitizer (SPARSEMLA_GPU_TEST_SMALL=1) the largest cases are shrunk to finish in time.
bool small_mode() { return std::getenv("SPARSEMLA_GPU_TEST_SMALL") != nullptr; }

float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }
float round_f16(float x) { return fp16_to_f32(f32_to_fp16(x)); }

using cuda::test_paged::fp16_query_factor;
using cuda::test_paged::random_vec;

// The paged tables of paged_test_util.h with their device copy.
struct Paged : cuda::test_paged::Paged {
  DeviceBuffer d_tables;
  Paged(const std::vector<int>& lens, int bs, std::mt19937& rng)
      : cuda::test_paged::Paged(lens, bs, rng), d_tables(cuda::to_device(tables)) {}
  cuda::PagedRows rows(const DeviceBuffer& cache, int64_t row_bytes) const {
    return {cache.get(), row_bytes, d_tables.as<int32_t>(), max_blocks, block_size};
  }
};

// Writes fp32 rows [n_slots, n] (row per slot) into a device cache of `dtype`, through the kernel
// under test, and returns the values the GPU will read back, decoded on the CPU.
struct GpuCache {
  DeviceBuffer data;
  int64_t row_bytes = 0;
  std::vector<float> decoded;  // [n_slots, n]
};
GpuCache make_cache(const std::vector<float>& rows, int64_t n_slots, int n_fp8, int n_tail, KvDtype dtype,
                    bool latent) {
  const int n = n_fp8 + n_tail;
  GpuCache c;
  c.row_bytes = latent ? cuda::latent_row_bytes(dtype, n_fp8, n_tail) : cuda::index_key_row_bytes(dtype, n_fp8);
  c.data = DeviceBuffer(size_t(n_slots * c.row_bytes));
  c.data.zero();
  std::vector<int64_t> slots(static_cast<size_t>(n_slots));
  std::iota(slots.begin(), slots.end(), 0);
  DeviceBuffer d_rows = cuda::to_device(rows), d_slots = cuda::to_device(slots);
  if (latent)
    cuda::write_latent_rows(d_rows.as<float>(), d_slots.as<int64_t>(), n_slots, dtype, n_fp8, n_tail, c.data.get(),
                            c.row_bytes, nullptr);
  else
    cuda::write_index_keys(d_rows.as<float>(), d_slots.as<int64_t>(), n_slots, dtype, n_fp8, c.data.get(), c.row_bytes,
                           nullptr);
  const std::vector<uint8_t> bytes = cuda::to_host<uint8_t>(c.data, size_t(n_slots * c.row_bytes));
  c.decoded.resize(static_cast<size_t>(n_slots * n));
  const int groups = (n_fp8 + cuda::kFp8Group - 1) / cuda::kFp8Group;
  for (int64_t s = 0; s < n_slots; ++s) {
    const uint8_t* row = bytes.data() + s * c.row_bytes;
    float* out = c.decoded.data() + s * n;
    for (int i = 0; i < n; ++i) {
      uint16_t h;
      if (dtype == KvDtype::F32) {
        std::memcpy(&out[i], row + 4 * i, 4);
      } else if (dtype == KvDtype::BF16) {
        std::memcpy(&h, row + 2 * i, 2);
        out[i] = bf16_to_f32(h);
      } else if (i < n_fp8) {
        float scale;
        std::memcpy(&scale, row + n_fp8 + 4 * (i / cuda::kFp8Group), 4);
        out[i] = fp8_e4m3_to_f32(row[i]) * scale;
      } else {
        std::memcpy(&h, row + n_fp8 + 4 * groups + 2 * (i - n_fp8), 2);
        out[i] = bf16_to_f32(h);
      }
    }
  }
  return c;
}

TEST(CudaAttention, CacheWritesMatchTheCpuConversions) {
  SPARSEMLA_REQUIRE_GPU();
  std::mt19937 rng(1);
  for (auto [n_fp8, n_tail] : std::vector<std::pair<int, int>>{{512, 64}, {24, 8}, {256, 32}, {128, 0}, {64, 0}}) {
    const int64_t n_slots = 37;
    std::vector<float> rows = random_vec(size_t(n_slots * (n_fp8 + n_tail)), rng, 3.0f);
    rows[5] = 0.0f;
    const bool latent = n_tail > 0;
    GpuCache bf = make_cache(rows, n_slots, n_fp8, n_tail, KvDtype::BF16, latent);
    for (size_t i = 0; i < rows.size(); ++i) ASSERT_EQ(bf.decoded[i], round_bf16(rows[i])) << i;
    GpuCache f32 = make_cache(rows, n_slots, n_fp8, n_tail, KvDtype::F32, latent);
    ASSERT_EQ(f32.decoded, rows);
    GpuCache f8 = make_cache(rows, n_slots, n_fp8, n_tail, KvDtype::FP8, latent);
    const int n = n_fp8 + n_tail;
    for (int64_t s = 0; s < n_slots; ++s)
      for (int g0 = 0; g0 < n_fp8; g0 += cuda::kFp8Group) {
        const int g1 = std::min(n_fp8, g0 + cuda::kFp8Group);
        float amax = 0.0f;
        for (int i = g0; i < g1; ++i) amax = std::max(amax, std::fabs(rows[size_t(s * n + i)]));
        const float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
        for (int i = g0; i < g1; ++i)
          ASSERT_EQ(f8.decoded[size_t(s * n + i)], fp8_e4m3_to_f32(f32_to_fp8_e4m3(rows[size_t(s * n + i)] / scale)) * scale)
              << "slot " << s << " value " << i;
      }
    for (int64_t s = 0; s < n_slots; ++s)
      for (int i = n_fp8; i < n; ++i) ASSERT_EQ(f8.decoded[size_t(s * n + i)], round_bf16(rows[size_t(s * n + i)]));
  }
}

// The fused forms of the decode step (one launch each) against the CPU's norm, rope and cache
// conversions, and byte for byte against the unfused GPU chain they replace (norm kernel, rope
// kernel, cache write), so the model's numbers do not move.
using test::plain_rope;

TEST(CudaAttention, FusedCacheWritesMatchTheCpuAndTheUnfusedChain) {
  SPARSEMLA_REQUIRE_GPU();
  std::mt19937 rng(5);
  const ops::Rope rope64 = plain_rope(64, 1e6f), rope8 = plain_rope(8, 1e6f);
  struct Case {
    bool latent;
    int n_norm, rope_dims;  // latent: kv_lora, rope; keys: dim, rotary dims
    const ops::Rope* rope;
  };
  for (const Case& c : {Case{true, 512, 64, &rope64}, Case{true, 24, 8, &rope8}, Case{false, 128, 64, &rope64},
                        Case{false, 64, 64, &rope64}, Case{false, 32, 8, &rope8}})
    for (ops::RopeStyle style : {ops::RopeStyle::HalfSplit, ops::RopeStyle::Interleaved})
      for (KvDtype dtype : {KvDtype::BF16, KvDtype::FP8, KvDtype::F32}) {
        const int n = c.latent ? c.n_norm + c.rope_dims : c.n_norm;
        const int64_t T = 9, n_slots = 20;
        const std::string what = fmt::format("{} {} + {} {} {}", c.latent ? "latent" : "keys", c.n_norm, c.rope_dims,
                                             cuda::kv_dtype_name(dtype),
                                             style == ops::RopeStyle::HalfSplit ? "half split" : "interleaved");
        std::vector<float> x = random_vec(size_t(T * n), rng, 2.0f), nw = random_vec(size_t(c.n_norm), rng),
                           nb = random_vec(size_t(c.n_norm), rng, 0.3f);
        for (int i = 0; i < n; ++i) x[size_t(3 * n + i)] *= 1e-3f;  // a row of small values
        std::vector<int64_t> pos(static_cast<size_t>(T)), slots(static_cast<size_t>(T));
        for (int64_t t = 0; t < T; ++t) pos[size_t(t)] = int64_t(rng() % 150000);
        for (int64_t t = 0; t < T; ++t) slots[size_t(t)] = (t * 7 + 3) % n_slots;  // scattered, distinct
        const float eps = c.latent ? 1e-5f : 1e-6f;
        // CPU: the values each slot should hold
        std::vector<float> want(size_t(T * n));
        for (int64_t t = 0; t < T; ++t) {
          const float* xr = x.data() + t * n;
          float* wr = want.data() + t * n;
          if (c.latent) {
            ops::rms_norm(xr, nw.data(), c.n_norm, eps, wr);
            std::copy_n(xr + c.n_norm, c.rope_dims, wr + c.n_norm);
            c.rope->apply(wr + c.n_norm, pos[size_t(t)], style);
          } else {
            ops::layer_norm(xr, nw.data(), nb.data(), c.n_norm, eps, wr);
            c.rope->apply(wr, pos[size_t(t)], style);
          }
        }
        const cuda::DeviceRope drope(*c.rope);
        const int64_t row_bytes = c.latent ? cuda::latent_row_bytes(dtype, c.n_norm, c.rope_dims)
                                           : cuda::index_key_row_bytes(dtype, c.n_norm);
        DeviceBuffer d_x = cuda::to_device(x), d_w = cuda::to_device(nw), d_b = cuda::to_device(nb),
                     d_pos = cuda::to_device(pos), d_slots = cuda::to_device(slots),
                     fused(size_t(n_slots * row_bytes)), chain(size_t(n_slots * row_bytes)), tmp = cuda::to_device(x);
        fused.zero();
        chain.zero();
        const int64_t* P = d_pos.as<int64_t>();
        const int64_t* S = d_slots.as<int64_t>();
        if (c.latent) {
          cuda::write_latent_normed(d_x.as<float>(), d_w.as<float>(), eps, drope.table(style), P, S, T, dtype, c.n_norm,
                                    c.rope_dims, fused.get(), row_bytes, nullptr);
          cuda::rms_norm(tmp.as<float>(), n, d_w.as<float>(), T, c.n_norm, eps, tmp.as<float>(), n, nullptr);
          drope.apply(tmp.as<float>() + c.n_norm, T, 1, n, P, style, nullptr);
          cuda::write_latent_rows(tmp.as<float>(), S, T, dtype, c.n_norm, c.rope_dims, chain.get(), row_bytes, nullptr);
        } else {
          cuda::write_index_keys_normed(d_x.as<float>(), d_w.as<float>(), d_b.as<float>(), eps, drope.table(style), P, S,
                                        T, dtype, c.n_norm, fused.get(), row_bytes, nullptr);
          cuda::layer_norm(d_x.as<float>(), d_w.as<float>(), d_b.as<float>(), T, c.n_norm, eps, tmp.as<float>(), nullptr);
          drope.apply(tmp.as<float>(), T, 1, n, P, style, nullptr);
          cuda::write_index_keys(tmp.as<float>(), S, T, dtype, c.n_norm, chain.get(), row_bytes, nullptr);
        }
        const auto fb = cuda::to_host<uint8_t>(fused, size_t(n_slots * row_bytes));
        ASSERT_EQ(fb, cuda::to_host<uint8_t>(chain, size_t(n_slots * row_bytes))) << what << ": differs from the chain";
        // Decoded against the CPU: within the format's rounding of the CPU's value (fp8: 3 mantissa
        // bits, a step of the group's scale at the subnormals) plus the fp32 norm's few ulp.
        const int n_fp8 = c.n_norm, groups = (n_fp8 + cuda::kFp8Group - 1) / cuda::kFp8Group;
        for (int64_t t = 0; t < T; ++t) {
          const uint8_t* row = fb.data() + slots[size_t(t)] * row_bytes;
          for (int i = 0; i < n; ++i) {
            const float ref = want[size_t(t * n + i)];
            float got, tol;
            uint16_t h;
            if (dtype == KvDtype::F32) {
              std::memcpy(&got, row + 4 * i, 4);
              tol = 1e-5f * std::fabs(ref) + 1e-6f;
            } else if (dtype == KvDtype::BF16 || i >= n_fp8) {
              const int off = dtype == KvDtype::BF16 ? 2 * i : n_fp8 + 4 * groups + 2 * (i - n_fp8);
              std::memcpy(&h, row + off, 2);
              got = bf16_to_f32(h);
              tol = std::ldexp(std::fabs(ref), -8) + 1e-6f;
            } else {
              float scale;
              std::memcpy(&scale, row + n_fp8 + 4 * (i / cuda::kFp8Group), 4);
              got = fp8_e4m3_to_f32(row[i]) * scale;
              tol = std::ldexp(std::fabs(ref), -4) + std::ldexp(scale, -9) + 1e-6f;
            }
            ASSERT_LE(std::fabs(got - ref), tol) << what << ": token " << t << " value " << i;
          }
        }
      }
}

// index_queries against the CPU: rope per head (as DeviceRope::apply), the weights scaled, and the
// 16-bit copy the rotated fp32 values rounded to nearest (util/half.h); in fp16 (fp8 keys) each
// head's row scaled by fp16_query_factor and its weight by the inverse, so that queries far outside
// fp16's range (gain 1e6) or below its normal numbers (1e-7) keep their precision.
TEST(CudaAttention, IndexQueriesMatchTheCpu) {
  SPARSEMLA_REQUIRE_GPU();
  std::mt19937 rng(6);
  const ops::Rope rope = plain_rope(64, 1e4f);
  const cuda::DeviceRope drope(rope);
  for (auto [T, heads, dim] : std::vector<std::tuple<int, int, int>>{{1, 64, 128}, {5, 32, 128}, {3, 8, 64}, {2, 13, 96}})
    for (ops::RopeStyle style : {ops::RopeStyle::HalfSplit, ops::RopeStyle::Interleaved})
      for (KvDtype dtype : {KvDtype::BF16, KvDtype::FP8})
        for (float gain : {3.0f, 1e6f, 1e-7f}) {
          if (dtype == KvDtype::BF16 && gain != 3.0f) continue;
          std::vector<float> q = random_vec(size_t(T) * heads * dim, rng, gain), w = random_vec(size_t(T) * heads, rng);
          std::vector<int64_t> pos(static_cast<size_t>(T));
          for (auto& p : pos) p = int64_t(rng() % 150000);
          const float ws = 1.0f / std::sqrt(float(heads * dim));
          std::vector<float> want_q(q), want_w(w);
          for (int t = 0; t < T; ++t)
            for (int h = 0; h < heads; ++h) rope.apply(want_q.data() + (size_t(t) * heads + h) * dim, pos[size_t(t)], style);
          for (float& x : want_w) x *= ws;
          DeviceBuffer d_q = cuda::to_device(q), d_w = cuda::to_device(w), d_pos = cuda::to_device(pos),
                       d_q16(q.size() * 2);
          cuda::index_queries(d_q.as<float>(), d_w.as<float>(), T, heads, dim, drope.table(style), d_pos.as<int64_t>(), ws,
                              dtype, d_q16.as<uint16_t>(), nullptr);
          const auto got_q = cuda::to_host<float>(d_q, q.size());
          const auto got_w = cuda::to_host<float>(d_w, w.size());
          const auto got16 = cuda::to_host<uint16_t>(d_q16, q.size());
          // Each head's fp16 factor from the GPU's own rotated values (checked below against the CPU's,
          // which may differ in a last bit: at a power of two, that would move the factor).
          std::vector<float> f(w.size(), 1.0f);
          if (cuda::index_queries_fp16(dtype))
            for (size_t r = 0; r < f.size(); ++r) {
              f[r] = fp16_query_factor(got_q.data() + r * size_t(dim), dim);
              want_w[r] /= f[r];
            }
          ASSERT_EQ(got_w, want_w) << "head weights";
          for (size_t i = 0; i < q.size(); ++i) {
            ASSERT_NEAR(got_q[i], want_q[i], gain * (1e-6 * 6 + 3e-8)) << "query value " << i;
            const float scaled = got_q[i] * f[i / size_t(dim)];
            ASSERT_EQ(got16[i], cuda::index_queries_fp16(dtype) ? f32_to_fp16(scaled) : f32_to_bf16(scaled))
                << "16-bit query " << i << " (gain " << gain << ")";
            if (cuda::index_queries_fp16(dtype)) ASSERT_TRUE(std::isfinite(fp16_to_f32(got16[i]))) << "query " << i;
          }
          // Without the 16-bit copy: the same in-place queries, the weights only scaled by w_scale.
          DeviceBuffer d_q2 = cuda::to_device(q), d_w2 = cuda::to_device(w);
          cuda::index_queries(d_q2.as<float>(), d_w2.as<float>(), T, heads, dim, drope.table(style), d_pos.as<int64_t>(), ws,
                              dtype, nullptr, nullptr);
          ASSERT_EQ(cuda::to_host<float>(d_q2, q.size()), got_q);
          std::vector<float> plain_w(w);
          for (float& x : plain_w) x *= ws;
          ASSERT_EQ(cuda::to_host<float>(d_w2, w.size()), plain_w);
        }
  DeviceBuffer buf(4096), pos(8);
  EXPECT_THROW(cuda::index_queries(buf.as<float>(), buf.as<float>(), 1, 2, 32, drope.table(ops::RopeStyle::HalfSplit),
                                   pos.as<int64_t>(), 1.0f, KvDtype::BF16, nullptr, nullptr),
               Error)
      << "heads shorter than the rotary dims";
}

struct IndexerCase {
  int heads, dim;
  std::vector<int> ctx;  // per query token: its context length (tokens t share sequences round-robin)
  int n_seq;
  int block_size;
  int run = 1;  // tokens t .. t + run - 1 share a sequence (runs of the sequences in turn)
};

// The indexer's arguments for T tokens of `heads` x `dim` fp32 queries and head weights, scoring into
// rows of max_ctx scores.
cuda::IndexerArgs indexer_args(const DeviceBuffer& q, const DeviceBuffer& w, int T, int heads, int dim,
                               const DeviceBuffer& seq, const DeviceBuffer& n_ctx, int64_t max_ctx,
                               cuda::PagedRows keys, KvDtype dtype, DeviceBuffer& scores) {
  cuda::IndexerArgs a;
  a.q = q.as<float>();
  a.w = w.as<float>();
  a.T = T;
  a.heads = heads;
  a.dim = dim;
  a.seq = seq.as<int32_t>();
  a.n_ctx = n_ctx.as<int32_t>();
  a.max_ctx = max_ctx;
  a.keys = keys;
  a.dtype = dtype;
  a.scores = scores.as<float>();
  a.score_stride = max_ctx;
  return a;
}

// The mma indexer's kernels, each asked for by name (regs: bf16 keys only; others fall back to staged).
const std::vector<cuda::IndexerMma> kMmaKernels = {cuda::IndexerMma::kRegs, cuda::IndexerMma::kStaged,
                                                     cuda::IndexerMma::kQfrag, cuda::IndexerMma::kTokens};

// GPU scores vs model::indexer_score on the values the GPU reads (keys decoded from the cache; the
// mma kernel also rounds q to bf16, or to fp16 for fp8 keys).
// mma: IndexerArgs::mma, the mma kernel (kAuto: the default choice). The tokens kernel, where it
// runs, also gives the qfrag kernel's scores bit for bit (it keeps their sums).
void check_indexer(const IndexerCase& c, KvDtype dtype, cuda::IndexerKernel kernel, std::mt19937& rng,
                   cuda::IndexerMma mma = cuda::IndexerMma::kAuto) {
  const int T = int(c.ctx.size());
  std::vector<int> lens(size_t(c.n_seq), 1);
  std::vector<int32_t> seq(static_cast<size_t>(T)), n_ctx(static_cast<size_t>(T));
  for (int t = 0; t < T; ++t) {
    seq[size_t(t)] = t / c.run % c.n_seq;
    n_ctx[size_t(t)] = c.ctx[size_t(t)];
    lens[size_t(seq[size_t(t)])] = std::max(lens[size_t(seq[size_t(t)])], c.ctx[size_t(t)]);
  }
  Paged pg(lens, c.block_size, rng);
  std::vector<float> keys = random_vec(size_t(pg.n_slots() * c.dim), rng);
  GpuCache cache = make_cache(keys, pg.n_slots(), c.dim, 0, dtype, false);
  std::vector<float> q = random_vec(size_t(T) * c.heads * c.dim, rng), w = random_vec(size_t(T) * c.heads, rng, 0.1f);
  const int64_t max_ctx = *std::max_element(n_ctx.begin(), n_ctx.end());
  DeviceBuffer d_q = cuda::to_device(q), d_w = cuda::to_device(w), d_seq = cuda::to_device(seq),
               d_n = cuda::to_device(n_ctx), d_scores(size_t(T * max_ctx) * 4);
  cuda::IndexerArgs a =
      indexer_args(d_q, d_w, T, c.heads, c.dim, d_seq, d_n, max_ctx, pg.rows(cache.data, cache.row_bytes), dtype, d_scores);
  a.mma = mma;
  cuda::indexer_scores(a, kernel, nullptr);
  const std::vector<float> got = cuda::to_host<float>(d_scores, size_t(T * max_ctx));
  cuda::IndexerArgs aq = a;
  aq.mma = cuda::IndexerMma::kQfrag;
  if (kernel == cuda::IndexerKernel::Mma && cuda::indexer_mma_choice(a) == cuda::IndexerMma::kTokens &&
      cuda::indexer_mma_choice(aq) == cuda::IndexerMma::kQfrag) {  // (qfrag: fp8 keys in pages of whole tiles only)
    DeviceBuffer d_qfrag(size_t(T * max_ctx) * 4);
    aq.scores = d_qfrag.as<float>();
    cuda::indexer_scores(aq, kernel, nullptr);
    const std::vector<float> qfrag = cuda::to_host<float>(d_qfrag, size_t(T * max_ctx));
    for (int t = 0; t < T; ++t)
      for (int p = 0; p < n_ctx[size_t(t)]; ++p)
        ASSERT_EQ(got[size_t(t * max_ctx + p)], qfrag[size_t(t * max_ctx + p)])
            << "tokens kernel against qfrag: token " << t << " position " << p;
  }
  std::vector<float> qr = q;
  if (kernel == cuda::IndexerKernel::Mma)
    for (float& x : qr) x = dtype == KvDtype::BF16 ? round_bf16(x) : round_f16(x);
  if (kernel == cuda::IndexerKernel::Mma) {
    // The queries handed over already rounded (IndexerArgs::q16, rounded here on the host): the same
    // scores, bit for bit, without q being read.
    std::vector<uint16_t> q16(q.size());
    for (size_t i = 0; i < q.size(); ++i)
      q16[i] = cuda::index_queries_fp16(dtype) ? f32_to_fp16(q[i]) : f32_to_bf16(q[i]);
    DeviceBuffer d_q16 = cuda::to_device(q16), d_scores16(size_t(T * max_ctx) * 4);
    cuda::IndexerArgs a16 = a;
    a16.q = nullptr;
    a16.q16 = d_q16.as<uint16_t>();
    a16.scores = d_scores16.as<float>();
    cuda::indexer_scores(a16, kernel, nullptr);
    const std::vector<float> got16 = cuda::to_host<float>(d_scores16, size_t(T * max_ctx));
    for (int t = 0; t < T; ++t)
      for (int p = 0; p < n_ctx[size_t(t)]; ++p)
        ASSERT_EQ(got16[size_t(t * max_ctx + p)], got[size_t(t * max_ctx + p)])
            << "16-bit queries: token " << t << " position " << p;
  }
  // Error relative to the size of the terms summed, inside the dot products too: sum_h |w_h|
  // sum_i |q_hi k_i| (fp32 sums in another order differ by a few ulps of that; a dot product that
  // nearly cancels is only as exact as its terms).
  std::vector<float> w_abs(w), q_abs(qr), k_abs(size_t(c.dim));
  for (float& x : w_abs) x = std::fabs(x);
  for (float& x : q_abs) x = std::fabs(x);
  double worst = 0;
  for (int t = 0; t < T; ++t) {
    for (int p = 0; p < n_ctx[size_t(t)]; ++p) {
      const float* key = cache.decoded.data() + pg.slot(seq[size_t(t)], p) * c.dim;
      const float* qt = qr.data() + size_t(t) * c.heads * c.dim;
      for (int i = 0; i < c.dim; ++i) k_abs[size_t(i)] = std::fabs(key[i]);
      const float ref = model::indexer_score(qt, w.data() + size_t(t) * c.heads, key, c.heads, c.dim);
      const float mag = model::indexer_score(q_abs.data() + size_t(t) * c.heads * c.dim, w_abs.data() + size_t(t) * c.heads,
                                             k_abs.data(), c.heads, c.dim);
      const float g = got[size_t(t * max_ctx + p)];
      const double err = std::fabs(g - ref) / std::max(mag, 1e-6f);
      worst = std::max(worst, err);
      ASSERT_LE(err, 2e-5) << "token " << t << " position " << p << ": gpu " << g << " cpu " << ref;
    }
  }
  std::printf("  indexer %s %s heads %d dim %d: max error %.2e of the summed terms\n",
              kernel == cuda::IndexerKernel::Mma ? cuda::indexer_mma_name(cuda::indexer_mma_choice(a)) : "fma",
              cuda::kv_dtype_name(dtype), c.heads, c.dim, worst);
}

const std::vector<IndexerCase> kIndexerCases = {
    {64, 128, {1, 63, 64, 65, 1000, 4097}, 3, 64},  // GLM-5 / DeepSeek-V3.2
    {32, 128, {300, 17}, 2, 16},                    // 32 heads (tensor parallel halves)
    {32, 128, {5000, 130}, 2, 128},                 // pages larger than a tile
    {32, 128, {700, 3}, 1, 2},                      // pages too small for 16-byte fp8 runs
    {8, 64, {1, 12, 30}, 1, 16},                    // the fixtures' shape
    {16, 64, {5, 33}, 2, 4},
    {4, 64, {20}, 1, 16},
    {80, 128, {1, 700}, 2, 64},                     // more heads than a warp holds: chunks of 64
    {128, 64, {130}, 1, 16},
    {16, 128, {300, 64}, 2, 64},                    // one m-tile of heads per warp
    {24, 64, {200, 129}, 1, 128},                   // padding heads, dim 64 (fp8 rows of 68 bytes)
};

// Which mma kernel the indexer takes (host logic only: no GPU, no memory read), as measured and
// documented in indexer_mma_choice: qfrag for bf16 keys of up to 64 heads and fp8 keys of up to 32
// in pages of whole tiles, else staged; a kernel asked for on a shape it does not take falls back.
TEST(CudaAttention, IndexerMmaChoiceFollowsTheShape) {
  alignas(16) static uint8_t fake[64];
  auto args = [&](int heads, KvDtype d, int block_size, int64_t row_bytes, cuda::IndexerMma asked) {
    cuda::IndexerArgs a;
    a.heads = heads;
    a.dim = 128;
    a.dtype = d;
    a.q16 = reinterpret_cast<const uint16_t*>(fake);
    a.keys.data = fake;
    a.keys.block_size = block_size;
    a.keys.row_bytes = row_bytes;
    a.mma = asked;
    return cuda::indexer_mma_choice(a);
  };
  using M = cuda::IndexerMma;
  const KvDtype bf = KvDtype::BF16, f8 = KvDtype::FP8;
  if (std::getenv("SPARSEMLA_INDEXER_MMA")) GTEST_SKIP() << "SPARSEMLA_INDEXER_MMA overrides the default choice";
  EXPECT_EQ(args(32, bf, 64, 256, M::kAuto), M::kQfrag);   // GLM-5
  EXPECT_EQ(args(64, bf, 64, 256, M::kAuto), M::kQfrag);   // DeepSeek-V3.2
  EXPECT_EQ(args(80, bf, 64, 256, M::kAuto), M::kStaged);  // more heads than qfrag holds
  EXPECT_EQ(args(32, f8, 64, 132, M::kAuto), M::kQfrag);
  EXPECT_EQ(args(32, f8, 256, 132, M::kAuto), M::kQfrag);
  EXPECT_EQ(args(64, f8, 64, 132, M::kAuto), M::kStaged);  // the staged kernel widens each key once
  EXPECT_EQ(args(32, f8, 16, 132, M::kAuto), M::kStaged);  // pages smaller than a tile
  EXPECT_EQ(args(32, f8, 16, 132, M::kQfrag), M::kStaged);
  EXPECT_EQ(args(64, f8, 64, 132, M::kQfrag), M::kQfrag);
  EXPECT_EQ(args(64, bf, 64, 256, M::kRegs), M::kRegs);
  EXPECT_EQ(args(64, f8, 64, 132, M::kRegs), M::kStaged);  // regs: bf16 keys only
  EXPECT_EQ(args(80, bf, 64, 256, M::kRegs), M::kStaged);
  EXPECT_EQ(args(32, bf, 64, 264, M::kAuto), M::kStaged);  // padded rows
  EXPECT_EQ(args(64, bf, 64, 256, M::kStaged), M::kStaged);
}

TEST(CudaAttention, IndexerScoresMatchTheCpuReference) {
  SPARSEMLA_REQUIRE_GPU();
  std::mt19937 rng(2);
  for (const IndexerCase& c : kIndexerCases)
    for (KvDtype d : {KvDtype::BF16, KvDtype::FP8})
      for (cuda::IndexerKernel k : {cuda::IndexerKernel::Mma, cuda::IndexerKernel::Fma}) check_indexer(c, d, k, rng);
  // Each mma kernel asked for by name, on both key formats: regs takes bf16 keys of up to 64 heads,
  // qfrag up to 64 heads (fp8 keys in pages of a multiple of 64 slots); the other cases fall back
  // to the staged kernel.
  for (const IndexerCase& c : kIndexerCases)
    for (KvDtype d : {KvDtype::BF16, KvDtype::FP8})
      for (cuda::IndexerMma b : kMmaKernels) check_indexer(c, d, cuda::IndexerKernel::Mma, rng, b);
  // f32 keys (the reference format: fma only), and shapes only the fma kernel takes.
  for (const IndexerCase& c : kIndexerCases) check_indexer(c, KvDtype::F32, cuda::IndexerKernel::Fma, rng);
  check_indexer({6, 40, {9, 70}, 2, 16}, KvDtype::BF16, cuda::IndexerKernel::Fma, rng);
  check_indexer({3, 96, {50}, 1, 8}, KvDtype::FP8, cuda::IndexerKernel::Fma, rng);
}

// The model's way to the mma indexer against fp8 keys (index_queries' scaled fp16 queries, then
// indexer_scores on them) with queries far above fp16's range (gain 1e6: unscaled, every 16-bit
// query would be inf and the scores NaN) and far below its normal numbers (1e-7: most would round
// to zero or subnormals): every mma kernel within check_indexer's bound of the CPU scores on the
// fp32 queries as the GPU rounds them (each head's row rounded to fp16 at its factor).
TEST(CudaAttention, IndexerTakesQueriesOfAnyRange) {
  SPARSEMLA_REQUIRE_GPU();
  std::mt19937 rng(47);
  const ops::Rope rope = plain_rope(64, 1e4f);
  const cuda::DeviceRope drope(rope);
  for (const IndexerCase& c : {IndexerCase{64, 128, {1, 300}, 2, 64}, IndexerCase{32, 128, {700, 3}, 1, 2},
                               IndexerCase{32, 128, {150}, 1, 64, 1}})
    for (float gain : {1e6f, 1e-7f})
      for (cuda::IndexerMma b : kMmaKernels) {
        const int T = int(c.ctx.size());
        std::vector<int> lens(size_t(c.n_seq), 1);
        std::vector<int32_t> seq(static_cast<size_t>(T)), n_ctx(static_cast<size_t>(T));
        std::vector<int64_t> pos(static_cast<size_t>(T));
        for (int t = 0; t < T; ++t) {
          seq[size_t(t)] = t % c.n_seq;
          n_ctx[size_t(t)] = c.ctx[size_t(t)];
          pos[size_t(t)] = c.ctx[size_t(t)] - 1;
          lens[size_t(seq[size_t(t)])] = std::max(lens[size_t(seq[size_t(t)])], c.ctx[size_t(t)]);
        }
        Paged pg(lens, c.block_size, rng);
        std::vector<float> keys = random_vec(size_t(pg.n_slots() * c.dim), rng);
        GpuCache cache = make_cache(keys, pg.n_slots(), c.dim, 0, KvDtype::FP8, false);
        const size_t nq = size_t(T) * c.heads * c.dim;
        std::vector<float> q = random_vec(nq, rng, gain), w = random_vec(size_t(T) * c.heads, rng, 0.1f);
        const int64_t max_ctx = *std::max_element(n_ctx.begin(), n_ctx.end());
        const float ws = 1.0f / std::sqrt(float(c.heads * c.dim));
        DeviceBuffer d_q = cuda::to_device(q), d_w = cuda::to_device(w), d_pos = cuda::to_device(pos),
                     d_q16(nq * 2), d_seq = cuda::to_device(seq), d_n = cuda::to_device(n_ctx),
                     d_scores(size_t(T * max_ctx) * 4);
        cuda::index_queries(d_q.as<float>(), d_w.as<float>(), T, c.heads, c.dim, drope.table(ops::RopeStyle::HalfSplit),
                            d_pos.as<int64_t>(), ws, KvDtype::FP8, d_q16.as<uint16_t>(), nullptr);
        cuda::IndexerArgs a = indexer_args(d_q, d_w, T, c.heads, c.dim, d_seq, d_n, max_ctx,
                                           pg.rows(cache.data, cache.row_bytes), KvDtype::FP8, d_scores);
        a.q = nullptr;
        a.q16 = d_q16.as<uint16_t>();
        a.mma = b;
        cuda::indexer_scores(a, cuda::IndexerKernel::Mma, nullptr);
        const std::vector<float> got = cuda::to_host<float>(d_scores, size_t(T * max_ctx));
        // The reference: the rotated fp32 queries (IndexQueriesMatchTheCpu checks them) rounded to
        // fp16 at each head's factor, the weights scaled by w_scale.
        std::vector<float> qr = cuda::to_host<float>(d_q, nq);
        for (size_t r = 0; r < size_t(T) * c.heads; ++r) {
          float* row = qr.data() + r * size_t(c.dim);
          const float f = fp16_query_factor(row, c.dim);
          for (int i = 0; i < c.dim; ++i) row[i] = round_f16(row[i] * f) / f;
        }
        for (float& x : w) x *= ws;
        std::vector<float> w_abs(w), q_abs(qr), k_abs(size_t(c.dim));
        for (float& x : w_abs) x = std::fabs(x);
        for (float& x : q_abs) x = std::fabs(x);
        for (int t = 0; t < T; ++t)
          for (int p = 0; p < n_ctx[size_t(t)]; ++p) {
            const float* key = cache.decoded.data() + pg.slot(seq[size_t(t)], p) * c.dim;
            for (int i = 0; i < c.dim; ++i) k_abs[size_t(i)] = std::fabs(key[i]);
            const size_t qo = size_t(t) * c.heads * c.dim, wo = size_t(t) * c.heads;
            const float ref = model::indexer_score(qr.data() + qo, w.data() + wo, key, c.heads, c.dim);
            const float mag = model::indexer_score(q_abs.data() + qo, w_abs.data() + wo, k_abs.data(), c.heads, c.dim);
            const float g = got[size_t(t * max_ctx + p)];
            ASSERT_TRUE(std::isfinite(g)) << cuda::indexer_mma_name(cuda::indexer_mma_choice(a)) << " gain " << gain;
            ASSERT_LE(std::fabs(g - ref), 2e-5 * mag)
                << cuda::indexer_mma_name(cuda::indexer_mma_choice(a)) << " gain " << gain << ": token " << t
                << " position " << p << ": gpu " << g << " cpu " << ref;
            ASSERT_GT(mag, 0.0f) << "the scores are not all zero";
          }
      }
}

// The tokens kernel on a prefill's shapes: GLM-5's and DeepSeek-V3.2's indexer, 300 tokens of one
// sequence after 3,000 cached ones (the causal mask), pages of 64 and the serving cache's 16; and
// runs of 37 tokens of two sequences in turn (blocks that hold both). Within the CPU's bound, and
// the qfrag kernel's bits where qfrag takes the shape (not fp8 keys in pages of 16).
TEST(CudaAttention, IndexerTokensKernelOnAPrefill) {
  SPARSEMLA_REQUIRE_GPU();
  std::mt19937 rng(31);
  for (int heads : {32, 64})
    for (KvDtype d : {KvDtype::BF16, KvDtype::FP8}) {
      for (int pages : {64, 16}) {
        IndexerCase c{heads, 128, {}, 1, pages};
        for (int t = 0; t < 300; ++t) c.ctx.push_back(3000 + t + 1);
        check_indexer(c, d, cuda::IndexerKernel::Mma, rng, cuda::IndexerMma::kTokens);
      }
    }
  IndexerCase c{32, 128, {}, 2, 64, 37};
  for (int t = 0; t < 148; ++t) c.ctx.push_back(500 + 3 * t);
  check_indexer(c, KvDtype::BF16, cuda::IndexerKernel::Mma, rng, cuda::IndexerMma::kTokens);
}

// One decode token at long context: every block streams several tiles through its stages.
TEST(CudaAttention, IndexerScoresOneLongRow) {
  SPARSEMLA_REQUIRE_GPU();
  std::mt19937 rng(12);
  const int len = small_mode() ? 30000 : 100003;
  for (KvDtype d : {KvDtype::BF16, KvDtype::FP8}) check_indexer({32, 128, {len}, 1, 64}, d, cuda::IndexerKernel::Mma, rng);
  for (KvDtype d : {KvDtype::BF16, KvDtype::FP8}) {
    for (cuda::IndexerMma b : kMmaKernels) {
      check_indexer({64, 128, {len}, 1, 64}, d, cuda::IndexerKernel::Mma, rng, b);
      // four long rows: every block streams more tiles than its ring has stages
      const int h = len / 2;
      check_indexer({64, 128, {h, h - 5, h - 64, h + 1}, 4, 64}, d, cuda::IndexerKernel::Mma, rng, b);
    }
    check_indexer({16, 128, {len}, 1, 64}, d, cuda::IndexerKernel::Mma, rng, cuda::IndexerMma::kQfrag);
  }
}

// The top-k's span (ops/cuda/topk.cu): rows of a stride over it take the span path with a workspace.
constexpr int64_t kSpanTest = 4096;

// With a workspace (`ws`), long rows take the span path (many blocks per row); without, one block
// per row. The output is poisoned first, so that an entry left unwritten shows.
std::vector<int32_t> gpu_top_k(const std::vector<float>& scores, const std::vector<int32_t>& n, int64_t stride, int k,
                               cuda::TopKWorkspace* ws) {
  const int64_t T = int64_t(n.size());
  DeviceBuffer d_s = cuda::to_device(scores), d_n = cuda::to_device(n);
  DeviceBuffer d_out = cuda::to_device(std::vector<int32_t>(size_t(T * k), -7));
  cuda::top_k(d_s.as<float>(), T, stride, d_n.as<int32_t>(), k, d_out.as<int32_t>(), nullptr, ws);
  return cuda::to_host<int32_t>(d_out, size_t(T * k));
}

void expect_selection(const std::vector<int32_t>& got, const std::vector<float>& scores, const std::vector<int32_t>& n,
                      int64_t stride, int k, const std::string& what) {
  for (size_t t = 0; t < n.size(); ++t) {
    std::vector<int32_t> ref = ops::top_k(scores.data() + t * stride, n[t], k);
    std::vector<int32_t> g(got.begin() + int64_t(t) * k, got.begin() + int64_t(t + 1) * k);
    const int64_t used = std::min<int64_t>(k, n[t]);
    for (int64_t i = used; i < k; ++i) ASSERT_EQ(g[size_t(i)], -1) << what << " row " << t;
    g.resize(static_cast<size_t>(used));
    std::sort(ref.begin(), ref.end());  // the GPU writes the selection in ascending order
    ASSERT_EQ(g, ref) << what << ": row " << t << " (n " << n[t] << ", k " << k << ")";
  }
}

// A workspace that asks for one top-k path: one block per row, the span path for long rows, or the
// team path (where the rows' blocks fit on the device at once; else the span path); `threads` per
// block of the team and block paths (0: the default).
cuda::TopKWorkspace topk_workspace(cuda::TopKPath path, int threads = 0) {
  cuda::TopKWorkspace ws;
  ws.path = path;
  ws.threads = threads;
  return ws;
}
// Every block size the team and block paths take.
const int kPathThreads[] = {256, 512, 1024};
std::string threads_name(int threads) { return std::to_string(threads) + " threads"; }

// Whether T rows of `stride` scores take the team path (one block per span of the row shifted to its
// 16-byte boundary, every block resident at once) on this device.
bool team_fits(const cuda::TopKWorkspace& ws, int64_t T, int64_t stride) {
  return T * ((stride + 3 + kSpanTest - 1) / kSpanTest) <= ws.team_blocks;
}

void expect_same_selection(const std::vector<float>& scores, const std::vector<int32_t>& n, int64_t stride, int k,
                           const char* what) {
  cuda::TopKWorkspace rows = topk_workspace(cuda::TopKPath::kRows);
  expect_selection(gpu_top_k(scores, n, stride, k, &rows), scores, n, stride, k, std::string(what) + ", rows");
  cuda::TopKWorkspace spans = topk_workspace(cuda::TopKPath::kSpans);
  expect_selection(gpu_top_k(scores, n, stride, k, &spans), scores, n, stride, k, std::string(what) + ", spans");
  for (int threads : kPathThreads) {
    const std::string th = ", " + threads_name(threads);
    cuda::TopKWorkspace team = topk_workspace(cuda::TopKPath::kTeam, threads);
    expect_selection(gpu_top_k(scores, n, stride, k, &team), scores, n, stride, k, std::string(what) + ", team" + th);
    cuda::TopKWorkspace block = topk_workspace(cuda::TopKPath::kBlock, threads);  // (rows over 16K: as kAuto)
    expect_selection(gpu_top_k(scores, n, stride, k, &block), scores, n, stride, k, std::string(what) + ", block" + th);
  }
}

// The block path (one block per row, its keys in registers: 4, 8 or 16 per thread) on strides at
// the edges of each width, odd ones so that rows start off a 16-byte boundary, over random scores,
// few levels (ties at the boundary), all equal and rising ones, rows around k, and many rows at
// once; past 16K scores a row takes another path.
TEST(CudaAttention, TopKBlockPathEqualsTheCpuSelection) {
  SPARSEMLA_REQUIRE_GPU();
  std::mt19937 rng(31);
  // The longest rows it takes: 16K - 3 (rows may start up to 3 scores past a 16-byte boundary), or
  // 16K where every row starts on one (an aligned buffer, a stride of whole 16 bytes: the model's);
  // unasked (kAuto), rows of 4 scores per thread (4K, likewise).
  const auto fits = [](int64_t stride, int64_t cap) { return stride <= cap - (stride % 4 ? 3 : 0); };
  for (int64_t stride : {int64_t(2053), int64_t(4093), int64_t(4094), int64_t(8189), int64_t(8190), int64_t(12001),
                         int64_t(16381), int64_t(16382), int64_t(16384), int64_t(16388)}) {
    const int k = 2048;
    const std::vector<int32_t> n = {int32_t(stride), k + 1, k, k - 1, 1, int32_t(stride) - 1, int32_t(stride / 2 + 3)};
    const int64_t T = int64_t(n.size());
    const std::string at = "stride " + std::to_string(stride);
    std::vector<float> s = random_vec(size_t(T * stride), rng);
    for (int kk : {k, 1, 12}) {
      for (int threads : kPathThreads) {  // (rows of 4K on each block size; longer ones on 1024 threads)
        cuda::TopKWorkspace ws = topk_workspace(cuda::TopKPath::kBlock, threads);
        expect_selection(gpu_top_k(s, n, stride, kk, &ws), s, n, stride, kk,
                         at + ", random, k " + std::to_string(kk) + ", " + threads_name(threads));
        EXPECT_EQ(ws.last_path == cuda::TopKPath::kBlock, fits(stride, 16384)) << at;
      }
      cuda::TopKWorkspace unasked = topk_workspace(cuda::TopKPath::kAuto);
      gpu_top_k(s, n, stride, kk, &unasked);
      EXPECT_EQ(unasked.last_path == cuda::TopKPath::kBlock, fits(stride, 4096)) << at << ", kAuto";
    }
    std::vector<float> lv(s.size());
    for (size_t i = 0; i < s.size(); ++i) lv[i] = std::round(s[i] * 4.0f);  // few levels: ties at every boundary
    std::vector<float> eq(s.size(), 0.0f);
    for (size_t i = 0; i < eq.size(); i += 3) eq[i] = -0.0f;
    std::vector<float> up(s.size());
    for (size_t i = 0; i < up.size(); ++i) up[i] = float(i % size_t(stride));
    for (int threads : kPathThreads) {
      cuda::TopKWorkspace ws = topk_workspace(cuda::TopKPath::kBlock, threads);
      const std::string th = ", " + threads_name(threads);
      expect_selection(gpu_top_k(lv, n, stride, k, &ws), lv, n, stride, k, at + ", ties" + th);
      expect_selection(gpu_top_k(eq, n, stride, k, &ws), eq, n, stride, k, at + ", all equal" + th);
      expect_selection(gpu_top_k(up, n, stride, k, &ws), up, n, stride, k, at + ", rising" + th);
    }
  }
  {  // many rows (a prefill chunk), causal lengths
    const int64_t T = 257, stride = 6001;
    std::vector<int32_t> n(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) n[size_t(t)] = int32_t(1 + t * (stride - 1) / (T - 1));
    std::vector<float> s = random_vec(size_t(T * stride), rng);
    cuda::TopKWorkspace ws = topk_workspace(cuda::TopKPath::kBlock);
    expect_selection(gpu_top_k(s, n, stride, 2048, &ws), s, n, stride, 2048, "many rows");
    EXPECT_EQ(ws.last_path, cuda::TopKPath::kBlock);
    cuda::TopKWorkspace counting = topk_workspace(cuda::TopKPath::kBlock);
    EXPECT_EQ(cuda::top_k_counts(s.data(), 1, stride, 2048, nullptr, &counting).hist, nullptr)
        << "the block path counts its own first digit";
  }
}

TEST(CudaAttention, TopKEqualsTheCpuSelectionIncludingTies) {
  SPARSEMLA_REQUIRE_GPU();
  std::mt19937 rng(3);
  {  // decode rows up to 200K, shorter than k, exactly k, one more than k
    const int64_t stride = small_mode() ? 20000 : 200000;
    std::vector<int32_t> n = {200000, 2047, 2048, 2049, 1, 131072, 5000};
    for (int32_t& x : n) x = std::min<int32_t>(x, int32_t(stride));
    std::vector<float> s = random_vec(size_t(stride * n.size()), rng);
    expect_same_selection(s, n, stride, 2048, "random");
  }
  {  // heavy ties: few distinct values, the boundary falls inside a run of equal scores
    const int64_t stride = 70000;
    const std::vector<int32_t> n = {70000, 3000, 9999};
    std::vector<float> s(size_t(stride * n.size()));
    std::uniform_int_distribution<int> d(-3, 3);
    for (float& x : s) x = float(d(rng));
    expect_same_selection(s, n, stride, 2048, "ties");
    expect_same_selection(s, n, stride, 12, "ties k=12");
    for (float& x : s) x = 0.0f;  // all equal: the lowest indices
    for (size_t i = 0; i < s.size(); i += 2) s[i] = -0.0f;
    expect_same_selection(s, n, stride, 100, "all zero");
  }
  {  // n around k on both paths: k - 1, k, k + 1, 2k - 1, 2k, 2k + 1; k = 1; n = 1
    const int k = 2048;
    const int64_t stride = 3 * kSpanTest;
    const std::vector<int32_t> n = {k - 1, k, k + 1, 2 * k - 1, 2 * k, 2 * k + 1, 1, 4097, 8193};
    std::vector<float> s = random_vec(size_t(stride * n.size()), rng);
    expect_same_selection(s, n, stride, k, "n near k");
    expect_same_selection(s, n, stride, 1, "n near k, k=1");
    for (float& x : s) x = std::round(x * 4.0f);  // few levels: ties at every boundary
    expect_same_selection(s, n, stride, k, "n near k, ties");
  }
  {  // rows that start off a 16-byte boundary (an odd stride), of lengths on both sides of k
    const int64_t stride = 70001;
    const std::vector<int32_t> n = {70001, 2048, 69998, 40000, 2049};
    std::vector<float> s = random_vec(size_t(stride * n.size()), rng);
    expect_same_selection(s, n, stride, 2048, "odd stride");
    for (float& x : s) x = std::round(x * 8.0f);
    expect_same_selection(s, n, stride, 2048, "odd stride, ties");
    cuda::TopKWorkspace team = topk_workspace(cuda::TopKPath::kTeam);
    gpu_top_k(s, n, stride, 2048, &team);
    EXPECT_EQ(team.last_path, team_fits(team, 5, stride) ? cuda::TopKPath::kTeam : cuda::TopKPath::kSpans);
  }
  {  // many prefill rows, causal lengths, small k as in the fixtures
    const int64_t T = 300, stride = 300;
    std::vector<int32_t> n(static_cast<size_t>(T));
    for (int t = 0; t < T; ++t) n[size_t(t)] = t + 1;
    std::vector<float> s = random_vec(size_t(T * stride), rng);
    expect_same_selection(s, n, stride, 12, "prefill k=12");
    expect_same_selection(s, n, stride, 1, "k=1");
    expect_same_selection(s, n, stride, 299, "k=299");
  }
}

void expect_one_long_row_selections(cuda::TopKWorkspace& ws);

// One decode token at long context (the span and team paths, T = 1), over score distributions that take each
// of its ways: few keys on the boundary prefix (read back by the last block), all of them equal
// (the mask taken as it is), many unequal ones on one 22-bit prefix, heavy ties at the boundary,
// and rows shorter than k. One workspace serves every call: its state must be left clean.
TEST(CudaAttention, TopKOneLongRowEqualsTheCpuSelection) {
  SPARSEMLA_REQUIRE_GPU();
  {
    SCOPED_TRACE("span path");
    cuda::TopKWorkspace ws = topk_workspace(cuda::TopKPath::kSpans);
    expect_one_long_row_selections(ws);
  }
  for (int threads : kPathThreads) {
    SCOPED_TRACE("team path, " + threads_name(threads));
    cuda::TopKWorkspace ws = topk_workspace(cuda::TopKPath::kTeam, threads);
    expect_one_long_row_selections(ws);
  }
}

void expect_one_long_row_selections(cuda::TopKWorkspace& ws) {
  std::mt19937 rng(13);
  const int k = 2048;
  auto fmt_what = [](const char* what, int n) { return std::string(what) + ", n " + std::to_string(n); };
  const std::vector<int> lens = small_mode() ? std::vector<int>{20000} : std::vector<int>{131072, 200000};
  for (int len : lens) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_real_distribution<float> unit(1.0f, 2.0f);
    std::uniform_int_distribution<int> level(-3, 3);
    const std::vector<std::pair<const char*, std::function<float(int)>>> kinds = {
        {"normal", [&](int) { return normal(rng); }},
        {"quantized normal (ties)", [&](int) { return std::round(normal(rng) * 64.0f) / 64.0f; }},
        {"uniform [1, 2) (wide boundary digit)", [&](int) { return unit(rng); }},
        {"seven levels", [&](int) { return float(level(rng)); }},
        {"all zero, signs mixed", [&](int i) { return i % 3 ? 0.0f : -0.0f; }},
        {"rising (ties none, order reversed)", [&](int i) { return float(i); }},
    };
    for (const auto& [what, gen] : kinds) {
      std::vector<float> s(static_cast<size_t>(len));
      for (int i = 0; i < len; ++i) s[size_t(i)] = gen(i);
      const std::vector<int32_t> n = {len};
      expect_selection(gpu_top_k(s, n, len, k, &ws), s, n, len, k, fmt_what(what, len));
      // A shorter row on the same stride, then a row shorter than k.
      const std::vector<int32_t> n2 = {len / 3 + 1};
      expect_selection(gpu_top_k(s, n2, len, k, &ws), s, n2, len, k, fmt_what(what, len / 3 + 1));
    }
    std::vector<float> s = random_vec(size_t(len), rng);
    const std::vector<int32_t> n_short = {k - 5};
    expect_selection(gpu_top_k(s, n_short, len, k, &ws), s, n_short, len, k, "shorter than k");
  }
  // A narrow distribution on a row of 40000: its boundary digit holds ~10000; then one so narrow
  // that every key shares its first 22 bits (the last block reads every score back).
  {
    const int len = 40000;
    std::uniform_real_distribution<float> unit(1.0f, 2.0f);
    std::vector<float> s(static_cast<size_t>(len));
    for (float& x : s) x = unit(rng);
    const std::vector<int32_t> n = {len};
    expect_selection(gpu_top_k(s, n, len, k, &ws), s, n, len, k, "uniform [1, 2), 40000");
    std::uniform_real_distribution<float> narrow(1.0f, 1.0f + 1.0f / 8192.0f);
    for (float& x : s) x = narrow(rng);
    expect_selection(gpu_top_k(s, n, len, k, &ws), s, n, len, k, "uniform [1, 1 + 2^-13), 40000");
    const bool team = ws.path == cuda::TopKPath::kTeam && team_fits(ws, 1, len);
    EXPECT_EQ(ws.last_path, team ? cuda::TopKPath::kTeam : cuda::TopKPath::kSpans);
  }
  // As the model calls it: the score stride is the cache's capacity, a little over the context (4K
  // and 128K), on random scores and on all-equal ones (a model with zero weights scores every
  // position 0).
  for (int ctx : small_mode() ? std::vector<int>{4096} : std::vector<int>{4096, 131072}) {
    const int64_t stride = ctx + 200;
    const std::vector<int32_t> n = {ctx + 17};
    std::vector<float> s = random_vec(size_t(stride), rng);
    expect_selection(gpu_top_k(s, n, stride, k, &ws), s, n, stride, k, fmt_what("model-shaped, random", n[0]));
    expect_selection(gpu_top_k(s, n, stride, k, nullptr), s, n, stride, k, fmt_what("model-shaped, rows", n[0]));
    std::fill(s.begin(), s.end(), 0.0f);
    expect_selection(gpu_top_k(s, n, stride, k, &ws), s, n, stride, k, fmt_what("model-shaped, all equal", n[0]));
  }
}

// The team path on every block size, with m keys on thr's first digit (values in [1, 1.25): one
// digit; a few repeated, so that ties fall at the boundary too), from a few hundred to more than a
// block's threads hold (4 to 16 per thread), above them k - 100 keys that are all selected and below
// them the rest. The same workspace serves two calls: its state must be left clean.
TEST(CudaAttention, TopKTeamOnManyKeysOnTheBoundaryDigit) {
  SPARSEMLA_REQUIRE_GPU();
  std::mt19937 rng(41);
  const int k = 2048, len = small_mode() ? 20000 : 131072;
  for (int m : {300, 1000, 2000, 2100, 4000, 4200, 8000, 8300, 16000}) {
    if (m + k > len) continue;
    std::vector<float> s(static_cast<size_t>(len));
    std::uniform_real_distribution<float> top(100.0f, 200.0f), on(1.0f, 1.25f), low(0.0f, 0.5f);
    for (int i = 0; i < len; ++i) s[size_t(i)] = i < k - 100 ? top(rng) : i < k - 100 + m ? on(rng) : low(rng);
    for (int i = k - 100; i < k - 100 + m; i += 7) s[size_t(i)] = 1.125f;  // ties on the boundary digit
    std::shuffle(s.begin(), s.end(), rng);
    const std::vector<int32_t> n = {len};
    for (int threads : kPathThreads) {
      cuda::TopKWorkspace ws = topk_workspace(cuda::TopKPath::kTeam, threads);
      for (int round = 0; round < 2; ++round)  // (the state left clean for the next call)
        expect_selection(gpu_top_k(s, n, len, k, &ws), s, n, len, k,
                         std::to_string(m) + " on thr's first digit, " + threads_name(threads));
      EXPECT_EQ(ws.last_path, cuda::TopKPath::kTeam);
    }
  }
}

// The mma indexer filling the top-k's first histogram as it writes the scores (top_k_counts): the
// same scores bit for bit, and the selection the CPU makes on them, on the span and the team path,
// for rows longer and shorter than k. `spread`: every key scaled by 2^U(-40, 40), so that a block's
// scores fall in hundreds of first digits, more than its table holds (the straight global adds).
// Each workspace serves several calls in a row: the state must be left clean for the next.
void check_counted_top_k(const std::vector<int>& ctx, int block_size, KvDtype dtype, int k, bool spread,
                         cuda::TopKPath path, int threads, std::mt19937& rng) {
  const int heads = 32, dim = 128, T = int(ctx.size());
  std::vector<int32_t> seq(static_cast<size_t>(T)), n_ctx(ctx.begin(), ctx.end());
  std::iota(seq.begin(), seq.end(), 0);
  Paged pg(ctx, block_size, rng);
  std::vector<float> keys = random_vec(size_t(pg.n_slots() * dim), rng);
  if (spread) {
    std::uniform_int_distribution<int> e(-40, 40);
    for (int64_t r = 0; r < pg.n_slots(); ++r) {
      const float f = std::ldexp(1.0f, e(rng));
      for (int i = 0; i < dim; ++i) keys[size_t(r * dim + i)] *= f;
    }
  }
  GpuCache cache = make_cache(keys, pg.n_slots(), dim, 0, dtype, false);
  const int64_t stride = *std::max_element(n_ctx.begin(), n_ctx.end()) + 40;
  DeviceBuffer d_seq = cuda::to_device(seq), d_n = cuda::to_device(n_ctx);
  cuda::TopKWorkspace ws = topk_workspace(path, threads);
  ws.count_max = INT64_MAX;  // (past the default bound: the span path, many rows)
  for (int round = 0; round < 3; ++round) {
    std::vector<float> q = random_vec(size_t(T) * heads * dim, rng), w = random_vec(size_t(T) * heads, rng, 0.1f);
    DeviceBuffer d_q = cuda::to_device(q), d_w = cuda::to_device(w), d_plain(size_t(T * stride) * 4),
                 d_scores(size_t(T * stride) * 4), d_sel(size_t(T) * k * 4);
    cuda::IndexerArgs a =
        indexer_args(d_q, d_w, T, heads, dim, d_seq, d_n, stride, pg.rows(cache.data, cache.row_bytes), dtype, d_plain);
    a.mma = kMmaKernels[size_t(round)];  // (every mma kernel counts)
    cuda::indexer_scores(a, cuda::IndexerKernel::Mma, nullptr);
    a.scores = d_scores.as<float>();
    a.counts = cuda::top_k_counts(d_scores.as<float>(), T, stride, k, nullptr, &ws);
    ASSERT_NE(a.counts.hist, nullptr) << "rows of " << stride << " take a long-row path";
    cuda::indexer_scores(a, cuda::IndexerKernel::Mma, nullptr);
    cuda::top_k(d_scores.as<float>(), T, stride, d_n.as<int32_t>(), k, d_sel.as<int32_t>(), nullptr, &ws);
    EXPECT_TRUE(ws.last_counted);
    const std::vector<float> plain = cuda::to_host<float>(d_plain, size_t(T * stride));
    const std::vector<float> got = cuda::to_host<float>(d_scores, size_t(T * stride));
    for (int t = 0; t < T; ++t)
      for (int p = 0; p < n_ctx[size_t(t)]; ++p)
        ASSERT_EQ(got[size_t(t * stride + p)], plain[size_t(t * stride + p)]) << "token " << t << " position " << p;
    const std::string what = std::string(path == cuda::TopKPath::kTeam ? "team, " + threads_name(threads) : "spans") +
                             (spread ? ", spread" : "") +
                             ", " + cuda::kv_dtype_name(dtype) + ", k " + std::to_string(k) + ", round " +
                             std::to_string(round);
    expect_selection(cuda::to_host<int32_t>(d_sel, size_t(T) * k), got, n_ctx, stride, k, what);
    if (path == cuda::TopKPath::kSpans) EXPECT_EQ(ws.last_path, cuda::TopKPath::kSpans) << what;
    else EXPECT_EQ(ws.last_path, team_fits(ws, T, stride) ? cuda::TopKPath::kTeam : cuda::TopKPath::kSpans) << what;
    // The same workspace, counting itself: the same selection (the state was left clean).
    DeviceBuffer d_sel2(size_t(T) * k * 4);
    cuda::top_k(d_scores.as<float>(), T, stride, d_n.as<int32_t>(), k, d_sel2.as<int32_t>(), nullptr, &ws);
    EXPECT_FALSE(ws.last_counted);
    ASSERT_EQ(cuda::to_host<int32_t>(d_sel2, size_t(T) * k), cuda::to_host<int32_t>(d_sel, size_t(T) * k)) << what;
  }
}

TEST(CudaAttention, IndexerCountsTheTopKFirstDigit) {
  SPARSEMLA_REQUIRE_GPU();
  std::mt19937 rng(21);
  const int len = small_mode() ? 20000 : 70000;
  // (the team path on each block size, the span path once: its blocks have 1024 threads)
  for (int threads : {256, 512, 1024, 0}) {
    const cuda::TopKPath path = threads ? cuda::TopKPath::kTeam : cuda::TopKPath::kSpans;
    for (KvDtype d : {KvDtype::BF16, KvDtype::FP8}) {
      // a long row, rows around k (not counted at n <= k), a row of one
      check_counted_top_k({len, 2047, 2048, 2049, 9000, 1}, 64, d, 2048, false, path, threads, rng);
      check_counted_top_k({len, 5000}, 64, d, 2048, true, path, threads, rng);
      check_counted_top_k({9000, 300}, 16, d, 100, true, path, threads, rng);  // pages smaller than a tile, small k
    }
  }
}

TEST(CudaAttention, TopKCountsRefuseMismatchedCallsAndDropUnreadCounts) {
  SPARSEMLA_REQUIRE_GPU();
  const int64_t T = 2, stride = 20000;
  DeviceBuffer scores(size_t(T * stride) * 4), sel(size_t(T) * 2048 * 4);
  scores.zero();
  DeviceBuffer d_n = cuda::to_device(std::vector<int32_t>{20000, 100});
  cuda::TopKWorkspace ws = topk_workspace(cuda::TopKPath::kTeam);
  EXPECT_EQ(cuda::top_k_counts(scores.as<float>(), T, stride, 2048, nullptr, nullptr).hist, nullptr) << "no workspace";
  cuda::TopKWorkspace rows = topk_workspace(cuda::TopKPath::kRows);
  EXPECT_EQ(cuda::top_k_counts(scores.as<float>(), T, stride, 2048, nullptr, &rows).hist, nullptr) << "one-block path";
  cuda::TopKWorkspace wide = topk_workspace(cuda::TopKPath::kTeam);
  EXPECT_EQ(cuda::top_k_counts(scores.as<float>(), 16, cuda::kTopKCountMax / 16 + 1, 2048, nullptr, &wide).hist, nullptr)
      << "more scores than the bound";
  ASSERT_NE(cuda::top_k_counts(scores.as<float>(), T, stride, 2048, nullptr, &ws).hist, nullptr);
  EXPECT_THROW(cuda::top_k(scores.as<float>(), T, stride, d_n.as<int32_t>(), 1024, sel.as<int32_t>(), nullptr, &ws),
               Error)
      << "another k";
  cuda::top_k(scores.as<float>(), T, stride, d_n.as<int32_t>(), 2048, sel.as<int32_t>(), nullptr, &ws);
  EXPECT_FALSE(ws.last_counted);
  // Counts that reached the histograms but were never read (a call in between failed, as an indexer
  // would have left them; written here by hand): the next top_k_counts drops them (zeroes the rows'
  // state), and so does a top_k that refuses its call; a plain top_k after it selects as the CPU.
  const std::vector<uint32_t> junk(2048, 77), zeros(2048, 0);
  std::vector<uint32_t> back(2048);
  ASSERT_NE(cuda::top_k_counts(scores.as<float>(), T, stride, 2048, nullptr, &ws).hist, nullptr);
  ASSERT_EQ(cuda::top_k_counts(scores.as<float>(), T, stride, 2048, nullptr, &ws).hist,
            ws.candidates.as<uint32_t>());  // row 0's first histogram
  ws.candidates.upload(junk.data(), junk.size() * 4);
  ASSERT_NE(cuda::top_k_counts(scores.as<float>(), T, stride, 2048, nullptr, &ws).hist, nullptr) << "counted twice";
  ws.candidates.download(back.data(), back.size() * 4);
  EXPECT_EQ(back, zeros) << "the unread counts were not dropped";
  ws.candidates.upload(junk.data(), junk.size() * 4);
  EXPECT_THROW(cuda::top_k(scores.as<float>(), T, stride, d_n.as<int32_t>(), 7, sel.as<int32_t>(), nullptr, &ws), Error);
  ws.candidates.download(back.data(), back.size() * 4);
  EXPECT_EQ(back, zeros) << "a refused call left its counts";
  std::mt19937 rng(5);
  const std::vector<float> sh = random_vec(size_t(T * stride), rng);
  const std::vector<int32_t> n_host = {20000, 100};
  DeviceBuffer d_s = cuda::to_device(sh);
  cuda::top_k(d_s.as<float>(), T, stride, d_n.as<int32_t>(), 2048, sel.as<int32_t>(), nullptr, &ws);
  expect_selection(cuda::to_host<int32_t>(sel, size_t(T) * 2048), sh, n_host, stride, 2048, "after dropped counts");
  // A block size the paths do not take is refused, on the team path and on the block path.
  for (cuda::TopKPath path : {cuda::TopKPath::kTeam, cuda::TopKPath::kBlock}) {
    cuda::TopKWorkspace odd = topk_workspace(path, 300);
    EXPECT_THROW(cuda::top_k(d_s.as<float>(), T, stride, d_n.as<int32_t>(), 2048, sel.as<int32_t>(), nullptr, &odd),
                 Error);
    EXPECT_THROW(cuda::top_k(d_s.as<float>(), 1, 4000, d_n.as<int32_t>(), 2048, sel.as<int32_t>(), nullptr, &odd),
                 Error);
  }
  // The fma indexer does not count.
  cuda::IndexerArgs a;
  a.T = 1;
  a.max_ctx = 1;
  a.counts = cuda::top_k_counts(scores.as<float>(), T, stride, 2048, nullptr, &ws);
  EXPECT_THROW(cuda::indexer_scores(a, cuda::IndexerKernel::Fma, nullptr), Error);
}

// Top-k recall of the fp8 indexer (keys e4m3 with one scale per 128, queries fp16) against exact
// fp32 scores. Keys are built as a trained indexer's are meant to be: a relevance per position
// (heavy-tailed: few positions matter much, most little) along a direction the query heads agree on,
// plus isotropic noise. For i.i.d. Gaussian keys, where the scores near the k-th are as dense as
// they can be, the recall is printed too (0.97-0.99) but not asserted: no 8-bit key format separates
// positions whose exact scores differ by less than its rounding.
double fp8_recall(int len, int k, bool peaked, std::mt19937& rng) {
  const int heads = 64, dim = 128;
  Paged pg({len}, 64, rng);
  std::vector<float> dir = random_vec(size_t(dim), rng);
  float norm = 0;
  for (float x : dir) norm += x * x;
  for (float& x : dir) x /= std::sqrt(norm);
  std::vector<float> keys = random_vec(size_t(pg.n_slots() * dim), rng);
  std::vector<float> q = random_vec(size_t(heads * dim), rng), w = random_vec(size_t(heads), rng, 0.1f);
  if (peaked) {
    std::exponential_distribution<float> relevance(1.0f);
    for (int64_t s = 0; s < pg.n_slots(); ++s) {
      const float r = 4.0f * relevance(rng);
      for (int i = 0; i < dim; ++i) keys[size_t(s * dim + i)] += r * dir[size_t(i)];
    }
    for (int h = 0; h < heads; ++h) {
      w[size_t(h)] = std::fabs(w[size_t(h)]);
      for (int i = 0; i < dim; ++i) q[size_t(h * dim + i)] += 2.0f * dir[size_t(i)];
    }
  }
  GpuCache cache = make_cache(keys, pg.n_slots(), dim, 0, KvDtype::FP8, false);
  DeviceBuffer d_q = cuda::to_device(q), d_w = cuda::to_device(w), d_seq = cuda::to_device(std::vector<int32_t>{0}),
               d_n = cuda::to_device(std::vector<int32_t>{len}), d_scores(size_t(len) * 4), d_sel(size_t(k) * 4);
  const cuda::IndexerArgs a = indexer_args(d_q, d_w, 1, heads, dim, d_seq, d_n, len, pg.rows(cache.data, cache.row_bytes),
                                           KvDtype::FP8, d_scores);
  cuda::indexer_scores(a, cuda::IndexerKernel::Mma, nullptr);
  cuda::top_k(d_scores.as<float>(), 1, len, d_n.as<int32_t>(), k, d_sel.as<int32_t>(), nullptr);
  const std::vector<int32_t> sel = cuda::to_host<int32_t>(d_sel, size_t(k));
  std::vector<float> exact(static_cast<size_t>(len));
  for (int p = 0; p < len; ++p)
    exact[size_t(p)] = model::indexer_score(q.data(), w.data(), keys.data() + pg.slot(0, p) * dim, heads, dim);
  const std::vector<int32_t> ref = ops::top_k(exact.data(), len, k);
  const std::set<int32_t> ref_set(ref.begin(), ref.end());
  int hit = 0;
  for (int32_t p : sel) hit += ref_set.count(p) ? 1 : 0;
  const double recall = double(hit) / double(k);
  std::printf("  fp8 indexer, %s keys, context %d: top-%d recall %.4f\n", peaked ? "peaked" : "i.i.d.", len, k, recall);
  return recall;
}

TEST(CudaAttention, Fp8IndexerTopKRecallAgainstExactScores) {
  SPARSEMLA_REQUIRE_GPU();
  std::mt19937 rng(4);
  const std::vector<int> ctx = small_mode() ? std::vector<int>{4096} : std::vector<int>{32768, 8192, 4096};
  for (int len : ctx) {
    EXPECT_GE(fp8_recall(len, 2048, true, rng), 0.99) << "context " << len;
    fp8_recall(len, 2048, false, rng);
  }
}

using cuda::test_paged::MlaCase;

// ws (if given): the workspace to launch with (its pairs switch, a preset device limit), which keeps
// what the launch did (last_cluster); else a fresh one.
// merge_kernel_bits: the call also runs with split_clusters off (the merge kernel) and the split
// count the first call took, and the two outputs must be equal to the bit.
void check_mla(const MlaCase& c, KvDtype dtype, cuda::AttentionKernel kernel, int splits, std::mt19937& rng,
               int heads_per_block = 0, cuda::AttentionWorkspace* ws_in = nullptr, bool merge_kernel_bits = false) {
  const int T = int(c.ctx.size()), D = c.kv_lora + c.rope;
  Paged pg(cuda::test_paged::mla_lens(c), c.block_size, rng);
  const cuda::test_paged::MlaInputs in = cuda::test_paged::mla_inputs(c, pg, rng);
  const std::vector<int32_t>&seq = in.seq, &n_ctx = in.n_ctx, &sel = in.sel;
  std::vector<float> q = in.q;
  for (float& x : q) x *= c.q_gain;
  GpuCache cache = make_cache(in.rows, pg.n_slots(), c.kv_lora, c.rope, dtype, true);
  DeviceBuffer d_q = cuda::to_device(q), d_seq = cuda::to_device(seq), d_n = cuda::to_device(n_ctx),
               d_out((size_t(T) * c.heads * c.kv_lora + size_t(c.out_shift)) * 4);
  DeviceBuffer d_sel = c.top_k > 0 ? cuda::to_device(sel) : DeviceBuffer();
  cuda::AttentionArgs a;
  a.q = d_q.as<float>();
  a.T = T;
  a.heads = c.heads;
  a.kv_lora = c.kv_lora;
  a.rope = c.rope;
  a.scale = 1.0f / std::sqrt(192.0f) / c.q_gain;
  a.seq = d_seq.as<int32_t>();
  a.n_ctx = d_n.as<int32_t>();
  a.selected = c.top_k > 0 ? d_sel.as<int32_t>() : nullptr;
  a.top_k = c.top_k;
  a.max_ctx = in.max_ctx;
  a.selected_front = c.front;
  a.latent = pg.rows(cache.data, cache.row_bytes);
  a.dtype = dtype;
  a.out = d_out.as<float>() + c.out_shift;
  cuda::AttentionWorkspace fresh;
  cuda::AttentionWorkspace& ws = ws_in ? *ws_in : fresh;
  const size_t n_out = size_t(T) * c.heads * c.kv_lora + size_t(c.out_shift);
  d_out.upload(std::vector<float>(n_out, NAN).data(), n_out * 4);
  cuda::sparse_mla(a, kernel, ws, nullptr, splits, heads_per_block);
  std::vector<float> got = cuda::to_host<float>(d_out, n_out);
  if (merge_kernel_bits) {
    cuda::AttentionWorkspace plain;
    plain.split_clusters = false;
    plain.pairs = ws.last_paired;  // (the first call's fit may have unpaired the blocks)
    d_out.upload(std::vector<float>(n_out, NAN).data(), n_out * 4);
    cuda::sparse_mla(a, kernel, plain, nullptr, ws.last.splits, heads_per_block);  // (the same splits)
    EXPECT_FALSE(plain.last_split_cluster);
    const std::vector<float> by_kernel = cuda::to_host<float>(d_out, n_out);
    int64_t differ = 0;
    for (size_t i = 0; i < n_out; ++i) differ += std::memcmp(&got[i], &by_kernel[i], 4) != 0;
    EXPECT_EQ(differ, 0) << "values of " << n_out << " differ from the merge kernel's (split clusters: "
                         << ws.last_split_cluster << ")";
  }
  for (int i = 0; i < c.out_shift; ++i) EXPECT_TRUE(std::isnan(got[size_t(i)])) << "written before the output: " << i;
  got.erase(got.begin(), got.begin() + c.out_shift);

  std::vector<float> qr = q;
  if (kernel != cuda::AttentionKernel::Fma)  // the tensor-core kernels take q as bf16
    for (float& x : qr) x = round_bf16(x);
  double worst = 0;
  std::vector<float> ref(static_cast<size_t>(c.kv_lora)), logits;
  for (int t = 0; t < T; ++t) {
    std::vector<const float*> rp;
    if (c.top_k > 0) {
      for (int i = 0; i < cuda::test_paged::mla_rows(c, n_ctx[size_t(t)]); ++i)
        if (int32_t p = sel[size_t(t) * c.top_k + i]; p >= 0) rp.push_back(cache.decoded.data() + pg.slot(seq[size_t(t)], p) * D);
    } else {
      for (int p = 0; p < n_ctx[size_t(t)]; ++p) rp.push_back(cache.decoded.data() + pg.slot(seq[size_t(t)], p) * D);
    }
    for (int h = 0; h < c.heads; ++h) {
      const float* qh = qr.data() + (size_t(t) * c.heads + h) * D;
      ops::latent_attention(qh, qh + c.kv_lora, rp.data(), int64_t(rp.size()), c.kv_lora, c.rope, a.scale, ref.data(),
                            logits);
      float mx = 0;
      for (float v : ref) mx = std::max(mx, std::fabs(v));
      const float* g = got.data() + (size_t(t) * c.heads + h) * c.kv_lora;
      for (int i = 0; i < c.kv_lora; ++i) {
        const double err = std::fabs(g[i] - ref[size_t(i)]) / std::max(mx, 1e-6f);
        worst = std::max(worst, err);
        ASSERT_LE(err, 1e-2) << "token " << t << " head " << h << " dim " << i << ": gpu " << g[i] << " cpu "
                             << ref[size_t(i)];
      }
    }
  }
  std::printf("  attention %s %s heads %d latent %d+%d top-k %d splits %d heads/block %d cluster %d: max error %.2e\n",
              kernel == cuda::AttentionKernel::Mma ? "mma" : kernel == cuda::AttentionKernel::Wgmma ? "wgmma" : "fma",
              cuda::kv_dtype_name(dtype), c.heads, c.kv_lora, c.rope, c.top_k, splits, heads_per_block, ws.last_cluster,
              worst);
}

const std::vector<MlaCase> kMlaCases = {
    {64, 512, 64, {3000, 2048, 100}, 2048, 2, 64},    // GLM-5: context above, at and below top-k
    {128, 512, 64, {2500}, 2048, 1, 64},              // DeepSeek-V3.2
    {8, 512, 64, {2100, 40}, 2048, 2, 16},            // GLM-5 at tensor parallel 8
    {16, 512, 64, {700}, 0, 1, 16},                   // dense
    {2, 24, 8, {12, 30, 1}, 12, 2, 16},               // glm_pub
    {4, 32, 16, {25, 5}, 12, 1, 4},                   // glm_share
    {4, 256, 32, {40}, 12, 1, 16},                    // glm_q4_k
    {4, 32, 8, {15, 9}, 0, 2, 16},                    // dsv32_groups, dense
    {2, 16, 8, {50}, 12, 1, 16},                      // dsv32_pub
};

TEST(CudaAttention, SparseMlaMatchesTheCpuReference) {
  SPARSEMLA_REQUIRE_GPU();
  std::mt19937 rng(5);
  for (const MlaCase& c : kMlaCases)
    for (KvDtype d : {KvDtype::BF16, KvDtype::FP8}) {
      check_mla(c, d, cuda::AttentionKernel::Mma, 0, rng);
      check_mla(c, d, cuda::AttentionKernel::Mma, 1, rng);
      check_mla(c, d, cuda::AttentionKernel::Fma, 1, rng);
    }
  // Dense over a long context through many splits, and a forced split count.
  check_mla({32, 512, 64, {small_mode() ? 3000 : 20000}, 0, 1, 64}, KvDtype::BF16, cuda::AttentionKernel::Mma, 0, rng);
  check_mla({64, 512, 64, {4096, 4000}, 2048, 2, 64}, KvDtype::FP8, cuda::AttentionKernel::Mma, 7, rng);
  // f32 latent rows: the fma kernel, which then agrees with the CPU to fp32 rounding.
  for (const MlaCase& c : kMlaCases) check_mla(c, KvDtype::F32, cuda::AttentionKernel::Fma, 1, rng);
  // Rope of 4 with latent 20: only the fma kernel takes it.
  check_mla({3, 20, 4, {30}, 12, 1, 16}, KvDtype::BF16, cuda::AttentionKernel::Fma, 1, rng);
}

// Scores that keep rising along the selection (rows growing 20-fold over the context, queries along
// them: a head's maximum climbs ~55 log2 units, the fp8 scales 20-fold; the last tiles' weights still
// spread over ~80 rows), so the generic kernels' lazy maximum and the fp8-row kernel's lazy scale
// bound move again and again after the first tile, and the output is rescaled (warp_rescales) on
// the tiles where they do; positions in order, one split and the launch's own, 16 heads per block
// and the launch's own, both caches.
TEST(CudaAttention, SparseMlaRescalesWhenScoresAndScalesGrow) {
  SPARSEMLA_REQUIRE_GPU();
  std::mt19937 rng(23);
  const std::vector<MlaCase> cases = {
      {64, 512, 64, {3000}, 2048, 1, 64, true, 3.0f},   // GLM-5
      {128, 512, 64, {2500}, 2048, 1, 64, true, 3.0f},  // DeepSeek-V3.2
      {16, 512, 64, {1500}, 0, 1, 16, true, 3.0f},      // dense
      {4, 256, 32, {300}, 64, 1, 16, true, 3.0f},       // a small shape (the bf16-tile kernel for fp8)
  };
  for (const MlaCase& c : cases)
    for (KvDtype d : {KvDtype::BF16, KvDtype::FP8})
      for (int splits : {1, 0}) {
        check_mla(c, d, cuda::AttentionKernel::Mma, splits, rng);
        if (c.heads >= 32) check_mla(c, d, cuda::AttentionKernel::Mma, splits, rng, 16);
      }
#if SPARSEMLA_HAVE_SM90A
  // The Hopper kernel (exact running maximum, rescaled on every tile where it moves).
  const ops::DeviceInfo dev = ops::list_devices().at(0);
  if (dev.cc_major == 9 && dev.cc_minor == 0)
    for (const MlaCase& c : cases) {
      if (c.kv_lora != 512 || c.rope != 64) continue;
      for (KvDtype d : {KvDtype::BF16, KvDtype::FP8})
        for (int splits : {1, 0}) check_mla(c, d, cuda::AttentionKernel::Wgmma, splits, rng);
    }
#endif
}

// Selections in top_k's order (AttentionArgs::selected_front): at contexts shorter than top_k the
// launch splits only the first max_ctx entries, and each token's blocks stop at its own context, so
// a token's blocks cover its context, not 2048 rows of which most are -1; the sums stay the CPU's. Contexts below, at a tile's edge of, and
// above top-k, several sequences, 16-row cache blocks (selections crossing them), both kernels
// this device runs.
TEST(CudaAttention, FrontSelectionsSplitOnlyTheContext) {
  SPARSEMLA_REQUIRE_GPU();
  std::mt19937 rng(9);
  const std::vector<MlaCase> cases = {
      {64, 512, 64, {1000, 700}, 2048, 2, 16, true},  // GLM-5 at 1K: 32 tiles, not 64
      {64, 512, 64, {33}, 2048, 1, 64, true},         // one row past a 32-row tile
      {128, 512, 64, {1500, 64}, 2048, 2, 16, true},  // DeepSeek-V3.2
      {8, 512, 64, {2100, 40}, 2048, 2, 16, true},    // max_ctx above top-k: unchanged
      {4, 32, 16, {25, 5}, 12, 1, 4, true},           // glm_share
      // A prefill's first tokens beside longer ones (max_ctx above top-k): each token's blocks stop
      // at its own context; the entries past it hold position 0 (stale_tail), which a kernel reading
      // them would add.
      {64, 512, 64, {3000, 1000, 33, 2047, 64}, 2048, 2, 16, true, 0.0f, true},
      {128, 512, 64, {2100, 700}, 2048, 1, 16, true, 0.0f, true},
  };
  std::vector<cuda::AttentionKernel> kernels = {cuda::AttentionKernel::Mma};
#if SPARSEMLA_HAVE_SM90A
  const ops::DeviceInfo dev = ops::list_devices().at(0);
  if (dev.cc_major == 9 && dev.cc_minor == 0) kernels.push_back(cuda::AttentionKernel::Wgmma);
#endif
  for (const MlaCase& c : cases)
    for (cuda::AttentionKernel k : kernels) {
      if (k == cuda::AttentionKernel::Wgmma && (c.kv_lora != 512 || c.rope != 64)) continue;
      for (KvDtype d : {KvDtype::BF16, KvDtype::FP8}) {
        cuda::AttentionWorkspace ws;
        check_mla(c, d, k, 0, rng, 0, &ws);
        // Blocks per token: a chosen split takes two 32-row tiles at least, of the context's
        // (over all top_k entries: up to 32 splits at every context).
        const int64_t max_ctx = *std::max_element(c.ctx.begin(), c.ctx.end());
        const int64_t tiles = (std::min<int64_t>(c.top_k, max_ctx) + 31) / 32;
        EXPECT_LE(ws.last.splits, std::max<int64_t>(1, tiles / 2)) << "context " << max_ctx << " top-k " << c.top_k;
      }
    }
}

// The fp8-row kernel (sparse_mla_fp8.cu) holds q's latent part as fp16: q past fp16's largest value
// and q in its subnormals, the softmax scale compensating (the same weights), forced onto that
// kernel (asserted) and with the launch's own choice (batch 1: the bf16-tile kernel).
TEST(CudaAttention, SparseMlaFp8RowsTakeQOfAnyRange) {
  SPARSEMLA_REQUIRE_GPU();
  std::mt19937 rng(31);
  for (float gain : {1e5f, 1e-6f}) {
    for (MlaCase c : {MlaCase{64, 512, 64, {3000, 700}, 2048, 2, 16}, MlaCase{128, 512, 64, {2500}, 2048, 1, 64}}) {
      c.q_gain = gain;
      cuda::AttentionWorkspace ws;
      check_mla(c, KvDtype::FP8, cuda::AttentionKernel::Mma, 2, rng, 0, &ws);
      EXPECT_STREQ(ws.last.kernel, "mma fp8 rows") << "q gain " << gain;
    }
    MlaCase one{64, 512, 64, {4096}, 2048, 1, 64};
    one.q_gain = gain;
    check_mla(one, KvDtype::FP8, cuda::AttentionKernel::Mma, 0, rng);
  }
}

// Skips a test of the Hopper kernel unless the device is compute capability 9.0 and the build has
// its sm_90a machine code.
#if SPARSEMLA_HAVE_SM90A
#define SPARSEMLA_REQUIRE_SM90A()                                                                              \
  do {                                                                                                         \
    SPARSEMLA_REQUIRE_GPU();                                                                                   \
    const ops::DeviceInfo sm90_dev = ops::list_devices().at(0);                                                \
    if (sm90_dev.cc_major != 9 || sm90_dev.cc_minor != 0)                                                      \
      GTEST_SKIP() << sm90_dev.name << " is compute capability " << sm90_dev.cc_major << "." << sm90_dev.cc_minor \
                   << ", not 9.0";                                                                             \
  } while (0)
#else
#define SPARSEMLA_REQUIRE_SM90A() \
  GTEST_SKIP() << "this build has no sm_90a machine code (90 is not in CMAKE_CUDA_ARCHITECTURES)"
#endif

// The Hopper kernel, where the device is compute capability 9.0 and the build has its sm_90a code:
// the latent 512 + rope 64 cases of kMlaCases (GLM-5 and DeepSeek-V3.2 heads, context shorter than
// top-k, -1 padded selections, GLM-5 at tensor parallel 8 with its 8 heads padded to a block of 64,
// dense) unsplit and split, plus several tokens of 128 heads over 16-row blocks and forced splits.
TEST(CudaAttention, SparseMlaWgmmaMatchesTheCpuReference) {
  SPARSEMLA_REQUIRE_SM90A();
  std::mt19937 rng(7);
  const auto wgmma = cuda::AttentionKernel::Wgmma;
  if (small_mode()) {  // under compute-sanitizer: one of each path
    check_mla({64, 512, 64, {700, 100}, 512, 2, 16}, KvDtype::BF16, wgmma, 1, rng);
    check_mla({128, 512, 64, {700, 100}, 512, 2, 16}, KvDtype::FP8, wgmma, 3, rng);
    return;
  }
  for (const MlaCase& c : kMlaCases) {
    if (c.kv_lora != 512 || c.rope != 64) continue;
    for (KvDtype d : {KvDtype::BF16, KvDtype::FP8}) {
      check_mla(c, d, wgmma, 0, rng);
      check_mla(c, d, wgmma, 1, rng);
    }
  }
  check_mla({128, 512, 64, {2500, 300, 2048}, 2048, 3, 16}, KvDtype::BF16, wgmma, 0, rng);
  check_mla({128, 512, 64, {2500, 300, 2048}, 2048, 3, 16}, KvDtype::FP8, wgmma, 5, rng);
  check_mla({64, 512, 64, {4096, 4000}, 2048, 2, 64}, KvDtype::FP8, wgmma, 7, rng);
  check_mla({64, 512, 64, {20000}, 0, 1, 64}, KvDtype::BF16, wgmma, 0, rng);  // dense, many splits
}

// The Hopper kernel's splits merged in their cluster (2-8 splits of a token, one cluster along z):
// GLM-5's 64 heads, DeepSeek-V3.2's 128 (two clusters per token), a tensor-parallel share of 32 heads
// (rows of the block padded), bf16 and unpaired fp8 rows, contexts above, at and below top-k (empty
// splits), against the CPU and to the bit against the merge kernel; paired fp8 rows (DeepSeek-V3.2's
// 128 heads and two pairs of 256) in (2, 1, S) clusters of 2-4 splits, to the bit against the pairs
// merged by the kernel; and the launch's own split count at mid batches (GLM-5 bf16 at 64, 32 and 12
// tokens: 2, 3 and 8 splits on a 132-SM H100 or H200; DeepSeek-V3.2 fp8 at 8, 16 and 32; the splits,
// cluster size and whether they merged, which the device's cluster placement decides, are printed).
TEST(CudaAttention, SparseMlaWgmmaMergesSplitsInClusters) {
  SPARSEMLA_REQUIRE_SM90A();
  std::mt19937 rng(53);
  const auto wgmma = cuda::AttentionKernel::Wgmma;
  const int splits_of[] = {2, 3, 5, 8};
  for (int sp : splits_of) {
    if (small_mode() && sp != 3) continue;
    for (const MlaCase& c : {MlaCase{64, 512, 64, {3000, 2048, 100}, 2048, 2, 64}, MlaCase{128, 512, 64, {2500, 700}, 2048, 2, 16},
                             MlaCase{32, 512, 64, {2100, 40}, 2048, 2, 16}})
      for (KvDtype d : {KvDtype::BF16, KvDtype::FP8}) {
        cuda::AttentionWorkspace ws;
        ws.split_clusters = true;
        ws.pairs = false;  // (fp8 rows of 128 heads would pair: the pair clusters' cases below)
        check_mla(c, d, wgmma, sp, rng, 0, &ws, true);
        EXPECT_TRUE(ws.last_split_cluster) << c.heads << " heads, " << sp << " splits, " << cuda::kv_dtype_name(d);
        EXPECT_EQ(ws.last_cluster, sp);
      }
  }
  for (int sp : {2, 3, 4}) {
    if (small_mode() && sp != 3) continue;
    for (const MlaCase& c : {MlaCase{128, 512, 64, {2500, 700, 2048}, 2048, 2, 16},
                             MlaCase{256, 512, 64, {3000, 2100}, 2048, 2, 64}, MlaCase{128, 512, 64, {5000, 40}, 0, 2, 64}}) {
      cuda::AttentionWorkspace ws;
      ws.split_clusters = true;
      ws.pairs = true;
      check_mla(c, KvDtype::FP8, wgmma, sp, rng, 0, &ws, true);
      EXPECT_TRUE(ws.last_split_cluster) << c.heads << " heads, " << sp << " splits, pairs";
      EXPECT_TRUE(ws.last_paired) << c.heads << " heads, " << sp << " splits";
      EXPECT_EQ(ws.last_cluster, 2 * sp) << c.heads << " heads, " << sp << " splits, pairs";
    }
  }
  if (small_mode()) return;
  // The launch's own count for T tokens (contexts alternating between two lengths), printed.
  auto at_launch = [&](int heads, KvDtype d, int T, int ctx_a, int ctx_b) {
    MlaCase mid{heads, 512, 64, {}, 2048, T, 16};
    for (int t = 0; t < T; ++t) mid.ctx.push_back(t % 2 ? ctx_a : ctx_b);
    cuda::AttentionWorkspace ws;
    ws.split_clusters = true;
    check_mla(mid, d, wgmma, 0, rng, 0, &ws, true);
    std::printf("  %d tokens, %d heads, %s: %d splits, cluster of %d, paired: %d, merged in clusters: %d\n", T, heads,
                cuda::kv_dtype_name(d), ws.last.splits, ws.last_cluster, int(ws.last_paired),
                int(ws.last_split_cluster));
  };
  // GLM-5 bf16 (32: 4 planned splits, fewer where 4-block clusters do not all fit; 12: 11 planned,
  // 8 at most).
  for (int T : {64, 32, 12}) at_launch(64, KvDtype::BF16, T, 300, 250);
  // DeepSeek-V3.2 fp8: pairs, 8, 4 and 2 planned splits, at most 4 in (2, 1, S) clusters; at 32
  // tokens the pairs' clusters of 4 do not all fit on 132 SMs, unpaired ones of 2 do.
  for (int T : {8, 16, 32}) at_launch(128, KvDtype::FP8, T, 3000, 2500);
}

// One GPU's share of the heads under tensor parallelism (GLM-5's 64 over 2, 4 or 8 GPUs: 32, 16, 8;
// DeepSeek-V3.2's 128 over 8: 16) on the Hopper kernel, its block of 64 heads padded, at batches
// where the launch's own choice is that kernel (asserted): bf16 rows from 8 tokens, fp8 rows from 4
// tokens at 32 heads and at every batch below 32 heads; then forced unsplit. Contexts above, at and
// below top-k, 16-row blocks.
TEST(CudaAttention, SparseMlaWgmmaTakesTensorParallelShares) {
  SPARSEMLA_REQUIRE_SM90A();
  std::mt19937 rng(37);
  const int ctx_of[] = {3000, 700, 2048, 64, 1500};
  const struct {
    int heads, tokens;
    KvDtype dtype;
  } shares[] = {{32, 8, KvDtype::BF16}, {16, 8, KvDtype::BF16}, {8, 24, KvDtype::BF16}, {32, 4, KvDtype::FP8},
                {16, 2, KvDtype::FP8},  {8, 1, KvDtype::FP8},   {8, 24, KvDtype::FP8}};
  for (const auto& sh : shares) {
    if (small_mode() && sh.tokens > 8) continue;
    MlaCase c{sh.heads, 512, 64, {}, 2048, std::min(sh.tokens, 3), 16};
    for (int t = 0; t < sh.tokens; ++t) c.ctx.push_back(ctx_of[t % 5]);
    cuda::AttentionWorkspace ws;
    check_mla(c, sh.dtype, cuda::AttentionKernel::Wgmma, 0, rng, 0, &ws);
    EXPECT_STREQ(ws.last.kernel, "wgmma") << sh.heads << " heads, " << sh.tokens << " tokens, "
                                           << cuda::kv_dtype_name(sh.dtype);
  }
  // Unsplit (the normalized output written straight, fewer than 64 rows of it), also under the
  // sanitizers' small mode.
  check_mla({32, 512, 64, {700, 2100}, 512, 2, 16}, KvDtype::FP8, cuda::AttentionKernel::Wgmma, 1, rng);
  check_mla({8, 512, 64, {700, 2100}, 512, 2, 16}, KvDtype::BF16, cuda::AttentionKernel::Wgmma, 1, rng);
  // An output off the 16-byte alignment of the block's bulk stores (unsplit: the rows go straight
  // to it), stored from registers instead.
  MlaCase shifted{64, 512, 64, {700, 2100}, 512, 2, 16};
  shifted.out_shift = 2;
  for (KvDtype d : {KvDtype::BF16, KvDtype::FP8}) check_mla(shifted, d, cuda::AttentionKernel::Wgmma, 1, rng);
}

// The Hopper kernel whatever q's range: q far past fp16's largest value and far into its
// subnormals, with the softmax scale compensating (the same weights); paired (DeepSeek-V3.2, fp8
// rows) and unpaired, fp8 and bf16 rows (q and the tiles are bf16: fp32's range).
TEST(CudaAttention, SparseMlaWgmmaTakesQOfAnyRange) {
  SPARSEMLA_REQUIRE_SM90A();
  std::mt19937 rng(29);
  const auto wgmma = cuda::AttentionKernel::Wgmma;
  for (float gain : {1e5f, 1e-6f})
    for (KvDtype d : {KvDtype::FP8, KvDtype::BF16}) {
      cuda::AttentionWorkspace ws;
      MlaCase c{64, 512, 64, {3000, 700}, 2048, 2, 16};  // GLM-5
      c.q_gain = gain;
      check_mla(c, d, wgmma, 0, rng, 0, &ws);
      MlaCase p{128, 512, 64, {2500, 300}, 2048, 2, 16};  // DeepSeek-V3.2: pairs
      p.q_gain = gain;
      check_mla(p, d, wgmma, 1, rng, 0, &ws);
      EXPECT_EQ(ws.last_cluster, d == KvDtype::FP8 ? 2 : 1) << "q gain " << gain;
    }
}

// The Hopper kernel's pairs (an even number of 64-head blocks, two tiles or more per block: each
// block of a cluster gathers half of every tile for both): paired and unpaired launches of the same
// cases, each checked against the CPU, and the cluster size asserted (96 heads: a pair whose second
// block holds 32); an odd block count (192 heads) and one tile per split (batch 1) never pair, nor do
// bf16 rows (faster gathered unpaired, in whole lines: sessions 44-45).
TEST(CudaAttention, SparseMlaWgmmaPairsMatchTheCpuReference) {
  SPARSEMLA_REQUIRE_SM90A();
  std::mt19937 rng(17);
  const auto wgmma = cuda::AttentionKernel::Wgmma;
  struct PairCase {
    MlaCase c;
    KvDtype dtype;
    int splits;
    int cluster;  // expected with pairs allowed (bf16 rows never pair)
  };
  std::vector<PairCase> cases = {
      {{128, 512, 64, {2500, 300, 2048}, 2048, 3, 16}, KvDtype::FP8, 1, 2},  // unsplit, short context, -1 padding
      {{128, 512, 64, {2500, 300, 2048}, 2048, 3, 16}, KvDtype::BF16, 1, 2},
      {{128, 512, 64, {2500, 300, 2048}, 2048, 3, 16}, KvDtype::FP8, 0, 1},  // 22 splits of 96 rows: unpaired
      {{128, 512, 64, {2500, 100}, 2048, 2, 16}, KvDtype::FP8, 5, 2},         // uneven splits
      {{96, 512, 64, {3000}, 2048, 1, 64}, KvDtype::FP8, 1, 2},               // second block of 32 heads
      {{256, 512, 64, {2200, 2100}, 2048, 2, 64}, KvDtype::FP8, 3, 2},        // two pairs per token
      {{256, 512, 64, {2200, 2100}, 2048, 2, 64}, KvDtype::BF16, 3, 2},
      {{128, 512, 64, {5000, 40}, 0, 2, 64}, KvDtype::FP8, 4, 2},  // dense: one tile, and empty blocks
      {{128, 512, 64, {5000, 100}, 0, 2, 64}, KvDtype::BF16, 4, 2},
      {{192, 512, 64, {2500}, 2048, 1, 16}, KvDtype::FP8, 1, 1},   // three blocks: unpaired
      {{128, 512, 64, {4096}, 2048, 1, 64}, KvDtype::FP8, 32, 1},  // batch 1: one tile per split, unpaired
                                                                    // (32 splits forced)
  };
  if (small_mode()) cases.resize(2);
  for (const PairCase& pc : cases)
    for (bool pairs : {true, false}) {
      cuda::AttentionWorkspace ws;
      ws.pairs = pairs;
      check_mla(pc.c, pc.dtype, wgmma, pc.splits, rng, 0, &ws);
      const bool paired = pairs && pc.dtype != KvDtype::BF16;
      // (2-8 unpaired splits and 2-4 paired ones merge in their clusters where those fit, as these
      // few tokens' do: SparseMlaWgmmaMergesSplitsInClusters. Pairs of 5 splits merge by the kernel.)
      const int unpaired = ws.last_split_cluster ? ws.last.splits : 1;
      const bool pair_merged = paired && pc.cluster == 2 && pc.splits >= 2 && pc.splits <= 4;
      EXPECT_EQ(ws.last_cluster, pair_merged ? 2 * pc.splits : paired ? pc.cluster : unpaired)
          << "heads " << pc.c.heads << " splits " << pc.splits;
      if (paired && pc.cluster == 2) EXPECT_EQ(ws.last_split_cluster, pair_merged) << "splits " << pc.splits;
      EXPECT_EQ(ws.last_paired, paired && pc.cluster == 2) << "heads " << pc.c.heads << " splits " << pc.splits;
    }
}

// One decode token (batch 1): the mma kernel's blocks of 16, 32 and 64 heads, split as finely as
// the 2048 selected rows allow (one 32-row tile per block) and unevenly; DeepSeek-V3.2's 128 heads;
// dense attention over more tiles than splits.
TEST(CudaAttention, SparseMlaBatchOneManySplits) {
  SPARSEMLA_REQUIRE_GPU();
  std::mt19937 rng(14);
  const int ctx = small_mode() ? 4096 : 20000;
  for (KvDtype d : {KvDtype::BF16, KvDtype::FP8}) {
    check_mla({64, 512, 64, {ctx}, 2048, 1, 64}, d, cuda::AttentionKernel::Mma, 0, rng);  // the chosen shape
    for (int hpb : {16, 32, 64})
      for (int splits : {64, 37, 16})
        check_mla({64, 512, 64, {ctx}, 2048, 1, 64}, d, cuda::AttentionKernel::Mma, splits, rng, hpb);
    check_mla({128, 512, 64, {ctx}, 2048, 1, 16}, d, cuda::AttentionKernel::Mma, 0, rng);
  }
  check_mla({64, 512, 64, {small_mode() ? 3000 : 9000}, 0, 1, 64}, KvDtype::BF16, cuda::AttentionKernel::Mma, 0, rng, 16);
  check_mla({8, 512, 64, {2100}, 2048, 1, 16}, KvDtype::BF16, cuda::AttentionKernel::Mma, 0, rng);
}

// Two sets of warps per head group taking alternate tiles (the bf16-tile kernel with 16 or 32 heads
// per block and two stages, two tiles or more per split: the launch's choice at batch 1 and 2 where
// shared memory allows), and one set (ws.tile_pairs off): GLM-5 at one token split evenly, unevenly
// and not at all, with contexts whose last tile is short or alone (one set idle on the last step);
// DeepSeek-V3.2 and GLM-5 at two tokens with the launch's shape (bf16 rows: 16 heads per block up
// to 512 (token, head) rows where tile pairs fit); 32 heads per block asked for; the small fixture
// shapes (kv_lora 24: one output tile pair per warp); dense rows. fp8 rows with the launch's own
// shape (DeepSeek-V3.2: 32 heads per block; forced shapes take the fp8-row kernel where it fits).
TEST(CudaAttention, SparseMlaTilePairsMatchTheCpuReference) {
  SPARSEMLA_REQUIRE_GPU();
  std::mt19937 rng(23);
  const auto mma = cuda::AttentionKernel::Mma;
  struct Case {
    MlaCase c;
    KvDtype dtype;
    int splits, heads_per_block;
  };
  const int ctx = small_mode() ? 4096 : 20000;
  const auto bf16 = KvDtype::BF16, fp8 = KvDtype::FP8;
  const std::vector<Case> cases = {
      {{64, 512, 64, {ctx}, 2048, 1, 64}, bf16, 0, 0},            // the launch's shape: 64 tiles
      {{64, 512, 64, {ctx}, 2048, 1, 64}, bf16, 16, 16},          // 4 tiles per split: two steps
      {{64, 512, 64, {ctx}, 2048, 1, 64}, bf16, 24, 16},          // 3 tiles per split, the last split's 1 tile alone
      {{64, 512, 64, {1000}, 2048, 1, 64, true}, bf16, 0, 16},    // front selection: 32 tiles, the last short
      {{64, 512, 64, {2100, 40}, 2048, 2, 16}, bf16, 1, 16},      // two tokens, all 64 tiles in one split
      {{8, 512, 64, {2100}, 2048, 1, 16}, bf16, 3, 16},           // tensor parallel 8: 8 heads
      {{2, 24, 8, {300, 30}, 96, 2, 16}, bf16, 1, 16},            // glm_pub shape: 3 tiles
      {{16, 512, 64, {700}, 0, 1, 16}, bf16, 5, 16},              // dense: 22 tiles in 5 splits
      {{128, 512, 64, {ctx}, 2048, 1, 64}, bf16, 0, 0},           // DeepSeek-V3.2, the launch's shape
      {{64, 512, 64, {ctx, 3000}, 2048, 2, 64}, bf16, 0, 0},      // GLM-5 at two tokens
      {{64, 512, 64, {2100}, 2048, 1, 64}, bf16, 3, 32},          // 32 heads asked for: 22 tiles per split
      {{128, 512, 64, {ctx}, 2048, 1, 64}, fp8, 0, 0},
      {{64, 512, 64, {ctx}, 2048, 1, 64}, fp8, 0, 0},             // fp8 rows, the launch's shape
      {{64, 512, 64, {1000}, 2048, 1, 64, true}, fp8, 0, 0},      // the last tile short
      {{8, 512, 64, {2100}, 2048, 1, 16}, fp8, 0, 0},             // 8 heads
  };
  for (const Case& tc : cases)
    for (bool tile_pairs : {true, false}) {
      cuda::AttentionWorkspace ws;
      ws.tile_pairs = tile_pairs;
      check_mla(tc.c, tc.dtype, mma, tc.splits, rng, tc.heads_per_block, &ws);
      if (HasFatalFailure()) return;
      // Tile pairs need 16 or 32 heads per block with two stages, two tiles per split (which every
      // case here has), their bytes and room for the hand-over.
      const int hg = ws.last.heads_per_block / 16, stride = cuda::mla_smem::stride(tc.c.kv_lora, tc.c.rope);
      const int64_t row_bytes = cuda::latent_row_bytes(tc.dtype, tc.c.kv_lora, tc.c.rope);
      const bool taken = tile_pairs && hg <= 2 && ws.last.stages == 2 &&
                         cuda::mla_smem::bytes(hg, 2, tc.dtype == fp8, stride, row_bytes, 2) <= size_t(ws.smem_optin) &&
                         cuda::mla_smem::tile_pairs_fit(hg, tc.c.kv_lora, stride);
      EXPECT_STREQ(ws.last.kernel, taken ? "mma tile pairs" : "mma")
          << cuda::kv_dtype_name(tc.dtype) << " heads " << tc.c.heads << " splits " << tc.splits;
      if (tc.heads_per_block) EXPECT_EQ(ws.last.heads_per_block, tc.heads_per_block);
      else EXPECT_LE(ws.last.heads_per_block, 32) << "batch 1 and 2 take 16 or 32 heads per block";
      const bool fit16 = cuda::mla_smem::bytes(1, 2, tc.dtype == fp8, stride, row_bytes, 2) <= size_t(ws.smem_optin) &&
                         cuda::mla_smem::tile_pairs_fit(1, tc.c.kv_lora, stride);
      if (!tc.heads_per_block && tc.dtype == bf16 && tile_pairs && fit16 && tc.c.ctx.size() * tc.c.heads <= 512)
        EXPECT_EQ(ws.last.heads_per_block, 16) << "bf16 rows with tile pairs: 16 heads per block up to 512 rows";
    }
}

// Devices with 99 KB of shared memory per block (SM86, SM89, SM120, SM121: the RTX 30/40/50 and RTX
// PRO cards, DGX Spark), emulated by the launch's limit: at small batches the mma kernel takes 16
// heads per block with one tile in flight (two do not fit with 576-wide rows); every batch and head
// count must run there and match the CPU.
TEST(CudaAttention, SparseMlaFitsDevicesOf99KbPerBlock) {
  SPARSEMLA_REQUIRE_GPU();
  std::mt19937 rng(21);
  const auto mma = cuda::AttentionKernel::Mma;
  // A device of this one's SMs and 99 KB per block (SM86, SM89, SM12x), then one with only the
  // smallest variant's bytes (16 heads, one tile: fp8 rows go to the bf16-tile kernel), then limits
  // at which the fp8-row kernel takes 64 and 16 heads with two stages, then 99 KB with one block per
  // SM as on SM12x (the launch asks for more shared memory than it uses).
  const int smallest = int(cuda::mla_smem::min_bytes(512, 64));
  const int fp8_64x2 = int(cuda::mla_smem::fp8_rows_bytes(4, 2)), fp8_16x2 = int(cuda::mla_smem::fp8_rows_bytes(1, 2));
  for (auto [limit, per_sm] : {std::pair{101376, 0}, std::pair{smallest, 0}, std::pair{fp8_64x2, 0},
                               std::pair{fp8_16x2, 0}, std::pair{101376, 102400}}) {
    SCOPED_TRACE(fmt::format("{} bytes per block, {} per SM", limit, per_sm));
    cuda::AttentionWorkspace ws;
    ws.sm_count = ops::list_devices().at(0).sm_count;
    ws.smem_optin = limit;
    ws.smem_per_sm = per_sm;
    for (KvDtype d : {KvDtype::BF16, KvDtype::FP8}) {
      check_mla({64, 512, 64, {4096}, 2048, 1, 64}, d, mma, 0, rng, 0, &ws);   // GLM-5, batch 1
      check_mla({128, 512, 64, {3000}, 2048, 1, 16}, d, mma, 0, rng, 0, &ws);  // DeepSeek-V3.2
      check_mla({64, 512, 64, {2500, 700, 2048, 100}, 2048, 4, 64}, d, mma, 0, rng, 0, &ws);
      if (per_sm) {  // what an SM12x device takes at batch 4 (PERFORMANCE.md, session 11)
        EXPECT_STREQ(ws.last.kernel, d == KvDtype::FP8 ? "mma fp8 rows" : "mma");
        EXPECT_EQ(ws.last.heads_per_block, 32);
        EXPECT_EQ(ws.last.stages, d == KvDtype::FP8 ? 2 : 1);
        continue;
      }
      for (int hpb : {16, 32, 64})  // asked for, then fitted into the limit
        check_mla({64, 512, 64, {2100}, 2048, 1, 64}, d, mma, 3, rng, hpb, &ws);
      check_mla({32, 512, 64, {small_mode() ? 3000 : 9000}, 0, 1, 64}, d, mma, 0, rng, 0, &ws);  // dense
    }
  }
}

// The largest error of the absorption output `got` (fp32 [T, heads, out_stride]) against double
// sums of weight(h, r, c) times x rounded to bf16 (or act(t, h, c) where given), each relative to
// its (token, head)'s largest |sum|; infinite where a pad value past `rows` was written.
double absorption_error(const std::vector<float>& got, const std::function<double(int, int, int)>& weight,
                        const std::vector<float>& x, int heads, int rows, int cols, int T, int x_stride, int out_stride,
                        const std::function<double(int, int, int)>& act = nullptr) {
  double worst = 0;
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < heads; ++h) {
      std::vector<double> ref(static_cast<size_t>(rows));
      double mx = 0;
      for (int r = 0; r < rows; ++r) {
        double acc = 0;
        for (int c = 0; c < cols; ++c)
          acc += weight(h, r, c) * (act ? act(t, h, c) : double(round_bf16(x[(size_t(t) * heads + h) * x_stride + c])));
        ref[size_t(r)] = acc;
        mx = std::max(mx, std::fabs(acc));
      }
      const float* row = got.data() + (size_t(t) * heads + h) * out_stride;
      for (int r = 0; r < rows; ++r) worst = std::max(worst, std::fabs(row[r] - ref[size_t(r)]) / std::max(mx, 1e-9));
      for (int r = rows; r < out_stride; ++r)
        if (row[r] != 0.0f) return INFINITY;
    }
  return worst;
}

TEST(CudaAttention, AbsorptionProductsMatchTheCpu) {
  SPARSEMLA_REQUIRE_GPU();
  std::mt19937 rng(6);
  cuda::Blas blas;
  for (auto [heads, rows, cols, T] :
       std::vector<std::tuple<int, int, int, int>>{
           // decode-sized batches (the head-batched GEMV): GLM-5's W_UK / W_UV, DeepSeek-V3.2's
           {64, 512, 192, 1}, {64, 256, 512, 1}, {64, 512, 192, 5}, {64, 256, 512, 16}, {128, 512, 128, 2},
           {128, 128, 512, 8}, {4, 32, 16, 1}, {2, 24, 16, 7}, {3, 40, 24, 3},
           // cuBLAS: more tokens, or columns that are not whole 16-byte chunks
           {64, 512, 192, 17}, {16, 256, 512, 33}, {4, 32, 12, 2},
           // the tensor-core kernel's shapes: rows past a warp's 16 / a block's 64, one chunk, two n-tiles
           {3, 40, 32, 9}, {2, 200, 160, 12}, {64, 256, 512, 3}}) {
    std::vector<float> w = random_vec(size_t(heads) * rows * cols, rng, 0.05f);
    for (float& x : w) x = round_bf16(x);
    const int x_stride = cols + 3, out_stride = rows + 5;
    std::vector<float> x = random_vec(size_t(T) * heads * x_stride, rng);
    DeviceBuffer d_w32 = cuda::to_device(w), d_w(w.size() * 2), d_x = cuda::to_device(x),
                 d_out(size_t(T) * heads * out_stride * 4);
    d_out.zero();
    cuda::to_bf16(d_w32.as<float>(), int64_t(w.size()), d_w.get(), nullptr);
    cuda::HeadBatchedGemm g{d_w.get(), heads, rows, cols};
    // Every path (forced where it takes the shape; else the GEMV or cuBLAS): the head GEMV, the
    // tensor-core kernel (head_mma_kernel.cuh: whole 32-column chunks, up to 16 tokens), cuBLAS.
    using Path = cuda::Blas::Path;
    for (const auto& [path, name] : {std::pair{Path::Auto, "auto"}, std::pair{Path::Kernel, "gemv"},
                                     std::pair{Path::TensorCore, "tensor-core"}, std::pair{Path::Gemm, "cuBLAS"}}) {
      blas.path = path;
      d_out.zero();
      blas.per_head(g, d_x.as<float>(), x_stride, T, d_out.as<float>(), out_stride, nullptr);
      const std::vector<float> got = cuda::to_host<float>(d_out, size_t(T) * heads * out_stride);
      const double worst = absorption_error(
          got, [&](int h, int r, int c) { return double(w[(size_t(h) * rows + r) * cols + c]); }, x, heads, rows, cols,
          T, x_stride, out_stride);
      EXPECT_LE(worst, 1e-4) << heads << " heads " << rows << "x" << cols << ", " << T << " tokens, " << name;
      std::printf("  absorption %d heads %dx%d, %d tokens (%s): max error %.2e\n", heads, rows, cols, T, name, worst);
    }
    blas.path = Path::Auto;
    // The fp32 path (precise mode): fp32 weights and activations, against double to fp32 rounding.
    std::vector<float> w32 = random_vec(w.size(), rng, 0.05f);
    DeviceBuffer d_w32b = cuda::to_device(w32), d_out32(size_t(T) * heads * out_stride * 4);
    blas.per_head({d_w32b.get(), heads, rows, cols, true}, d_x.as<float>(), x_stride, T, d_out32.as<float>(), out_stride,
                  nullptr);
    const std::vector<float> got32 = cuda::to_host<float>(d_out32, size_t(T) * heads * out_stride);
    double worst32 = 0;
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < heads; ++h) {
        double mx = 0;
        std::vector<double> ref(static_cast<size_t>(rows));
        for (int r = 0; r < rows; ++r) {
          double acc = 0;
          for (int c2 = 0; c2 < cols; ++c2)
            acc += double(w32[(size_t(h) * rows + r) * cols + c2]) * x[(size_t(t) * heads + h) * x_stride + c2];
          ref[size_t(r)] = acc;
          mx = std::max(mx, std::fabs(acc));
        }
        for (int r = 0; r < rows; ++r)
          worst32 = std::max(worst32, std::fabs(got32[(size_t(t) * heads + h) * out_stride + r] - ref[size_t(r)]) / mx);
      }
    EXPECT_LE(worst32, 2e-6) << "fp32 absorption " << heads << " heads";
    std::printf("  absorption fp32 %d heads %dx%d, %d tokens: max error %.2e\n", heads, rows, cols, T, worst32);
  }
}

// The query's rope done by W_UK's launch (cuda::HeadRope, GpuModelOptions::rope_in_wuk): one token
// of bf16 or f16 rows on the head GEMV takes it, and q's latent-space rows come out bit for bit as
// from the rope kernel (DeviceRope::apply_to, itself against the CPU in the fused cache-write
// tests) and the product alone: the product's part and the rotated part, both rope styles, at
// positions up to 150K. Products of more tokens, and of fp32 rows (cuBLAS), do not take it.
TEST(CudaAttention, AbsorptionProductDoesTheQueryRopeInItsLaunch) {
  SPARSEMLA_REQUIRE_GPU();
  std::mt19937 rng(16);
  const ops::Rope rope = plain_rope(64, 1e4f);
  const cuda::DeviceRope drope(rope);
  cuda::Blas blas;
  for (auto [heads, nope, kvl] : std::vector<std::tuple<int, int, int>>{{64, 192, 512}, {16, 128, 512}, {3, 16, 40}})
    for (bool f16 : {false, true})
      for (ops::RopeStyle style : {ops::RopeStyle::HalfSplit, ops::RopeStyle::Interleaved}) {
        const int T = 1, qk = nope + 64, lat = kvl + 64;
        std::vector<float> w = random_vec(size_t(heads) * kvl * nope, rng, 0.05f);
        std::vector<uint16_t> wbits(w.size());
        for (size_t i = 0; i < w.size(); ++i) wbits[i] = f16 ? f32_to_fp16(w[i]) : f32_to_bf16(w[i]);
        std::vector<float> q = random_vec(size_t(T) * heads * qk, rng);
        const std::vector<int64_t> pos{int64_t(rng() % 150000)};
        DeviceBuffer d_w = cuda::to_device(wbits), d_q = cuda::to_device(q), d_pos = cuda::to_device(pos);
        cuda::HeadBatchedGemm g{d_w.get(), heads, kvl, nope};
        if (f16) g.form = cuda::HeadWeights::F16;
        ASSERT_TRUE(blas.takes_rope(g, 1));
        EXPECT_FALSE(blas.takes_rope(g, 2)) << "one-token launches only";
        EXPECT_FALSE(blas.takes_rope({d_w.get(), heads, kvl, nope, true}, 1)) << "fp32 rows: cuBLAS";
        const size_t n_out = size_t(T) * heads * lat;
        DeviceBuffer d_sep(n_out * 4), d_one(n_out * 4);
        d_sep.zero();
        d_one.zero();
        drope.apply_to(d_q.as<float>() + nope, qk, d_sep.as<float>() + kvl, lat, 64, T, heads,
                       d_pos.as<int64_t>(), style, nullptr);
        blas.per_head(g, d_q.as<float>(), qk, T, d_sep.as<float>(), lat, nullptr);
        const cuda::HeadRope hr{d_q.as<float>() + nope, qk, d_one.as<float>() + kvl, lat, d_pos.as<int64_t>(),
                                drope.table(style)};
        blas.per_head(g, d_q.as<float>(), qk, T, d_one.as<float>(), lat, nullptr, &hr);
        const std::vector<float> sep = cuda::to_host<float>(d_sep, n_out), one = cuda::to_host<float>(d_one, n_out);
        size_t rotated_nonzero = 0;
        for (int h = 0; h < heads; ++h)
          for (int c = kvl; c < lat; ++c) rotated_nonzero += one[size_t(h) * lat + c] != 0.0f;
        EXPECT_GT(rotated_nonzero, size_t(heads) * 60) << "the rotated part was not written";
        EXPECT_EQ(std::memcmp(sep.data(), one.data(), n_out * 4), 0)
            << heads << " heads, f16 " << f16 << ", style " << int(style) << ": not the bits of rope kernel + product";
      }
}

// The absorption weights read as the file stores them in f16 (attn_k_b / attn_v_b, no bf16 copy):
// the decode-sized GEMV against the exact stored values times x rounded to bf16 (in double), and
// the larger batches' cuBLAS path against those values rounded to bf16 (its widened copy).
TEST(CudaAttention, AbsorptionWeightsReadAsStored) {
  SPARSEMLA_REQUIRE_GPU();
  std::mt19937 rng(16);
  cuda::Blas blas;
  for (auto [heads, rows, cols, T] :
       std::vector<std::tuple<int, int, int, int>>{{64, 512, 192, 1}, {64, 256, 512, 1}, {64, 512, 192, 5},
                                                   {64, 256, 512, 16}, {3, 40, 96, 3}, {5, 33, 32, 1},
                                                   {64, 512, 192, 17}, {16, 256, 512, 33}, {3, 40, 96, 20}}) {
    SCOPED_TRACE(fmt::format("f16 {} heads {}x{}, {} tokens", heads, rows, cols, T));
    const int64_t n_rows = int64_t(heads) * rows;
    std::vector<float> w = random_vec(size_t(n_rows) * cols, rng, 0.05f);
    std::vector<uint16_t> stored(w.size());
    for (size_t i = 0; i < w.size(); ++i) {
      stored[i] = f32_to_fp16(w[i]);
      w[i] = fp16_to_f32(stored[i]);  // the values as stored
    }
    const bool gemv = T <= 16;
    const int x_stride = cols + 3, out_stride = rows + 5;
    const std::vector<float> x = random_vec(size_t(T) * heads * x_stride, rng);
    DeviceBuffer d_w = cuda::to_device(stored), d_x = cuda::to_device(x), d_out(size_t(T) * heads * out_stride * 4);
    d_out.zero();
    cuda::HeadBatchedGemm g{d_w.get(), heads, rows, cols, false, cuda::HeadWeights::F16};
    blas.per_head(g, d_x.as<float>(), x_stride, T, d_out.as<float>(), out_stride, nullptr);
    const std::vector<float> got = cuda::to_host<float>(d_out, size_t(T) * heads * out_stride);
    const double worst = absorption_error(
        got,
        [&](int h, int r, int c) {
          const float wv = w[(size_t(h) * rows + r) * cols + c];
          return double(gemv ? wv : round_bf16(wv));
        },
        x, heads, rows, cols, T, x_stride, out_stride);
    EXPECT_LE(worst, 1e-4);
    std::printf("  absorption f16 %d heads %dx%d, %d tokens (%s): max error %.2e\n", heads, rows, cols, T,
                gemv ? "GEMV" : "cuBLAS", worst);
  }
}

// Quantized absorption weights read in place (HeadWeights::Quant, absorb_q8.cu), every type of the
// int8 head product: up to 16 tokens the int8 product, against double sums of the weights as the CPU
// dequantizes them (exact) times x_hat, each head's activations quantized on two levels as
// quantize_activations does (the reference of test_cuda_matmul.cpp): only fp32 rounding differs
// (1e-5); larger batches the dequantized bf16 copy for cuBLAS, against those values rounded to
// bf16 times x rounded to bf16 (1e-4, as the bf16 path). Shapes: GLM-5's W_UK (Q8_0 192 columns)
// and W_UV (512), DeepSeek-V3.2's, one 32-block per row, heads of several blocks of rows whose last
// block is partly filled (3 x 520 x 32, 2 x 104 x 768).
TEST(CudaAttention, QuantizedAbsorptionWeightsReadInPlace) {
  SPARSEMLA_REQUIRE_GPU();
  using gguf::GgmlType;
  struct Case {
    int heads, rows, cols, T;
  };
  // (Every head's rows a whole number of 16-byte pieces: head_q8_supported.)
  const std::vector<Case> q8_cases = {{64, 512, 192, 1}, {64, 256, 512, 1}, {64, 512, 192, 5}, {64, 256, 512, 16},
                                      {128, 512, 128, 2}, {5, 40, 32, 1},   {3, 520, 32, 2},   {3, 40, 96, 3},
                                      {2, 12, 64, 9},     {64, 512, 192, 17}, {3, 40, 96, 20}};
  const std::vector<Case> k_cases = {{64, 256, 512, 1}, {16, 256, 512, 16}, {5, 40, 256, 1},
                                     {2, 104, 768, 3},  {8, 64, 512, 20}};
  cuda::Blas blas;
  uint32_t seed = 40;
  for (GgmlType type : {GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K, GgmlType::Q2_K,
                        GgmlType::Q3_K, GgmlType::IQ4_XS, GgmlType::IQ2_XXS}) {
    for (const Case& c : type == GgmlType::Q8_0 ? q8_cases : k_cases) {
      const std::string what = fmt::format("{} {} heads {}x{}, {} tokens", gguf::type_name(type), c.heads, c.rows,
                                           c.cols, c.T);
      SCOPED_TRACE(what);
      const int64_t n_rows = int64_t(c.heads) * c.rows;
      const std::vector<uint8_t> bytes = cuda::test_q8::make_weight(type, n_rows, c.cols, seed++);
      const uint64_t rb = gguf::row_bytes(type, uint64_t(c.cols));
      std::vector<float> w(size_t(n_rows) * c.cols);
      const ops::Weight host{type, c.cols, n_rows, rb, bytes.data()};
      for (int64_t r = 0; r < n_rows; ++r) ops::dequantize_row(host, r, w.data() + r * c.cols);
      DeviceBuffer d_w = cuda::to_device(bytes);
      ASSERT_TRUE(cuda::head_q8_supported(type, c.rows, c.cols, d_w.get()));
      const int x_stride = c.cols + 32, out_stride = c.rows + 5;
      std::mt19937 rng(seed++);
      const std::vector<float> x = random_vec(size_t(c.T) * c.heads * x_stride, rng);
      DeviceBuffer d_x = cuda::to_device(x), d_out(size_t(c.T) * c.heads * out_stride * 4);
      d_out.zero();
      const cuda::HeadBatchedGemm g{d_w.get(), c.heads, c.rows, c.cols, false, cuda::HeadWeights::Quant, type};
      blas.per_head(g, d_x.as<float>(), x_stride, c.T, d_out.as<float>(), out_stride, nullptr);
      const std::vector<float> got = cuda::to_host<float>(d_out, size_t(c.T) * c.heads * out_stride);
      const bool gemv = c.T <= 16;
      // x_hat per (token, head): the head's first cols values quantized on two levels.
      std::vector<double> xhat(size_t(c.T) * c.heads * c.cols);
      for (int64_t th = 0; th < int64_t(c.T) * c.heads; ++th) {
        const std::vector<float> row(x.begin() + th * x_stride, x.begin() + th * x_stride + c.cols);
        const std::vector<double> v = cuda::test_q8::dequantized(cuda::test_q8::quantize_on_host(row, 2));
        std::copy(v.begin(), v.end(), xhat.begin() + th * c.cols);
      }
      const auto weight = [&](int h, int r, int col) {
        const float wv = w[(size_t(h) * c.rows + r) * c.cols + col];
        return double(gemv ? wv : round_bf16(wv));
      };
      const double worst =
          gemv ? absorption_error(got, weight, x, c.heads, c.rows, c.cols, c.T, x_stride, out_stride,
                                  [&](int t, int h, int col) { return xhat[(size_t(t) * c.heads + h) * c.cols + col]; })
               : absorption_error(got, weight, x, c.heads, c.rows, c.cols, c.T, x_stride, out_stride);
      EXPECT_LE(worst, gemv ? 1e-5 : 1e-4);
      std::printf("  absorption %s (%s): max error %.2e\n", what.c_str(), gemv ? "int8" : "cuBLAS", worst);
    }
  }
  // Not taken: a type without int8 units, rows that are not whole blocks, a misaligned head.
  EXPECT_FALSE(cuda::head_q8_supported(GgmlType::Q4_0, 8, 64, nullptr));
  EXPECT_FALSE(cuda::head_q8_supported(GgmlType::Q4_K, 8, 192, nullptr));
  EXPECT_FALSE(cuda::head_q8_supported(GgmlType::Q8_0, 3, 32, nullptr));  // 102-byte heads
  EXPECT_FALSE(cuda::head_q8_supported(GgmlType::Q8_0, 8, 32, reinterpret_cast<const void*>(uintptr_t(8))));
}

}  // namespace
}  // namespace sparsemla

#else

TEST(CudaAttention, Skipped) { GTEST_SKIP() << "built without CUDA"; }

#endif
