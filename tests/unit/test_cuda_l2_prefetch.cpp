// The weights' L2 prefetch (ops/cuda/l2_prefetch.h): which bytes a budget takes, and that the
// prefetch kernel changes nothing, inside its spans or around them, at any alignment and length
// (compute-sanitizer's memcheck runs it for reads outside the allocation).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ops/cuda/l2_prefetch.h"
#include "util/error.h"

#if SPARSEMLA_HAVE_CUDA
#include "gpu_test_util.h"
#endif

namespace sparsemla::cuda {
namespace {

const char* at(uint64_t a) { return reinterpret_cast<const char*>(uintptr_t(a)); }

TEST(L2Spans, TheBudgetTakesSpansInOrderAndCutsTheOneThatCrossesIt) {
  const L2Span in[] = {{at(0x1000), 100}, {nullptr, 0}, {at(0x2000), 0}, {at(0x3000), 300}, {at(0x4000), 50}};
  L2Span out[kMaxL2Spans];
  // Everything fits: the empty spans dropped, the rest whole and in order.
  ASSERT_EQ(l2_spans_within(in, 5, 1000, out), 3);
  EXPECT_EQ(out[0].p, at(0x1000));
  EXPECT_EQ(out[0].bytes, 100u);
  EXPECT_EQ(out[1].p, at(0x3000));
  EXPECT_EQ(out[1].bytes, 300u);
  EXPECT_EQ(out[2].p, at(0x4000));
  EXPECT_EQ(out[2].bytes, 50u);
  // 250 bytes: the first whole, the second cut at 150, nothing of the third.
  ASSERT_EQ(l2_spans_within(in, 5, 250, out), 2);
  EXPECT_EQ(out[1].p, at(0x3000));
  EXPECT_EQ(out[1].bytes, 150u);
  // A budget that ends with the first span exactly.
  ASSERT_EQ(l2_spans_within(in, 5, 100, out), 1);
  EXPECT_EQ(out[0].bytes, 100u);
  EXPECT_EQ(l2_spans_within(in, 5, 0, out), 0);
  // More spans than a launch takes: the first kMaxL2Spans.
  std::vector<L2Span> many;
  for (int i = 0; i < kMaxL2Spans + 3; ++i) many.push_back({at(0x10000 + 0x100 * uint64_t(i)), 16});
  ASSERT_EQ(l2_spans_within(many.data(), int(many.size()), 1 << 20, out), kMaxL2Spans);
  EXPECT_EQ(out[kMaxL2Spans - 1].p, many[size_t(kMaxL2Spans - 1)].p);
}

#if SPARSEMLA_HAVE_CUDA

TEST(CudaL2Prefetch, ChangesNoByteInsideOrAroundItsSpans) {
  SPARSEMLA_REQUIRE_GPU();
  // Lengths around the 16-byte rounding and the kernel's 32 KB pieces, at every offset mod 16, and
  // one span longer than the launch's threads take in one round (8 blocks of 128 x 32 KB).
  const uint64_t n = (uint64_t(40) << 20) + 4096;
  std::vector<uint8_t> host(n);
  for (uint64_t i = 0; i < n; ++i) host[i] = uint8_t((i * 2654435761u) >> 13);
  DeviceBuffer buf(n);
  buf.upload(host.data(), n);
  const char* base = buf.as<const char>();
  std::vector<L2Span> spans;
  for (uint64_t len : {uint64_t(1), uint64_t(15), uint64_t(16), uint64_t(17), uint64_t(31), uint64_t(32 * 1024 - 5),
                       uint64_t(32 * 1024 + 17), uint64_t(1 << 20) + 3})
    for (uint64_t off = 0; off < 16; off += 5) spans.push_back({base + (n - len - off), len});  // ending at the buffer's end
  spans.push_back({base, n});
  spans.push_back({base + 7, n - 7});
  spans.push_back({base + 3, 0});
  for (size_t i = 0; i < spans.size(); i += kMaxL2Spans) {
    const int m = int(std::min<size_t>(kMaxL2Spans, spans.size() - i));
    l2_prefetch(spans.data() + i, m, nullptr);
  }
  const int64_t before = l2_prefetch_launches();
  l2_prefetch(spans.data(), 0, nullptr);  // nothing to ask: no launch
  EXPECT_EQ(l2_prefetch_launches(), before);
  std::vector<uint8_t> back(n);
  buf.download(back.data(), n);  // (waits for the launches)
  EXPECT_EQ(std::memcmp(back.data(), host.data(), n), 0);
}

TEST(CudaL2Prefetch, RefusesSpansItCannotTake) {
  SPARSEMLA_REQUIRE_GPU();
  std::vector<L2Span> spans(size_t(kMaxL2Spans + 1));
  EXPECT_THROW(l2_prefetch(spans.data(), kMaxL2Spans + 1, nullptr), Error);
  const L2Span no_address{nullptr, 64};
  EXPECT_THROW(l2_prefetch(&no_address, 1, nullptr), Error);
}

#endif

}  // namespace
}  // namespace sparsemla::cuda
