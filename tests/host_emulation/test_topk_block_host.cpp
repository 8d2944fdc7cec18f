// The top-k's block path kernel (src/ops/cuda/topk_block_kernel.cuh) run by the host emulation
// (cuda/emu.h) as topk_block.cu launches it: 4, 8 and 16 scores per thread on 1024 threads, and the
// 4K rows' 256- and 512-thread forms; rows that start on a 16-byte boundary and rows shifted past
// one (odd strides, a buffer that starts one score in); lengths of the whole stride, k + 1, k, k - 1,
// 1 and in between; random scores, few levels (ties at every digit's boundary), all equal (with
// -0 among +0) and rising. So the block's loads (every score of the row's stride read before the
// row's length is known, those past it dropped), its radix passes, bucket searches and the ordered
// write are checked in CI, where there is no GPU; CudaAttention.TopKBlockPathEqualsTheCpuSelection
// runs it on one.
//
// Reference: ops::top_k (the CPU engine's selection; ties at the boundary to the lower position),
// sorted ascending, then -1 past min(n, k). Scores past a row's length are NaN, so a kernel that
// took one of them would select or count it. Besides: the same output with the block's threads run
// in the opposite order (no race between them).
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "ops/cpu/basic.h"
#include "ops/cuda/topk_block_kernel.cuh"

namespace sparsemla::cuda {
namespace {

using namespace topk;

// Runs topk_block_kernel<PER, THREADS> over T rows of `stride` scores at `scores`.
template <int PER, int THREADS = kThreads>
std::vector<int32_t> run_block(const float* scores, int64_t stride, const std::vector<int32_t>& n, int k,
                               emu::Order order) {
  std::vector<int32_t> out(n.size() * size_t(k), -7);
  emu::launch(topk_block_kernel<PER, THREADS>, dim3(unsigned(n.size())), dim3(THREADS), 0, order, scores, stride,
              n.data(), k, out.data());
  return out;
}

// The CPU's selection of each row, ascending, -1 past min(n, k).
std::vector<int32_t> expected(const float* scores, int64_t stride, const std::vector<int32_t>& n, int k) {
  std::vector<int32_t> want;
  for (size_t t = 0; t < n.size(); ++t) {
    std::vector<int32_t> ref = ops::top_k(scores + int64_t(t) * stride, n[t], k);
    std::sort(ref.begin(), ref.end());
    ref.resize(size_t(k), -1);
    want.insert(want.end(), ref.begin(), ref.end());
  }
  return want;
}

// Rows of `stride` scores from gen(t, i), NaN past each row's length; the buffer starts `shift`
// scores past a 16-byte boundary (std::vector's allocation is 16-byte aligned).
struct Rows {
  std::vector<float> buf;
  int shift = 0;
  const float* data() const { return buf.data() + shift; }
};
template <class Gen>
Rows make_rows(int64_t stride, const std::vector<int32_t>& n, int shift, Gen gen) {
  Rows r;
  r.shift = shift;
  r.buf.assign(size_t(shift) + n.size() * size_t(stride), std::numeric_limits<float>::quiet_NaN());
  for (size_t t = 0; t < n.size(); ++t)
    for (int32_t i = 0; i < n[t]; ++i) r.buf[size_t(shift) + t * size_t(stride) + size_t(i)] = gen(int(t), i);
  return r;
}

template <int PER, int THREADS = kThreads>
void check_stride(int64_t stride, int shift, uint32_t seed) {
  const std::string at = "stride " + std::to_string(stride) + ", shift " + std::to_string(shift) + ", " +
                         std::to_string(PER) + " per thread of " + std::to_string(THREADS);
  const int k = 2048;
  const std::vector<int32_t> n = {int32_t(stride), k + 1, k, k - 1, 1, int32_t(stride / 2 + 3)};
  // (the kernel's bound, block_path_per_thread's: each row from its 16-byte boundary holds at most
  // PER * THREADS scores)
  for (size_t t = 0; t < n.size(); ++t) ASSERT_LE((shift + int64_t(t) * stride) % 4 + stride, PER * THREADS) << at;
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> noise(n.size() * size_t(stride));
  for (float& x : noise) x = normal(rng);
  const auto random = [&](int t, int i) { return noise[size_t(t) * size_t(stride) + size_t(i)]; };
  const auto levels = [&](int t, int i) { return std::round(random(t, i) * 4.0f); };
  const auto equal = [](int, int i) { return i % 3 == 0 ? -0.0f : 0.0f; };
  const auto rising = [](int, int i) { return float(i); };
  const std::vector<std::pair<std::string, Rows>> inputs = {
      {"random", make_rows(stride, n, shift, random)},
      {"few levels", make_rows(stride, n, shift, levels)},
      {"all equal", make_rows(stride, n, shift, equal)},
      {"rising", make_rows(stride, n, shift, rising)}};
  for (const auto& [name, rows] : inputs)
    for (int kk : {k, 12}) {
      if (name != "random" && kk != k) continue;
      const std::vector<int32_t> want = expected(rows.data(), stride, n, kk);
      for (emu::Order order : {emu::Order::kForward, emu::Order::kReversed}) {
        const std::vector<int32_t> got = run_block<PER, THREADS>(rows.data(), stride, n, kk, order);
        for (size_t t = 0; t < n.size(); ++t)
          ASSERT_TRUE(std::equal(got.begin() + int64_t(t) * kk, got.begin() + int64_t(t + 1) * kk,
                                 want.begin() + int64_t(t) * kk))
              << at << ", " << name << ", k " << kk << ": row " << t << " (n " << n[t] << ")"
              << (order == emu::Order::kReversed ? ", threads in reverse" : "");
      }
    }
}

TEST(TopKBlockOnTheHost, FourPerThreadMatchesTheCpuSelection) {
  check_stride<4>(4096, 0, 1);
  check_stride<4>(4093, 1, 2);  // rows shifted past their 16-byte boundary
  check_stride<4>(2053, 0, 3);
}

TEST(TopKBlockOnTheHost, FourKRowsOnFewerThreadsMatchTheCpuSelection) {
  check_stride<16, 256>(4096, 0, 4);
  check_stride<8, 512>(4093, 1, 5);
}

TEST(TopKBlockOnTheHost, EightAndSixteenPerThreadMatchTheCpuSelection) {
  check_stride<8>(8192, 0, 6);
  check_stride<8>(6001, 0, 7);
  check_stride<16>(16381, 0, 8);
  check_stride<16>(12001, 1, 9);
}

}  // namespace
}  // namespace sparsemla::cuda
