// Host stand-ins for the CUDA names that the kernels the host emulation builds use, with the
// device's arithmetic: dp4a, byte permutes, fp32 operations rounded once to nearest (no
// contraction), fp16 conversion; and, through emu.h, the thread indices, __syncthreads, the warp
// collectives and dynamic shared memory. Only for the tests in tests/host_emulation, which compile
// device headers with the host compiler; never on the include path of the engine. (Names with
// double underscores are the CUDA ones being stood in for.) Beside this file, ops/cuda/ stands in
// for the device headers that are all inline assembly (cp_async.cuh, pdl.cuh).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "emu.h"

#define __device__
#define __host__
#define __global__
#define __shared__ static  // (one block at a time: a function static is the block's)
#define __forceinline__ inline
#define __align__(x) __attribute__((aligned(x)))
#define __launch_bounds__(...)

#define threadIdx (::emu::thread_idx())
#define blockIdx (::emu::Runner::current().block_idx())
#define blockDim (::emu::Runner::current().block_dim())
#define gridDim (::emu::Runner::current().grid_dim())
inline void __syncthreads() { ::emu::Runner::current().sync_block(); }

struct alignas(8) uint2 {
  uint32_t x, y;
};
struct alignas(16) uint4 {
  uint32_t x, y, z, w;
};
struct alignas(8) int2 {
  int x, y;
};
struct alignas(16) int4 {
  int x, y, z, w;
};
struct alignas(8) float2 {
  float x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
inline uint2 make_uint2(uint32_t a, uint32_t b) { return {a, b}; }
inline uint4 make_uint4(uint32_t a, uint32_t b, uint32_t c, uint32_t d) { return {a, b, c, d}; }
inline int2 make_int2(int a, int b) { return {a, b}; }
inline int4 make_int4(int a, int b, int c, int d) { return {a, b, c, d}; }
inline float2 make_float2(float a, float b) { return {a, b}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }

// Byte i of the result is byte (s >> 4i) & 7 of the eight bytes y:x (the default mode).
inline uint32_t __byte_perm(uint32_t x, uint32_t y, uint32_t s) {
  uint8_t b[8];
  std::memcpy(b, &x, 4);
  std::memcpy(b + 4, &y, 4);
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= uint32_t(b[(s >> (4 * i)) & 7]) << (8 * i);
  return r;
}
// Four signed byte products added to c.
inline int __dp4a(int a, int b, int c) {
  for (int i = 0; i < 4; ++i) c += int(int8_t(a >> (8 * i))) * int(int8_t(b >> (8 * i)));
  return c;
}
template <class T>
inline T __ldg(const T* p) {
  return *p;
}
inline int __popc(uint32_t v) { return __builtin_popcount(v); }
// (volatile: one rounding per operation, never contracted into an FMA by the host compiler)
inline float __fmul_rn(float a, float b) {
  volatile float r = a * b;
  return r;
}
inline float __fadd_rn(float a, float b) {
  volatile float r = a + b;
  return r;
}
inline float __fsub_rn(float a, float b) {
  volatile float r = a - b;
  return r;
}
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __int2float_rn(int i) { return float(i); }
template <class To, class From>
inline To bits_as(From v) {
  static_assert(sizeof(To) == sizeof(From));
  To t;
  std::memcpy(&t, &v, sizeof t);
  return t;
}
inline float __int_as_float(int i) { return bits_as<float>(i); }
inline float __uint_as_float(uint32_t i) { return bits_as<float>(i); }
inline uint32_t __float_as_uint(float f) { return bits_as<uint32_t>(f); }
inline int __float_as_int(float f) { return bits_as<int>(f); }

inline float __fdiv_rn(float a, float b) {
  volatile float r = a / b;
  return r;
}
// Round to nearest even (the host's default rounding mode).
inline int __float2int_rn(float f) { return int(std::nearbyint(f)); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline int64_t min(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t max(int64_t a, int64_t b) { return a > b ? a : b; }

// Warp collectives, over all 32 lanes only (what the kernels use).
namespace emu {
inline void full_mask(unsigned mask, const char* what) {
  if (mask != 0xFFFFFFFFu) {
    std::fprintf(stderr, "emu: %s with mask %08x: only full warps are emulated\n", what, mask);
    std::abort();
  }
}
template <class T, class Op>
T warp_reduce(unsigned mask, T v, const char* what, Op op) {
  full_mask(mask, what);
  T all[32];
  Runner::current().warp_exchange(v, all);
  T r = all[0];
  for (int l = 1; l < 32; ++l) r = op(r, all[l]);
  return r;
}
template <class T>
T warp_lane(unsigned mask, T v, int src, const char* what) {
  full_mask(mask, what);
  T all[32];
  Runner::current().warp_exchange(v, all);
  return all[src & 31];
}
inline int lane_id() { return Runner::current().self().linear % 32; }
}  // namespace emu

inline unsigned __reduce_max_sync(unsigned mask, unsigned v) {
  return emu::warp_reduce(mask, v, "__reduce_max_sync", [](unsigned a, unsigned b) { return a > b ? a : b; });
}
inline int __reduce_max_sync(unsigned mask, int v) {
  return emu::warp_reduce(mask, v, "__reduce_max_sync", [](int a, int b) { return a > b ? a : b; });
}
inline unsigned __reduce_add_sync(unsigned mask, unsigned v) {
  return emu::warp_reduce(mask, v, "__reduce_add_sync", [](unsigned a, unsigned b) { return a + b; });
}
inline int __reduce_add_sync(unsigned mask, int v) {
  return emu::warp_reduce(mask, v, "__reduce_add_sync", [](int a, int b) { return int(unsigned(a) + unsigned(b)); });
}
template <class T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  return emu::warp_lane(mask, v, (emu::lane_id() ^ lane_mask) & (width - 1) | (emu::lane_id() & ~(width - 1)),
                        "__shfl_xor_sync");
}
template <class T>
T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  return emu::warp_lane(mask, v, (src & (width - 1)) | (emu::lane_id() & ~(width - 1)), "__shfl_sync");
}
template <class T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  const int l = emu::lane_id();
  return emu::warp_lane(mask, v, l % width >= int(delta) ? l - int(delta) : l, "__shfl_up_sync");
}
inline void __syncwarp(unsigned mask = 0xFFFFFFFFu) {
  emu::full_mask(mask, "__syncwarp");
  emu::Runner::current().sync_warp();
}
template <class T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  const int l = emu::lane_id(), in = l % width + int(delta);
  return emu::warp_lane(mask, v, in < width ? l + int(delta) : l, "__shfl_down_sync");
}
// Bit l: lane l's predicate.
inline unsigned __ballot_sync(unsigned mask, int pred) {
  return emu::warp_reduce(mask, pred ? 1u << emu::lane_id() : 0u, "__ballot_sync",
                          [](unsigned a, unsigned b) { return a | b; });
}
inline int __all_sync(unsigned mask, int pred) {
  return int(emu::warp_reduce(mask, unsigned(pred != 0), "__all_sync", [](unsigned a, unsigned b) { return a & b; }));
}
inline int __any_sync(unsigned mask, int pred) {
  return int(emu::warp_reduce(mask, unsigned(pred != 0), "__any_sync", [](unsigned a, unsigned b) { return a | b; }));
}

// Atomics: the fibers of a launch take turns on one OS thread and switch only at barriers, so a
// plain read-modify-write is atomic here.
template <class T>
T atomicAdd(T* p, T v) {
  const T old = *p;
  *p = T(old + v);
  return old;
}
template <class T>
T atomicExch(T* p, T v) {
  const T old = *p;
  *p = v;
  return old;
}
template <class T>
T atomicCAS(T* p, T compare, T v) {
  const T old = *p;
  if (old == compare) *p = v;
  return old;
}
template <class T>
T atomicMax(T* p, T v) {
  const T old = *p;
  if (v > old) *p = v;
  return old;
}
template <class T>
T atomicMin(T* p, T v) {
  const T old = *p;
  if (v < old) *p = v;
  return old;
}

// ---- For the small operations and the router (test_small_ops_host.cpp) ----
// CUDA's floating-point min / max overloads are fminf / fmaxf (a NaN operand gives the other one).
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline double min(double a, double b) { return std::fmin(a, b); }
inline double max(double a, double b) { return std::fmax(a, b); }

// ---- For the indexer's score kernels (test_indexer_host.cpp) ----
// The 1-based position of the lowest set bit (0 for none).
inline int __ffs(int v) { return __builtin_ffs(v); }
inline int __ffs(unsigned v) { return __builtin_ffs(int(v)); }
// The lanes whose v equals this lane's, as a mask (a warp collective over all 32 lanes).
inline unsigned __match_any_sync(unsigned mask, unsigned v) {
  emu::full_mask(mask, "__match_any_sync");
  unsigned all[32];
  emu::Runner::current().warp_exchange(v, all);
  unsigned peers = 0;
  for (int l = 0; l < 32; ++l)
    if (all[l] == v) peers |= 1u << l;
  return peers;
}
// A streaming load (ld.global.cs): a plain load here.
template <class T>
inline T __ldcs(const T* p) {
  return *p;
}
// For topk_common.cuh, which the indexer's kernels include: CUDA's unsigned min / max, and the
// stream type its host declarations name.
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
typedef struct CUstream_st* cudaStream_t;
