// Weights brought into L2 ahead of the kernels that read them, while the kernels before those are
// bound by latency and leave HBM idle (a decode step's attention core, its router): a hint, like
// the decode products' own prologue prefetch (pdl.cuh), but over whole weights, from a kernel on a
// stream of its own. Plain C++ (no CUDA headers).
#pragma once
#include <cstdint>

#include "ops/cuda/buffer.h"

namespace sparsemla::cuda {

// Device bytes [p, p + bytes).
struct L2Span {
  const void* p = nullptr;
  uint64_t bytes = 0;
};

constexpr int kMaxL2Spans = 8;

// The first `budget` bytes of the spans taken in order: whole spans while they fit, the one that
// crosses the budget cut there, empty ones dropped; at most kMaxL2Spans. Returns the count written
// to out.
inline int l2_spans_within(const L2Span* in, int n, uint64_t budget, L2Span* out) {
  int m = 0;
  for (int i = 0; i < n && budget > 0 && m < kMaxL2Spans; ++i) {
    if (!in[i].p || in[i].bytes == 0) continue;
    const uint64_t b = in[i].bytes < budget ? in[i].bytes : budget;
    out[m++] = {in[i].p, b};
    budget -= b;
  }
  return m;
}

// Asks for the spans (at most kMaxL2Spans) to be brought into L2, from one small launch on s (a few
// blocks: the copies are the memory system's, the kernel only issues them). Nothing is read into
// registers, nothing is written and nothing waits for the data: each span is rounded inwards to 16
// bytes and no byte outside it is touched. SM90 and later use the bulk prefetch (TMA), earlier
// devices one prefetch instruction per 128-byte line. Throws Error naming a bad span.
void l2_prefetch(const L2Span* spans, int n, Stream s);
// Launches l2_prefetch has enqueued in this process (tests: that a model asked for any).
int64_t l2_prefetch_launches();

}  // namespace sparsemla::cuda
