// The host emulation's runner (cuda/emu.h) against the CUDA semantics it stands in for, on small
// kernels whose results follow from the definitions: thread and block indices, __syncthreads over
// shared memory, the warp shuffles and reductions, cp.async copies landing at the wait, poison in
// fresh shared memory, and a stuck barrier reported rather than hanging.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "ops/cuda/cp_async.cuh"
#include "ops/cuda/dynamic_smem.cuh"
#include "ops/cuda/mma.cuh"

namespace sparsemla::emu_test {
namespace {


int linear_tid() { return int(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)); }
int linear_block() { return int(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z)); }

__global__ void indices_kernel(int* out) {
  const int n = int(blockDim.x * blockDim.y * blockDim.z);
  int* o = out + (int64_t(linear_block()) * n + linear_tid()) * 4;
  o[0] = int(threadIdx.x + 1000 * threadIdx.y + 1000000 * threadIdx.z);
  o[1] = int(blockIdx.x + 1000 * blockIdx.y + 1000000 * blockIdx.z);
  o[2] = int(blockDim.x + 1000 * blockDim.y + 1000000 * blockDim.z);
  o[3] = int(gridDim.x + 1000 * gridDim.y + 1000000 * gridDim.z);
}

TEST(HostEmulationRunner, ThreadAndBlockIndices) {
  const dim3 grid(3, 2, 2), block(32, 3, 2);
  const int nb = 12, nt = 192;
  std::vector<int> out(size_t(nb) * nt * 4, -1);
  emu::launch(indices_kernel, grid, block, 0, emu::Order::kForward, out.data());
  for (int bz = 0; bz < 2; ++bz)
    for (int by = 0; by < 2; ++by)
      for (int bx = 0; bx < 3; ++bx)
        for (int tz = 0; tz < 2; ++tz)
          for (int ty = 0; ty < 3; ++ty)
            for (int tx = 0; tx < 32; ++tx) {
              const int* o = out.data() + (size_t((bz * 2 + by) * 3 + bx) * nt + size_t((tz * 3 + ty) * 32 + tx)) * 4;
              ASSERT_EQ(o[0], tx + 1000 * ty + 1000000 * tz);
              ASSERT_EQ(o[1], bx + 1000 * by + 1000000 * bz);
              ASSERT_EQ(o[2], 32 + 3000 + 2000000);
              ASSERT_EQ(o[3], 3 + 2000 + 2000000);
            }
}

// Each thread writes its slot, waits, and reads its neighbour's; then the block reverses the array
// in place in two barriers.
__global__ void neighbours_kernel(int* out) {
  SPARSEMLA_DYNAMIC_SMEM(smem);
  int* s = reinterpret_cast<int*>(smem);
  const int t = linear_tid(), n = int(blockDim.x);
  s[t] = 10 * t + linear_block();
  __syncthreads();
  const int next = s[(t + 1) % n];
  __syncthreads();
  s[n - 1 - t] = next;
  __syncthreads();
  out[linear_block() * n + t] = s[t];
}

TEST(HostEmulationRunner, SyncthreadsOrdersSharedMemory) {
  for (emu::Order order : {emu::Order::kForward, emu::Order::kReversed}) {
    std::vector<int> out(2 * 96);
    emu::launch(neighbours_kernel, dim3(2), dim3(96), 96 * sizeof(int), order, out.data());
    for (int b = 0; b < 2; ++b)
      for (int t = 0; t < 96; ++t) {
        const int writer = 95 - t;  // slot t was written by thread 95 - t with its neighbour's value
        ASSERT_EQ(out[size_t(b * 96 + t)], 10 * ((writer + 1) % 96) + b);
      }
  }
}

__global__ void warp_kernel(int* out) {
  const int t = linear_tid(), lane = t % 32;
  const int v = 7 * t + 3;
  int* o = out + t * 6;
  o[0] = __shfl_xor_sync(0xFFFFFFFFu, v, 5);
  o[1] = __shfl_sync(0xFFFFFFFFu, v, 31 - lane);
  o[2] = __shfl_down_sync(0xFFFFFFFFu, v, 3, 16);
  o[3] = __shfl_xor_sync(0xFFFFFFFFu, v, 9, 8);  // (width 8: lane ^ 1, within its eight)
  o[4] = __reduce_add_sync(0xFFFFFFFFu, v);
  o[5] = int(__reduce_max_sync(0xFFFFFFFFu, unsigned((v * 37) % 101)));
}

TEST(HostEmulationRunner, WarpShufflesAndReductions) {
  std::vector<int> out(64 * 6);
  emu::launch(warp_kernel, dim3(1), dim3(64), 0, emu::Order::kReversed, out.data());
  for (int t = 0; t < 64; ++t) {
    const int lane = t % 32, base = t - lane;
    const auto v = [&](int l) { return 7 * (base + l) + 3; };
    const int* o = out.data() + t * 6;
    EXPECT_EQ(o[0], v(lane ^ 5));
    EXPECT_EQ(o[1], v(31 - lane));
    EXPECT_EQ(o[2], lane % 16 + 3 < 16 ? v(lane + 3) : v(lane));
    EXPECT_EQ(o[3], v((lane & ~7) | ((lane ^ 9) & 7)));
    int sum = 0, mx = 0;
    for (int l = 0; l < 32; ++l) {
      sum += v(l);
      mx = std::max(mx, (v(l) * 37) % 101);
    }
    EXPECT_EQ(o[4], sum);
    EXPECT_EQ(o[5], mx);
  }
}

// Reads a copied word before and after the wait: the copy lands only at the wait (or at once, in
// the reversed order), and fresh shared memory holds poison.
__global__ void cp_async_kernel(const uint32_t* src, uint32_t* out) {
  SPARSEMLA_DYNAMIC_SMEM(smem);
  uint32_t* s = reinterpret_cast<uint32_t*>(smem);
  const int t = linear_tid();
  sparsemla::cuda::cp_async16(s + 4 * t, src + 4 * t);
  sparsemla::cuda::cp_async_commit();
  out[2 * t] = s[4 * t];
  sparsemla::cuda::cp_async_wait_all();
  out[2 * t + 1] = s[4 * t];
}

TEST(HostEmulationRunner, CpAsyncLandsAtTheWaitOverPoisonOrAtOnce) {
  std::vector<uint32_t> src(32 * 4), out(2 * 32);
  for (size_t i = 0; i < src.size(); ++i) src[i] = uint32_t(i * 2654435761u);
  emu::launch(cp_async_kernel, dim3(1), dim3(32), 32 * 16, emu::Order::kForward, src.data(), out.data());
  for (int t = 0; t < 32; ++t) {
    EXPECT_EQ(out[size_t(2 * t)], 0xCDCDCDCDu);
    EXPECT_EQ(out[size_t(2 * t + 1)], src[size_t(4 * t)]);
  }
  // The reversed order lands each copy when it is issued.
  emu::launch(cp_async_kernel, dim3(1), dim3(32), 32 * 16, emu::Order::kReversed, src.data(), out.data());
  for (int t = 0; t < 32; ++t) {
    EXPECT_EQ(out[size_t(2 * t)], src[size_t(4 * t)]);
    EXPECT_EQ(out[size_t(2 * t + 1)], src[size_t(4 * t)]);
  }
}

// A race: every thread writes one shared word and reads it back without a barrier between
// threads; which write a thread sees depends on the order the threads run in.
__global__ void racy_kernel(int* out) {
  SPARSEMLA_DYNAMIC_SMEM(smem);
  int* s = reinterpret_cast<int*>(smem);
  if (linear_tid() == 0) s[0] = -1;
  __syncthreads();
  out[linear_tid()] = s[0];
  s[0] = linear_tid();
}

TEST(HostEmulationRunner, TheTwoOrdersExposeARace) {
  std::vector<int> forward(64), reversed(64);
  emu::launch(racy_kernel, dim3(1), dim3(64), 4, emu::Order::kForward, forward.data());
  emu::launch(racy_kernel, dim3(1), dim3(64), 4, emu::Order::kReversed, reversed.data());
  EXPECT_NE(forward, reversed);
}

// Warp 0 waits at __syncthreads; in warp 1 half the lanes leave and the others wait in a shuffle
// that needs all 32: on a GPU a hang (or undefined), here an error naming both waits.
__global__ void stuck_kernel(int* out) {
  const int t = linear_tid();
  if (t < 32) {
    __syncthreads();
  } else if (t % 32 < 16) {
    out[t] = __shfl_xor_sync(0xFFFFFFFFu, t, 1);
  }
}

TEST(HostEmulationRunner, AStuckBarrierIsReportedNotHung) {
  std::vector<int> out(64);
  try {
    emu::launch(stuck_kernel, dim3(1), dim3(64), 0, emu::Order::kForward, out.data());
    FAIL() << "a stuck block was not reported";
  } catch (const std::runtime_error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("is stuck"), std::string::npos) << m;
    EXPECT_NE(m.find("thread 0 (and those after it) waits at __syncthreads"), std::string::npos) << m;
    EXPECT_NE(m.find("thread 32 (and those after it) waits at a warp collective"), std::string::npos) << m;
    EXPECT_NE(m.find("thread 48 (and those after it) has left"), std::string::npos) << m;
  }
  EXPECT_THROW(emu::launch(indices_kernel, dim3(1), dim3(32), emu::kEmuSharedBytes + 1, emu::Order::kForward,
                           out.data()),
               std::runtime_error);
}

// Named barriers: warps 0-1 produce into shared memory and arrive at barrier 1 (64 + 64 threads);
// warps 2-3 sync there and then read; atomics count the readers.
__global__ void named_kernel(int* out, int* count) {
  SPARSEMLA_DYNAMIC_SMEM(smem);
  int* s = reinterpret_cast<int*>(smem);
  const int t = linear_tid();
  if (t < 64) {
    s[t] = 3 * t + 1;
    sparsemla::cuda::named_arrive(1, 128);
  } else {
    sparsemla::cuda::named_sync(1, 128);
    out[t - 64] = s[127 - t];
    atomicAdd(count, 1);
  }
}

TEST(HostEmulationRunner, NamedBarriersAndAtomics) {
  for (emu::Order order : {emu::Order::kForward, emu::Order::kReversed}) {
    std::vector<int> out(64, -1);
    int count = 0;
    emu::launch(named_kernel, dim3(2), dim3(128), 64 * sizeof(int), order, out.data(), &count);
    for (int i = 0; i < 64; ++i) EXPECT_EQ(out[size_t(i)], 3 * (63 - i) + 1);
    EXPECT_EQ(count, 128);
  }
}

#if EMU_ASAN
// Built with AddressSanitizer: a write one byte past the launch's dynamic shared memory, or past a
// global buffer, stops the test with an ASan report (as compute-sanitizer's memcheck would on a GPU).
__global__ void past_the_end_kernel(uint8_t* global, int smem_bytes, bool in_global) {
  SPARSEMLA_DYNAMIC_SMEM(smem);
  if (linear_tid() == 5) {
    if (in_global) global[64] = 1;
    else smem[smem_bytes] = 1;
  }
}

TEST(HostEmulationRunnerDeathTest, OutOfBoundsSharedAndGlobalMemoryIsReported) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  std::vector<uint8_t> global(64);
  emu::launch(past_the_end_kernel, dim3(1), dim3(32), 100, emu::Order::kForward, global.data(), 99, false);
  EXPECT_DEATH(emu::launch(past_the_end_kernel, dim3(1), dim3(32), 100, emu::Order::kForward, global.data(), 100,
                           false),
               "AddressSanitizer");
  EXPECT_DEATH(emu::launch(past_the_end_kernel, dim3(1), dim3(32), 100, emu::Order::kForward, global.data(), 0, true),
               "AddressSanitizer");
}
#endif

}  // namespace
}  // namespace sparsemla::emu_test
