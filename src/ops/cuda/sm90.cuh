// Hopper (sm_90a) instructions as device functions: shared-memory addresses, wgmma (descriptors,
// fences, the m64n64k16 and m64n256k16 shapes the attention kernel uses), mbarriers (with
// transaction bytes), the async-proxy fence, and thread-block clusters (rank, the
// other block's addresses, cluster barrier, remote arrivals, st.async). Defined only in sm_90a
// device passes (__CUDA_ARCH_FEAT_SM90_ALL); a kernel file includes this and uses them under the
// same condition.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

namespace sparsemla::cuda::sm90 {

__device__ __forceinline__ uint32_t smem_u32addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

// Descriptor of an unswizzled operand at shared address `addr`.
__device__ __forceinline__ uint64_t wgmma_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return uint64_t((addr & 0x3ffff) >> 4) | (uint64_t(lbo >> 4) << 16) | (uint64_t(sbo >> 4) << 32);
}
// Descriptor of an operand in 128-byte swizzled lines (atoms of 8 lines, 1024-byte aligned).
__device__ __forceinline__ uint64_t wgmma_desc_sw128(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return wgmma_desc(addr, lbo, sbo) | (uint64_t(1) << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Keeps registers that an in-flight wgmma reads or writes from being touched before its wait.
template <int N>
__device__ __forceinline__ void reg_fence(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void reg_fence(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

#define SPARSEMLA_F8(d, i)                                                                          \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define SPARSEMLA_F32(d, i) SPARSEMLA_F8(d, i), SPARSEMLA_F8(d, i + 8), SPARSEMLA_F8(d, i + 16), SPARSEMLA_F8(d, i + 24)

// d[64 x 64] (+)= A[64 x 16] B[16 x 64], both K-major in shared memory.
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
      "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : SPARSEMLA_F32(d, 0)
      : "l"(da), "l"(db), "r"(accumulate));
}

#define SPARSEMLA_D128                                                                       \
  "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"                                   \
  "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"                         \
  "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"                         \
  "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,"                         \
  "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,"                         \
  "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,"                         \
  "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,"             \
  "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127"

// d[64 x 256] += A[64 x 16] B[16 x 256]: A from registers (the m16n8k16 A fragment of this warp's
// 16 rows), B MN-major in shared memory.
__device__ __forceinline__ void wgmma_m64n256k16_rs(float (&d)[128], const uint32_t (&a)[4], uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" SPARSEMLA_D128
      "}, {%128,%129,%130,%131}, %132, p, 1, 1, 1;\n}\n"
      : SPARSEMLA_F32(d, 0), SPARSEMLA_F32(d, 32), SPARSEMLA_F32(d, 64), SPARSEMLA_F32(d, 96)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(1));
}

// d[64 x 256] += A[64 x 16] B[16 x 256]: A K-major, B MN-major, both in shared memory.
__device__ __forceinline__ void wgmma_m64n256k16_ss(float (&d)[128], uint64_t da, uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" SPARSEMLA_D128
      "}, %128, %129, p, 1, 1, 0, 1;\n}\n"
      : SPARSEMLA_F32(d, 0), SPARSEMLA_F32(d, 32), SPARSEMLA_F32(d, 64), SPARSEMLA_F32(d, 96)
      : "l"(da), "l"(db), "n"(1));
}

#undef SPARSEMLA_D128
#undef SPARSEMLA_F32
#undef SPARSEMLA_F8

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32addr(bar)) : "memory");
}
// Waits for the completion of the barrier's phase of this parity.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(smem_u32addr(bar)),
      "r"(parity)
      : "memory");
}
// Arrives on `bar` once every cp.async this thread issued before has completed; the arrival is one
// of those the barrier was initialized with (.noinc).
__device__ __forceinline__ void cp_async_mbar_arrive_noinc(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_u32addr(bar)) : "memory");
}
// Orders this thread's ordinary shared-memory writes before later reads by the tensor cores.
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// A bulk copy of `bytes` from shared to global memory (the TMA unit; a multiple of 16 bytes, both
// addresses 16-byte aligned), in the thread's bulk group. The shared memory must have been written
// before a fence_async_smem() of its writers. Then bulk_commit(), and bulk_wait_read() before the
// source is written again or the block exits.
__device__ __forceinline__ void bulk_store(void* dst, uint32_t src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }

// Thread-block clusters.
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// The cluster's size along x, in blocks.
__device__ __forceinline__ uint32_t cluster_dim_x() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_nctaid.x;" : "=r"(r));
  return r;
}
// Block `peer`'s shared::cluster address of this block's shared address `addr`.
__device__ __forceinline__ uint32_t peer_u32addr(uint32_t addr, uint32_t peer) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(peer));
  return r;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}
// An arrival on the other block's barrier `peer_bar`, with the default semantics (release at CTA
// scope), as CUTLASS's ClusterBarrier::arrive(cta_id) has it: the attention kernel arrives once its
// tensor-core reads of a tile have completed (wgmma.wait_group), so the other block's writes into the
// buffer cannot pass them. `.release.cluster` compiles to MEMBAR.ALL.GPU before every such arrival
// (Nsight, session 46: ~6% of the pairs' stall samples).
__device__ __forceinline__ void mbar_arrive_peer(uint32_t peer_bar) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(peer_bar) : "memory");
}
// Arrives on this block's barrier and adds `bytes` to the transfers its phase waits for.
__device__ __forceinline__ void mbar_arrive_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32addr(bar)), "r"(bytes) : "memory");
}
// 16 (4) bytes into another block's shared memory, counted on its barrier `peer_bar`.
__device__ __forceinline__ void st_async16(uint32_t peer_dst, uint4 v, uint32_t peer_bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(peer_dst),
               "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(peer_bar)
               : "memory");
}
__device__ __forceinline__ void st_async4(uint32_t peer_dst, uint32_t v, uint32_t peer_bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(peer_dst), "r"(v),
               "r"(peer_bar)
               : "memory");
}

}  // namespace sparsemla::cuda::sm90

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
