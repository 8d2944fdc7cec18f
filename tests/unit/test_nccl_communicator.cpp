// The NCCL communicator (dist/cuda/nccl_communicator.h) against the CPU: one thread per GPU, every
// GPU of the machine, with the unique id carried over the TCP bootstrap on 127.0.0.1 as it would be
// between nodes. NCCL cannot put two ranks on one GPU, so a one-GPU machine runs one rank, and the
// test that needs several ranks says it was skipped.
#include <gtest/gtest.h>

#include "gpu_test_util.h"

#if SPARSEMLA_HAVE_NCCL

#include <cuda_runtime.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <future>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "dist/cuda/nccl_communicator.h"
#include "dist/tcp_bootstrap.h"
#include "ops/cuda/buffer.h"
#include "test_util.h"
#include "util/error.h"

namespace sparsemla::dist {
namespace {

using namespace std::chrono_literals;

int gpu_count() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

// Runs fn on `n` ranks, rank r on GPU r in a thread of its own, each with a stream of its own and a
// communicator made from the unique id that rank 0 sent over TCP. Returns each rank's error ("" when
// none). A rank that throws aborts its communicator; the others may then wait forever in NCCL, so a
// hang ends the process after two minutes with a message.
std::vector<std::string> run_ranks(int n, const std::function<void(NcclCommunicator&)>& fn) {
  std::printf("[   INFO   ] %d rank(s), one per GPU: NCCL cannot put two ranks on one GPU\n", n);
  TcpListener listener("127.0.0.1:0");
  const std::string root = "127.0.0.1:" + std::to_string(listener.port());
  std::vector<std::string> errors(static_cast<size_t>(n), "");
  auto all = std::async(std::launch::async, [&] {
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r)
      threads.emplace_back([&, r] {
        cudaStream_t stream = nullptr;
        try {
          if (cudaSetDevice(r) != cudaSuccess || cudaStreamCreate(&stream) != cudaSuccess)
            fail("rank {}: cannot set up GPU {}", r, r);
          const TcpBootstrap boot =
              r == 0 ? nccl_bootstrap_root(std::move(listener), n, 60s) : TcpBootstrap::join(root, r, n, 60s);
          NcclCommunicator comm(boot, /*device=*/r, stream);
          try {
            fn(comm);
          } catch (const std::exception& e) {
            comm.abort(e.what());
            throw;
          }
        } catch (const std::exception& e) {
          errors[size_t(r)] = e.what();
        }
        if (stream) cudaStreamDestroy(stream);
      });
    for (auto& t : threads) t.join();
  });
  if (all.wait_for(120s) != std::future_status::ready) {
    std::fprintf(stderr, "the NCCL ranks hung (a rank failed while the others waited in a collective?)\n");
    std::_Exit(1);
  }
  return errors;
}

std::vector<float> random_values(int rank, size_t n) {
  std::mt19937 rng(uint32_t(1000 + rank));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = u(rng);
  return v;
}

// The array rank `rank` holds after the collective, brought back to the host (waits for the stream).
std::vector<float> result_of(const NcclCommunicator& comm, const cuda::DeviceBuffer& buf, size_t n) {
  if (cudaStreamSynchronize(static_cast<cudaStream_t>(comm.stream())) != cudaSuccess)
    fail("rank {}: the stream failed", comm.rank());
  return cuda::to_host<float>(buf, n);
}

// NaN and inf positions first, then the largest difference.
void expect_close(const std::vector<float>& got, const std::vector<float>& want, float tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(std::isfinite(got[i]), std::isfinite(want[i])) << what << " at " << i;
    if (std::fabs(got[i] - want[i]) > std::fabs(got[worst] - want[worst])) worst = i;
  }
  EXPECT_LE(std::fabs(got[worst] - want[worst]), tol)
      << what << ": worst at " << worst << ", " << got[worst] << " vs " << want[worst];
}

void expect_no_errors(const std::vector<std::string>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

TEST(NcclCommunicator, AllReduceEqualsTheSerialSumOnEveryRank) {
  SPARSEMLA_REQUIRE_GPU();
  const int N = gpu_count();
  const size_t n = (size_t(1) << 20) + 3;  // not a multiple of any vector width
  std::vector<float> want(n, 0.0f);
  for (int r = 0; r < N; ++r) {
    const std::vector<float> v = random_values(r, n);
    for (size_t i = 0; i < n; ++i) want[i] += v[i];
  }
  std::vector<std::vector<float>> got(static_cast<size_t>(N));
  expect_no_errors(run_ranks(N, [&](NcclCommunicator& comm) {
    cuda::DeviceBuffer buf = cuda::to_device(random_values(comm.rank(), n));
    comm.all_reduce_sum(buf.as<float>(), int64_t(n));
    got[size_t(comm.rank())] = result_of(comm, buf, n);
  }));
  // NCCL sums in an order of its own; values in [-1, 1] over N ranks round differently by a few ulps.
  for (int r = 0; r < N; ++r) expect_close(got[size_t(r)], want, 1e-5f * float(N), "rank " + std::to_string(r));
  // One result, the same bits on every rank.
  for (int r = 1; r < N; ++r) EXPECT_TRUE(got[size_t(r)] == got[0]) << "rank " << r << " differs from rank 0";
}

TEST(NcclCommunicator, AllGatherAndBroadcastMoveTheValuesExactly) {
  SPARSEMLA_REQUIRE_GPU();
  const int N = gpu_count();
  const size_t n = 4099;
  std::vector<float> want_gathered;
  for (int r = 0; r < N; ++r) {
    const std::vector<float> v = random_values(r, n);
    want_gathered.insert(want_gathered.end(), v.begin(), v.end());
  }
  const int root = N - 1;
  const size_t n_ranks = static_cast<size_t>(N);
  std::vector<std::vector<float>> gathered(n_ranks), in_place(n_ranks), broadcast(n_ranks);
  expect_no_errors(run_ranks(N, [&](NcclCommunicator& comm) {
    const int r = comm.rank();
    const cuda::DeviceBuffer in = cuda::to_device(random_values(r, n));
    cuda::DeviceBuffer out(size_t(N) * n * sizeof(float));
    comm.all_gather(in.as<float>(), int64_t(n), out.as<float>());
    gathered[size_t(r)] = result_of(comm, out, size_t(N) * n);

    // In place: this rank's values already in its own slot.
    cuda::DeviceBuffer slots(size_t(N) * n * sizeof(float));
    slots.zero();
    slots.upload(random_values(r, n).data(), n * sizeof(float), size_t(r) * n * sizeof(float));
    comm.all_gather(slots.as<float>() + size_t(r) * n, int64_t(n), slots.as<float>());
    in_place[size_t(r)] = result_of(comm, slots, size_t(N) * n);

    cuda::DeviceBuffer data = cuda::to_device(random_values(r, n));
    comm.broadcast(data.as<float>(), int64_t(n), root);
    broadcast[size_t(r)] = result_of(comm, data, n);
  }));
  for (int r = 0; r < N; ++r) {
    EXPECT_TRUE(gathered[size_t(r)] == want_gathered) << "all_gather, rank " << r;
    EXPECT_TRUE(in_place[size_t(r)] == want_gathered) << "in-place all_gather, rank " << r;
    EXPECT_TRUE(broadcast[size_t(r)] == random_values(root, n)) << "broadcast from rank " << root << ", rank " << r;
  }
}

TEST(NcclCommunicator, AbortedCommunicatorRefusesCollectives) {
  SPARSEMLA_REQUIRE_GPU();
  const int N = gpu_count();
  std::vector<std::string> after_abort(static_cast<size_t>(N));
  expect_no_errors(run_ranks(N, [&](NcclCommunicator& comm) {
    comm.barrier();  // every rank is here: no collective is in flight when each aborts its own
    cuda::DeviceBuffer buf(sizeof(float));
    after_abort[size_t(comm.rank())] = test::error_of([&] {
      comm.abort("the test gives up");
      comm.all_reduce_sum(buf.as<float>(), 1);
    });
  }));
  for (int r = 0; r < N; ++r)
    EXPECT_NE(after_abort[size_t(r)].find("all_reduce_sum after the communicator was aborted: the test gives up"),
              std::string::npos)
        << after_abort[size_t(r)];
}

TEST(NcclCommunicator, SeveralRanksAgreeOnEveryCollective) {
  SPARSEMLA_REQUIRE_GPU();
  const int N = gpu_count();
  if (N < 2) GTEST_SKIP() << "needs 2 or more GPUs, found " << N << " (NCCL cannot put two ranks on one GPU)";
  // Every rank broadcasts in turn, then all ranks sum rank+1 everywhere: small integers, exact in fp32.
  const size_t n = 1000;
  std::vector<std::vector<float>> sums(static_cast<size_t>(N));
  std::vector<std::vector<std::vector<float>>> casts(static_cast<size_t>(N));
  expect_no_errors(run_ranks(N, [&](NcclCommunicator& comm) {
    const int r = comm.rank();
    for (int root = 0; root < N; ++root) {
      cuda::DeviceBuffer data = cuda::to_device(std::vector<float>(n, float(r * 10 + root)));
      comm.broadcast(data.as<float>(), int64_t(n), root);
      casts[size_t(r)].push_back(result_of(comm, data, n));
    }
    cuda::DeviceBuffer ones = cuda::to_device(std::vector<float>(n, float(r + 1)));
    comm.all_reduce_sum(ones.as<float>(), int64_t(n));
    sums[size_t(r)] = result_of(comm, ones, n);
  }));
  for (int r = 0; r < N; ++r) {
    EXPECT_TRUE(sums[size_t(r)] == std::vector<float>(n, float(N * (N + 1) / 2))) << "rank " << r;
    for (int root = 0; root < N; ++root)
      EXPECT_TRUE(casts[size_t(r)][size_t(root)] == std::vector<float>(n, float(root * 10 + root)))
          << "rank " << r << ", root " << root;
  }
}

TEST(NcclCommunicator, RefusesABadDeviceAndABadRoot) {
  SPARSEMLA_REQUIRE_GPU();
  const int N = gpu_count();
  NcclUniqueId id{};
  std::string err = test::error_of([&] { NcclCommunicator c(id, 0, 1, /*device=*/N, nullptr); });
  EXPECT_NE(err.find("there is no CUDA device " + std::to_string(N)), std::string::npos) << err;
  err = test::error_of([&] { NcclCommunicator c(id, 2, 2, 0, nullptr); });
  EXPECT_NE(err.find("rank 2 is not in a group of 2"), std::string::npos) << err;
  expect_no_errors(run_ranks(N, [&](NcclCommunicator& comm) {
    cuda::DeviceBuffer buf(sizeof(float));
    const std::string e = test::error_of([&] { comm.broadcast(buf.as<float>(), 1, N); });
    EXPECT_NE(e.find("root " + std::to_string(N) + " is not a rank"), std::string::npos) << e;
  }));
}

}  // namespace
}  // namespace sparsemla::dist

#else

TEST(NcclCommunicator, Skipped) { GTEST_SKIP() << "built without NCCL (or without CUDA)"; }

#endif
