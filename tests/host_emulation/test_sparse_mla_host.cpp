// The generic sparse MLA attention kernels (src/ops/cuda/sparse_mla_kernels.cuh) run by the host
// emulation (cuda/emu.h) as sparse_mla.cu launches them (mma_geometry, mma_launch): the mma kernel
// over bf16 and fp8 latent rows with 16, 32 and 64 heads per block, one and two stages, one split
// and several (so the combine kernel merges them), and the fma kernel over bf16, fp8 and f32 rows;
// on the shapes of CudaAttention.SparseMlaMatchesTheCpuReference (fewer heads and shorter contexts
// where the emulation gets slow), over paged caches with shuffled block tables, selections with -1
// entries and dense contexts. So the kernels' tiles, gathers, fp8 widening, score exchange,
// online softmax and split merge are checked in CI, where there is no GPU; that test runs them on
// one.
//
// Reference: ops::latent_attention on the rows as the cache stores them (decoded on the CPU), with q
// rounded to bf16 for the tensor-core kernel; error relative to the head's largest |output| <= 1e-2,
// as the GPU test. Besides: the same bits with the block's threads run in the opposite order (no
// race between them, nor between the copies and their reads). And the stand-ins the kernels need:
// the fp8 / bf16 / fp16 conversions against the CPU's (util/half.h) on every fp8 code and sample
// floats, and mma.sync / ldmatrix (cuda/ops/cuda/mma.cuh) against a plain product.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "ops/cpu/attention.h"
#include "ops/cuda/sparse_mla_kernels.cuh"
#include "../unit/mla_test_inputs.h"
#include "../unit/paged_test_util.h"
#include "util/half.h"

namespace sparsemla::cuda {
namespace {

using namespace mla;
// (the scalar conversions of util/half.h, not the device array ones of small_ops.h)
using sparsemla::bf16_to_f32;
using sparsemla::f32_to_bf16;

// --- The stand-ins' conversions against the CPU's -------------------------------------------------

bool same_float(float a, float b) { return (std::isnan(a) && std::isnan(b)) || a == b; }

TEST(SparseMlaOnTheHost, ConversionStandInsMatchTheCpu) {
  for (int c = 0; c < 256; ++c) {
    const uint8_t code = uint8_t(c);
    ASSERT_TRUE(same_float(fp8_to_float(code), fp8_e4m3_to_f32(code))) << c;
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(c | (255 - c) << 8), __NV_E4M3);
    ASSERT_TRUE(same_float(fp16_to_f32(h.x), fp8_e4m3_to_f32(code))) << c;
    ASSERT_TRUE(same_float(fp16_to_f32(h.y), fp8_e4m3_to_f32(uint8_t(255 - c)))) << c;
    const uint32_t hi = fp8x2_hi_to_f16x2(uint32_t(c) << 16 | uint32_t(255 - c) << 24);
    ASSERT_EQ(hi, uint32_t(h.x) | uint32_t(h.y) << 16) << c;
  }
  // Sample floats: every fp8 value, the midpoints between neighbours and just off them, beyond the
  // largest, subnormals of fp8, fp16 and bf16, random magnitudes; both signs.
  std::vector<float> xs = {0.0f, INFINITY, NAN, 448.0f, 449.0f, 464.0f, 465.0f, 1e6f, 1e-30f, 65504.0f, 65520.0f,
                           3e38f, 1e-40f, 0x1p-133f, 0x1p-149f};
  for (int c = 0; c < 0x7e; ++c) {
    const float a = fp8_e4m3_to_f32(uint8_t(c)), b = fp8_e4m3_to_f32(uint8_t(c + 1)), mid = (a + b) / 2;
    for (float x : {a, b, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)}) xs.push_back(x);
  }
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> e(-40.0f, 20.0f);
  for (int i = 0; i < 20000; ++i) xs.push_back(std::exp2(e(rng)) * (1.0f + float(i % 977) / 977.0f));
  for (uint32_t u = 0x3f800000u; u < 0x3f800000u + 70000u; u += 7u) xs.push_back(bits_to_f32(u));  // bf16 ties
  const size_t n = xs.size();
  for (size_t i = 0; i < n; ++i) xs.push_back(-xs[i]);
  for (float x : xs) {
    const uint8_t want = f32_to_fp8_e4m3(x), got = float_to_fp8(x);
    if (std::isnan(x)) ASSERT_EQ(got & 0x7f, 0x7f) << x;
    else ASSERT_EQ(got, want) << x;
    ASSERT_TRUE(same_float(__bfloat162float(__float2bfloat16(x)), bf16_to_f32(f32_to_bf16(x)))) << x;
    ASSERT_TRUE(same_float(__half2float(__float2half(x)), fp16_to_f32(f32_to_fp16(x)))) << x;
    const uint32_t p = pack_bf16(x, -x);
    ASSERT_TRUE(same_float(bf16_to_f32(uint16_t(p)), bf16_to_f32(f32_to_bf16(x)))) << x;
    ASSERT_TRUE(same_float(bf16_to_f32(uint16_t(p >> 16)), bf16_to_f32(f32_to_bf16(-x)))) << x;
  }
  // Eight fp8 values times their scale as bf16 (the mma kernel's widening of fp8 rows).
  for (int c0 = 0; c0 < 256; c0 += 8) {
    uint8_t codes[8];
    for (int i = 0; i < 8; ++i) {
      codes[i] = uint8_t((c0 + i * 37) % 256);
      if ((codes[i] & 0x7f) == 0x7f) codes[i] = 0;  // (no NaN in a cache)
    }
    uint2 v;
    std::memcpy(&v, codes, 8);
    for (float scale : {1.0f, 0.0123f, 3.7f}) {
      const uint4 w = widen_fp8x8(v, scale);
      uint16_t got[8];
      std::memcpy(got, &w, 16);
      for (int i = 0; i < 8; ++i) {
        ASSERT_EQ(got[i], f32_to_bf16(fp8_e4m3_to_f32(codes[i]) * scale)) << int(codes[i]) << " x " << scale;
      }
    }
  }
}

// --- mma.sync and ldmatrix against a plain product ------------------------------------------------

// One warp: C (16x8, fp32) = A (16x16, row-major in shared memory) B (16x8) + C0, with B stored
// as [n][k] (ldmatrix as stored) or [k][n] (ldmatrix .trans), fragments loaded as the attention
// kernels load them.
__global__ void mma_probe_kernel(const uint16_t* a, const uint16_t* b_nk, const uint16_t* b_kn, bool trans, bool half,
                                 float* c) {
  __shared__ __align__(16) uint16_t sA[16][24], sB[16][24];  // (rows of 48 bytes: 16-byte aligned)
  const int lane = threadIdx.x, mi = lane / 8, ri = lane % 8, g = lane / 4, q = lane % 4;
  for (int i = lane; i < 256; i += 32) sA[i / 16][i % 16] = a[i];
  for (int i = lane; i < 128; i += 32) {
    if (trans) sB[i / 8][i % 8] = b_kn[i];
    else sB[i / 16][i % 16] = b_nk[i];
  }
  __syncwarp();
  uint32_t fa[4], fb[4];
  ldmatrix_x4(fa, &sA[(mi % 2) * 8 + ri][(mi / 2) * 8]);
  // As stored: matrices (n 0-7, k 0-7) and (n 0-7, k 8-15) give b0 and b1 ([n][k] = B's columns);
  // transposed: rows k 0-7 and k 8-15 of [k][n] (the kernel's P V).
  if (trans) ldmatrix_x4_trans(fb, &sB[(mi % 2) * 8 + ri][0]);
  else ldmatrix_x4(fb, &sB[ri][(mi % 2) * 8]);
  float acc[4];
  for (int e = 0; e < 4; ++e) acc[e] = c[(g + 8 * (e / 2)) * 8 + 2 * q + e % 2];
  if (half) mma_16816(acc, fa, fb, __half());
  else mma_16816(acc, fa, fb, __nv_bfloat16());
  __syncwarp();
  for (int e = 0; e < 4; ++e) c[(g + 8 * (e / 2)) * 8 + 2 * q + e % 2] = acc[e];
}

TEST(SparseMlaOnTheHost, MmaAndLdmatrixStandInsMultiply) {
  std::mt19937 rng(9);
  std::uniform_int_distribution<int> d(-64, 64);
  for (bool half : {false, true})
    for (bool trans : {false, true}) {
      // Small integers (exact in both 16-bit types), so that the product is exact too.
      std::vector<float> A(256), B(128), C(128);  // B [k][n]
      for (float& x : A) x = float(d(rng));
      for (float& x : B) x = float(d(rng)) / 8.0f;
      for (float& x : C) x = float(d(rng));
      const auto bits = [&](float x) { return half ? f32_to_fp16(x) : f32_to_bf16(x); };
      std::vector<uint16_t> a(256), b_nk(128), b_kn(128);
      for (int i = 0; i < 256; ++i) a[size_t(i)] = bits(A[size_t(i)]);
      for (int k = 0; k < 16; ++k)
        for (int n = 0; n < 8; ++n) {
          b_kn[size_t(k * 8 + n)] = bits(B[size_t(k * 8 + n)]);
          b_nk[size_t(n * 16 + k)] = bits(B[size_t(k * 8 + n)]);
        }
      std::vector<float> got = C;
      emu::launch(mma_probe_kernel, dim3(1), dim3(32), 0, emu::Order::kReversed, a.data(), b_nk.data(), b_kn.data(),
                  trans, half, got.data());
      for (int m = 0; m < 16; ++m)
        for (int n = 0; n < 8; ++n) {
          double want = C[size_t(m * 8 + n)];
          for (int k = 0; k < 16; ++k) want += double(A[size_t(m * 16 + k)]) * B[size_t(k * 8 + n)];
          ASSERT_EQ(got[size_t(m * 8 + n)], float(want)) << "half " << half << " trans " << trans << " " << m << ","
                                                         << n;
        }
    }
}

// --- The attention kernels ------------------------------------------------------------------------

using test_paged::Paged;
using test_paged::random_vec;
float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

// Latent rows [n_slots][kv_lora + rope] stored in the cache format of `dtype` (attention.h: fp8 in
// groups of 128 with scale amax / 448, as write_latent_rows stores them), and decoded on the CPU.
struct HostCache {
  std::vector<uint8_t> bytes;  // (std::vector's allocation: 16-byte aligned, as a device buffer)
  int64_t row_bytes = 0;
  std::vector<float> decoded;
};
HostCache make_cache(const std::vector<float>& rows, int64_t n_slots, int kv_lora, int rope, KvDtype dtype) {
  const int n = kv_lora + rope, groups = latent_groups(kv_lora);
  HostCache c;
  c.row_bytes = latent_row_bytes(dtype, kv_lora, rope);
  c.bytes.assign(size_t(n_slots * c.row_bytes), 0);
  c.decoded.resize(size_t(n_slots * n));
  for (int64_t s = 0; s < n_slots; ++s) {
    const float* x = rows.data() + s * n;
    uint8_t* row = c.bytes.data() + s * c.row_bytes;
    float* out = c.decoded.data() + s * n;
    for (int i = 0; i < n; ++i) {
      if (dtype == KvDtype::F32) {
        std::memcpy(row + 4 * i, &x[i], 4);
        out[i] = x[i];
      } else if (dtype == KvDtype::BF16 || i >= kv_lora) {
        const uint16_t h = f32_to_bf16(x[i]);
        std::memcpy(row + (dtype == KvDtype::BF16 ? 2 * i : kv_lora + 4 * groups + 2 * (i - kv_lora)), &h, 2);
        out[i] = bf16_to_f32(h);
      }
    }
    if (dtype != KvDtype::FP8) continue;
    for (int g = 0; g < groups; ++g) {
      const int i0 = g * kFp8Group, i1 = std::min(kv_lora, i0 + kFp8Group);
      float amax = 0.0f;
      for (int i = i0; i < i1; ++i) amax = std::max(amax, std::fabs(x[i]));
      const float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
      std::memcpy(row + kv_lora + 4 * g, &scale, 4);
      for (int i = i0; i < i1; ++i) {
        row[i] = f32_to_fp8_e4m3(x[i] / scale);
        out[i] = fp8_e4m3_to_f32(row[i]) * scale;
      }
    }
  }
  return c;
}

using test_paged::MlaCase;

// A problem of `c` (as check_mla builds it) and the kernels' output for it.
struct Problem {
  MlaCase c;
  KvDtype dtype;
  Paged pg;
  std::vector<int32_t> seq, n_ctx, sel;
  std::vector<float> q;
  HostCache cache;
  AttentionArgs a;
  std::vector<float> out;

  Problem(const MlaCase& c_, KvDtype d, std::mt19937& rng) : c(c_), dtype(d), pg(test_paged::mla_lens(c_), c_.block_size, rng) {
    test_paged::MlaInputs in = test_paged::mla_inputs(c, pg, rng);
    seq = std::move(in.seq);
    n_ctx = std::move(in.n_ctx);
    sel = std::move(in.sel);
    q = std::move(in.q);
    cache = make_cache(in.rows, pg.n_slots(), c.kv_lora, c.rope, dtype);
    const int T = int(c.ctx.size());
    a.q = q.data();
    a.T = T;
    a.heads = c.heads;
    a.kv_lora = c.kv_lora;
    a.rope = c.rope;
    a.scale = 1.0f / std::sqrt(192.0f);
    a.seq = seq.data();
    a.n_ctx = n_ctx.data();
    a.selected = c.top_k > 0 ? sel.data() : nullptr;
    a.top_k = c.top_k;
    a.max_ctx = in.max_ctx;
    a.selected_front = c.front;
    a.latent = {cache.bytes.data(), cache.row_bytes, pg.tables.data(), pg.max_blocks, pg.block_size};
    a.dtype = dtype;
  }

  // The largest error of out against the CPU (q rounded to bf16 for the tensor-core kernel).
  double error(bool bf16_q) const {
    const int D = c.kv_lora + c.rope;
    std::vector<float> ref(size_t(c.kv_lora)), logits, qh(static_cast<size_t>(D));
    double worst = 0;
    for (int t = 0; t < int(a.T); ++t) {
      std::vector<const float*> rp;
      const int n = test_paged::mla_rows(c, n_ctx[size_t(t)]);
      for (int i = 0; i < n; ++i) {
        const int32_t p = c.top_k > 0 ? sel[size_t(t) * c.top_k + i] : i;
        if (p >= 0) rp.push_back(cache.decoded.data() + pg.slot(seq[size_t(t)], p) * D);
      }
      for (int h = 0; h < c.heads; ++h) {
        for (int i = 0; i < D; ++i) {
          const float x = q[(size_t(t) * c.heads + h) * D + i];
          qh[size_t(i)] = bf16_q ? round_bf16(x) : x;
        }
        ops::latent_attention(qh.data(), qh.data() + c.kv_lora, rp.data(), int64_t(rp.size()), c.kv_lora, c.rope,
                              a.scale, ref.data(), logits);
        float mx = 0;
        for (float v : ref) mx = std::max(mx, std::fabs(v));
        const float* g = out.data() + (size_t(t) * c.heads + h) * c.kv_lora;
        for (int i = 0; i < c.kv_lora; ++i) {
          const double err = std::fabs(g[i] - ref[size_t(i)]) / std::max(mx, 1e-6f);
          if (!(err <= worst)) worst = std::isnan(err) ? INFINITY : err;
        }
      }
    }
    return worst;
  }
};

// Runs launch(order) in both orders (reversed first) and requires the same output bits.
template <class Launch>
void run_both_orders(Problem& p, const Launch& launch) {
  const size_t n = size_t(p.a.T) * p.c.heads * p.c.kv_lora;
  p.out.assign(n, NAN);
  p.a.out = p.out.data();
  launch(emu::Order::kReversed);
  const std::vector<float> first = p.out;
  p.out.assign(n, NAN);
  p.a.out = p.out.data();
  launch(emu::Order::kForward);
  ASSERT_EQ(std::memcmp(first.data(), p.out.data(), n * sizeof(float)), 0) << "the two thread orders differ";
}

// The mma kernel with hg head groups per block, `stages` tiles in flight, at most `splits` splits
// and `tile_pairs` sets of warps per head group, then the combine kernel where there are several
// splits, as sparse_mla() launches them; returns the geometry's splits.
int run_mma(Problem& p, int hg, int stages, int splits, int tile_pairs = 1) {
  const AttentionArgs& a = p.a;
  // (plan_mma's rows: front selections up to the longest context)
  const int64_t rows = !a.selected ? a.max_ctx : a.selected_front ? std::min<int64_t>(a.top_k, a.max_ctx) : a.top_k;
  const int tiles = std::max(1, ceil_div(rows, kRows));
  const MlaGeometry geo = mma_geometry(a, hg, stages, tiles, splits, tile_pairs);
  const MmaLaunch l = mma_launch(a, geo);
  std::vector<float> part(geo.splits > 1 ? size_t(a.T) * geo.splits * a.heads * partial_row_floats(a.kv_lora) : 0, NAN);
  run_both_orders(p, [&](emu::Order order) {
    std::fill(part.begin(), part.end(), NAN);
    emu::launch(l.kernel, l.grid, dim3(unsigned(l.threads)), l.smem, order, p.a, geo, part.data());
    if (geo.splits > 1) {
      const dim3 grid(unsigned(ceil_div(a.kv_lora, kCombineDims)), unsigned(a.heads), unsigned(a.T));
      emu::launch(mla_combine_kernel, grid, dim3(kCombineDims), 0, order, p.a, geo.splits,
                  static_cast<const float*>(part.data()));
    }
  });
  return geo.splits;
}

void run_fma(Problem& p) {
  const AttentionArgs& a = p.a;
  ASSERT_LE(a.kv_lora, kFmaThreads * kFmaMaxOut);
  const dim3 grid(unsigned(a.heads), unsigned(a.T));
  run_both_orders(p, [&](emu::Order order) {
    if (a.dtype == KvDtype::FP8) emu::launch(mla_fma_kernel<KvDtype::FP8>, grid, dim3(kFmaThreads), 0, order, p.a);
    else if (a.dtype == KvDtype::F32) emu::launch(mla_fma_kernel<KvDtype::F32>, grid, dim3(kFmaThreads), 0, order, p.a);
    else emu::launch(mla_fma_kernel<KvDtype::BF16>, grid, dim3(kFmaThreads), 0, order, p.a);
  });
}

// The Hopper kernel's cluster merge (sparse_mla_sm90.cu, merge_splits: weights from merge_weights8,
// then the splits' sums added in split order) against the merge kernel it replaces, to the bit, on
// partial rows as the attention kernels leave them: 2-8 splits, maxima across a wide range (log2
// domain), an empty split (maximum -inf, denominator 0) in one token and only empty splits in another
// (output 0).
TEST(SparseMlaOnTheHost, ClusterMergeHasTheMergeKernelsBits) {
  std::mt19937 rng(52);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> max_of(-30.0f, 40.0f), den_of(0.01f, 300.0f);
  const int T = 4, H = 5, kv = 512;
  const int64_t row = partial_row_floats(kv);
  for (int S : {2, 3, 5, 7, 8}) {
    std::vector<float> part(size_t(T) * S * H * row), out(size_t(T) * H * kv, NAN);
    for (int t = 0; t < T; ++t)
      for (int sp = 0; sp < S; ++sp)
        for (int h = 0; h < H; ++h) {
          float* r = part.data() + ((int64_t(t) * S + sp) * H + h) * row;
          const bool empty = (t == 1 && sp == 0) || t == 2;
          for (int c = 0; c < kv; ++c) r[c] = empty ? 0.0f : nd(rng) * 40.0f;
          r[kv] = empty ? -INFINITY : max_of(rng);
          r[kv + 1] = empty ? 0.0f : den_of(rng);
          r[kv + 2] = r[kv + 3] = NAN;  // (padding: read by neither)
        }
    AttentionArgs a;
    a.T = T;
    a.heads = H;
    a.kv_lora = kv;
    a.out = out.data();
    const dim3 grid(unsigned(ceil_div(kv, kCombineDims)), unsigned(H), unsigned(T));
    emu::launch(mla_combine_kernel, grid, dim3(kCombineDims), 0, emu::Order::kForward, a, S,
                static_cast<const float*>(part.data()));
    int64_t differ = 0;
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < H; ++h) {
        float m[kMergeMaxSplits], l[kMergeMaxSplits], w[kMergeMaxSplits];
        for (int sp = 0; sp < kMergeMaxSplits; ++sp) {
          const float* r = part.data() + ((int64_t(t) * S + sp) * H + h) * row;
          m[sp] = sp < S ? r[kv] : -INFINITY;
          l[sp] = sp < S ? r[kv + 1] : 0.0f;
        }
        merge_weights8(m, l, w);
        for (int c = 0; c < kv; ++c) {
          float acc = 0.0f;
          for (int sp = 0; sp < S; ++sp) acc += w[sp] * part[size_t(((int64_t(t) * S + sp) * H + h) * row + c)];
          const float got = out[(size_t(t) * H + h) * kv + c];
          differ += std::memcmp(&acc, &got, 4) != 0;
          if (t == 2) ASSERT_EQ(got, 0.0f) << "only empty splits: " << S;
        }
      }
    EXPECT_EQ(differ, 0) << S << " splits: values of " << T * H * kv << " differ from the merge kernel's";
  }
}

const char* dtype_name(KvDtype d) { return d == KvDtype::FP8 ? "fp8" : d == KvDtype::F32 ? "f32" : "bf16"; }

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The GPU test's kMlaCases, the first four with shorter contexts and selections (still above, at
// and below top-k, dense, several tiles per split), and one of its cases of rising scores.
const std::vector<MlaCase> kCases = {
    {64, 512, 64, {600, 256, 100}, 256, 2, 64},  // GLM-5 (top-k 2048 on the GPU): context above, at and below top-k
    {128, 512, 64, {400}, 256, 1, 64},           // DeepSeek-V3.2
    {8, 512, 64, {300, 40}, 256, 2, 16},         // GLM-5 at tensor parallel 8
    {16, 512, 64, {200}, 0, 1, 16},              // dense
    {2, 24, 8, {12, 30, 1}, 12, 2, 16},          // glm_pub
    {4, 32, 16, {25, 5}, 12, 1, 4},              // glm_share
    {4, 256, 32, {40}, 12, 1, 16},               // glm_q4_k
    {4, 32, 8, {15, 9}, 0, 2, 16},               // dsv32_groups, dense
    {2, 16, 8, {50}, 12, 1, 16},                 // dsv32_pub
    {16, 512, 64, {300}, 0, 1, 16, false, 3.0f}, // dense, scores rising (the lazy maximum moves)
};

TEST(SparseMlaOnTheHost, MmaKernelMatchesTheCpuReference) {
  std::mt19937 rng(5);
  for (size_t ci = 0; ci < kCases.size(); ++ci) {
    const MlaCase& c = kCases[ci];
    for (KvDtype d : {KvDtype::BF16, KvDtype::FP8}) {
      // The launch's own heads per block (64 above 32 heads, else 32) and two stages, in one split
      // and four (where there is more than one tile: the combine kernel merges them); on the GLM-5
      // shapes at tensor parallel 8 and dense, and the small shapes, also 16, 32 and 64 heads per
      // block with one stage and two (the launch takes any of them when asked, or on smaller
      // devices). Also with two tile pairs (16 heads, two stages) in one split and four, and at 32
      // heads in four: the splits' tiles in steps of two, the last step of an odd count (or of a
      // single tile) with one set of warps idle.
      const int own = c.heads > 32 ? 4 : 2;
      std::vector<std::tuple<int, int, int, int>> shapes = {{own, 2, 1, 1}, {own, 2, 4, 1}};
      if (ci == 2 || ci == 3 || c.kv_lora < 512)
        for (int hg : {1, 2, 4})
          for (int stages : {1, 2})
            if (hg != own || stages != 2) shapes.emplace_back(hg, stages, 4, 1);
      for (int splits : {1, 4}) shapes.emplace_back(1, 2, splits, 2);
      if (mla_smem::tile_pairs_fit(2, c.kv_lora, mla_smem::stride(c.kv_lora, c.rope))) shapes.emplace_back(2, 2, 4, 2);
      for (auto [hg, stages, splits, tile_pairs] : shapes) {
        Problem p(c, d, rng);
        const auto t0 = std::chrono::steady_clock::now();
        const int got_splits = run_mma(p, hg, stages, splits, tile_pairs);
        if (HasFailure()) return;
        const double err = p.error(true);
        std::printf("  mma %s heads %d latent %d+%d top-k %d: %d heads/block, %d stages, %d splits, %d tile pair%s: "
                    "max error %.2e (%.2f s)\n",
                    dtype_name(d), c.heads, c.kv_lora, c.rope, c.top_k, hg * 16, stages, got_splits, tile_pairs,
                    tile_pairs == 1 ? "" : "s", err, seconds_since(t0));
        EXPECT_LE(err, 1e-2) << dtype_name(d) << " heads " << c.heads << " latent " << c.kv_lora << " heads/block "
                             << hg * 16 << " stages " << stages << " splits " << got_splits << " tile pairs "
                             << tile_pairs;
        if (HasFailure()) return;
      }
    }
  }
}

// Selections in top_k's order (AttentionArgs::selected_front) of tokens whose contexts are shorter
// than top_k beside one that is longer (a prefill's first tokens): each token's blocks stop after its
// own context's entries. The entries past it hold position 0 here (stale_tail), so a kernel that went
// over them would add row 0 to the token's sum and miss the CPU's (which takes only the token's
// entries); in four splits the short tokens' last splits are empty.
TEST(SparseMlaOnTheHost, FrontSelectionsStopAtEachTokensContext) {
  std::mt19937 rng(8);
  const std::vector<MlaCase> cases = {
      {64, 512, 64, {600, 100, 33, 255}, 256, 2, 16, true, 0.0f, true},  // GLM-5's shape
      {4, 32, 16, {25, 5, 1, 12}, 12, 2, 4, true, 0.0f, true},          // glm_share
  };
  for (const MlaCase& c : cases)
    for (KvDtype d : {KvDtype::BF16, KvDtype::FP8}) {
      for (int splits : {1, 4}) {
        Problem p(c, d, rng);
        const int got_splits = run_mma(p, c.heads > 32 ? 4 : 1, 2, splits);
        if (HasFailure()) return;
        const double err = p.error(true);
        std::printf("  mma %s heads %d top-k %d, %d splits: max error %.2e\n", dtype_name(d), c.heads, c.top_k,
                    got_splits, err);
        EXPECT_LE(err, 1e-2) << dtype_name(d) << " heads " << c.heads << " splits " << got_splits;
      }
      MlaCase s = c;
      s.heads = std::min(s.heads, 8);
      Problem p(s, d, rng);
      run_fma(p);
      if (HasFailure()) return;
      const double err = p.error(false);
      std::printf("  fma %s heads %d top-k %d: max error %.2e\n", dtype_name(d), s.heads, s.top_k, err);
      EXPECT_LE(err, 1e-2) << dtype_name(d) << " heads " << s.heads << " (fma)";
    }
}

TEST(SparseMlaOnTheHost, FmaKernelMatchesTheCpuReference) {
  std::mt19937 rng(6);
  std::vector<MlaCase> cases = kCases;
  cases.push_back({3, 20, 4, {30}, 12, 1, 16});  // rope of 4 with latent 20: only the fma kernel takes it
  for (const MlaCase& c : cases)
    for (KvDtype d : {KvDtype::BF16, KvDtype::FP8, KvDtype::F32}) {
      MlaCase s = c;
      if (s.heads > 8) s.heads = 8;  // (the fma kernel runs a block per head: fewer keep it quick)
      Problem p(s, d, rng);
      const auto t0 = std::chrono::steady_clock::now();
      run_fma(p);
      if (HasFailure()) return;
      const double err = p.error(false);
      std::printf("  fma %s heads %d latent %d+%d top-k %d: max error %.2e (%.2f s)\n", dtype_name(d), s.heads,
                  s.kv_lora, s.rope, s.top_k, err, seconds_since(t0));
      // f32 rows: the same arithmetic as the CPU but for the order of the sums.
      EXPECT_LE(err, d == KvDtype::F32 ? 1e-5 : 1e-2) << dtype_name(d) << " heads " << s.heads;
      if (HasFailure()) return;
    }
}

}  // namespace
}  // namespace sparsemla::cuda
