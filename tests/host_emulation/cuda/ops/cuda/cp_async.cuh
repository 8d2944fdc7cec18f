// Host stand-in for src/ops/cuda/cp_async.cuh (the same functions): the copies are recorded and
// made when waited for (emu.h; at once in its reversed order), so a kernel that reads its shared
// memory before the wait reads the block's poison bytes, as it could read stale bytes on a GPU.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace sparsemla::cuda {

inline void cp_async16(void* smem, const void* gmem) { emu::cp_async(smem, gmem, 16); }
inline void cp_async16_l1(void* smem, const void* gmem) { emu::cp_async(smem, gmem, 16); }
inline void cp_async4(void* smem, const void* gmem) { emu::cp_async(smem, gmem, 4); }
inline void cp_async_commit() { emu::cp_async_commit(); }
// (cp.async.wait_all also waits for the copies not yet committed)
inline void cp_async_wait_all() {
  emu::cp_async_commit();
  emu::cp_async_wait(0);
}
template <int N>
inline void cp_async_wait_group() {
  emu::cp_async_wait(N);
}

}  // namespace sparsemla::cuda
