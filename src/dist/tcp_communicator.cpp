#include "dist/tcp_communicator.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "util/error.h"

namespace sparsemla::dist {
namespace {

constexpr size_t kHeaderBytes = 20;  // op u32, total values u64, root u32, values in this chunk u32

const char* op_name(uint32_t op) {
  switch (op) {
    case 1: return "all_reduce_sum";
    case 2: return "all_gather";
    case 3: return "broadcast";
    case 4: return "barrier";
  }
  return "?";
}

struct Header {
  uint32_t op = 0;
  uint64_t total = 0;
  uint32_t root = 0;
  uint32_t n = 0;
  bool operator==(const Header&) const = default;
};

Header read_header(const std::vector<uint8_t>& b) {
  Header h;
  if (b.size() < kHeaderBytes) return h;
  std::memcpy(&h.op, b.data(), 4);
  std::memcpy(&h.total, b.data() + 4, 8);
  std::memcpy(&h.root, b.data() + 12, 4);
  std::memcpy(&h.n, b.data() + 16, 4);
  return h;
}

}  // namespace

int64_t TcpCommunicator::chunk_values() const { return std::max<int64_t>(1, (int64_t(32) << 20) / 4 / size()); }

std::vector<std::vector<uint8_t>> TcpCommunicator::exchange(Op op, int64_t n_total, int root, const float* in,
                                                             int64_t n) {
  if (!failed_.empty()) fail("rank {}: {} abandoned: {}", rank(), op_name(uint32_t(op)), failed_);
  // Host byte order: every rank of a run is this same build, and the wire carries floats as they are.
  std::vector<uint8_t> mine(kHeaderBytes + size_t(in ? n : 0) * sizeof(float));
  const Header h{uint32_t(op), uint64_t(n_total), uint32_t(root), uint32_t(n)};
  std::memcpy(mine.data(), &h.op, 4);
  std::memcpy(mine.data() + 4, &h.total, 8);
  std::memcpy(mine.data() + 12, &h.root, 4);
  std::memcpy(mine.data() + 16, &h.n, 4);
  if (in && n > 0) std::memcpy(mine.data() + kHeaderBytes, in, size_t(n) * sizeof(float));
  std::vector<std::vector<uint8_t>> all;
  try {
    all = boot_.all_gather(mine);
  } catch (const Error& e) {
    failed_ = e.what();
    throw;
  }
  for (int r = 0; r < size(); ++r) {
    const Header theirs = read_header(all[size_t(r)]);
    if (theirs == h) continue;
    failed_ = theirs.op != h.op
                  ? fmt::format("collective mismatch: rank {} called {}, rank {} called {}", rank(),
                                op_name(h.op), r, op_name(theirs.op))
                  : fmt::format("{}: rank {} has {} values (root {}), rank {} has {} (root {})", op_name(h.op), rank(),
                                h.total, h.root, r, theirs.total, theirs.root);
    fail("tensor parallel over TCP: {}", failed_);
  }
  return all;
}

void TcpCommunicator::all_reduce_sum(float* data, int64_t n) {
  if (n < 0) fail("all_reduce_sum: negative size {}", n);
  const int64_t chunk = chunk_values();
  std::vector<float> sum;
  for (int64_t c0 = 0; c0 < n || (n == 0 && c0 == 0); c0 += chunk) {
    const int64_t m = std::min(chunk, n - c0);
    const auto all = exchange(Op::AllReduceSum, n, 0, data + c0, m);
    if (m == 0) break;
    sum.resize(size_t(m));
    std::memcpy(sum.data(), all[0].data() + kHeaderBytes, size_t(m) * sizeof(float));
    for (int r = 1; r < size(); ++r) {
      const float* v = reinterpret_cast<const float*>(all[size_t(r)].data() + kHeaderBytes);
      for (int64_t i = 0; i < m; ++i) {
        float x;
        std::memcpy(&x, v + i, sizeof(float));
        sum[size_t(i)] += x;
      }
    }
    std::memcpy(data + c0, sum.data(), size_t(m) * sizeof(float));
  }
}

void TcpCommunicator::all_gather(const float* in, int64_t n_per_rank, float* out) {
  if (n_per_rank < 0) fail("all_gather: negative size {}", n_per_rank);
  const int64_t chunk = chunk_values();
  std::vector<float> mine(in, in + n_per_rank);  // `in` may sit inside `out`
  for (int64_t c0 = 0; c0 < n_per_rank || (n_per_rank == 0 && c0 == 0); c0 += chunk) {
    const int64_t m = std::min(chunk, n_per_rank - c0);
    const auto all = exchange(Op::AllGather, n_per_rank, 0, mine.data() + c0, m);
    if (m == 0) break;
    for (int r = 0; r < size(); ++r)
      std::memcpy(out + r * n_per_rank + c0, all[size_t(r)].data() + kHeaderBytes, size_t(m) * sizeof(float));
  }
}

void TcpCommunicator::broadcast(float* data, int64_t n, int root) {
  if (n < 0) fail("broadcast: negative size {}", n);
  if (root < 0 || root >= size()) fail("broadcast: root {} is not a rank of a group of {}", root, size());
  const int64_t chunk = chunk_values();
  for (int64_t c0 = 0; c0 < n || (n == 0 && c0 == 0); c0 += chunk) {
    const int64_t m = std::min(chunk, n - c0);
    const auto all = exchange(Op::Broadcast, n, root, rank() == root ? data + c0 : nullptr, m);
    if (m == 0) break;
    if (rank() != root)
      std::memcpy(data + c0, all[size_t(root)].data() + kHeaderBytes, size_t(m) * sizeof(float));
  }
}

void TcpCommunicator::barrier() { exchange(Op::Barrier, 0, 0, nullptr, 0); }

}  // namespace sparsemla::dist
