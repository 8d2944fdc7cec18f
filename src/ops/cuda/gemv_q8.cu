// The int8-activation decode products of quant_matmul_q8.h: activation quantization, the dp4a
// decode kernel and its dispatch table.
//
// Kernel layout (as gemv.cuh): a block takes kQ8Rows weight rows and all tokens; its threads split
// a row's units round-robin, U units per step fully unrolled so that U x R units' weight loads are
// in flight together. A unit is the weight bytes of whole activation blocks, so that each integer
// dot product meets one activation scale:
//   Q4_K / Q5_K  quarter k of a 256-block: 64 elements = sub-blocks 2k (low nibbles) and 2k + 1
//                (high), two 16-byte quant loads (+ Q5_K's 32 bytes of high bits);
//   Q6_K         half h, l0 in {0, 16} of a 256-block: 16 elements of each of the 4 activation
//                blocks 4h + j, from 3 x 16 bytes (ql twice, qh) read as aligned words;
//   Q2_K / Q3_K  the same 4 x 16 elements as Q6_K (PlanesUnit), from 16 bytes of bit planes
//                (+ Q3_K's 16 bytes of high bits);
//   IQ types     as Q4_K, two groups of 32 under one scale each (GroupPairUnit: IQ4_XS, IQ2_XXS,
//                IQ3_XXS, IQ3_S, IQ1_S with its delta through the activation sums; IQ1_M with
//                a scale per 16 elements and a delta per 8 through the entries' sums);
//                GroupPair16Unit, a scale per 16 elements: IQ2_XS, IQ2_S), the
//                values looked up in IQ4_NL's levels or the type's grid (the quant tables), with
//                their signs;
//   Q8_0         one 32-block, 32 bytes read as aligned words;
//   Q4_0 /       one 32-block, 16 bytes of nibbles (Nibbles32Unit): Q4_0's - 8 through the block's
//   IQ4_NL       activation sum, IQ4_NL's levels looked up as IQ4_XS's.
// Per row and token: one __dp4a per 4 elements into an int32 dot, then per sub-block
//   acc += (d_w sc) * d_x * dot  [- (dmin m) * (d_x sum_x) for Q4_K/Q5_K/Q2_K]
// in fp32. The integer dots are exact; an activation load (16 bytes, through L1) feeds all R rows.
// With two activation levels (quant_matmul_q8.h) each dot runs a second __dp4a chain over the
// residual level r, started from 254 times the first one: sum w (254 q + r), still exact in int32
// (up to ~1.3e8), so it is converted to float by cvt, not by dq::int_to_f (exact below 2^22 only).
//
// Batch invariance: the thread count depends only on n_cols and the type, thread i takes units
// i, i + threads, ... in that order, and the per-thread sums are reduced by a fixed shuffle tree
// and then warp by warp; none of it depends on NT or on the token count.
#include "ops/cuda/quant_matmul_q8.h"

#include <algorithm>
#include <atomic>

#include "ops/cuda/check.cuh"
#include "ops/cuda/dequant.cuh"
#include "ops/cuda/gemv_q8_kernels.cuh"
#include "ops/cuda/launch_cache.cuh"
#include "ops/cuda/pdl.cuh"
#include "ops/cuda/q8_units.cuh"
#include "ops/cuda/quant_matmul_kernels.cuh"

namespace sparsemla::cuda {

namespace {

using gguf::GgmlType;
using namespace q8units;
using namespace q8gemv;

// Whether products may take the staged kernels (takes_staged), and how many launches took them.
bool g_q8_staged = true;
std::atomic<int64_t> g_q8_staged_launches{0}, g_q8_group_launches{0};

template <class V, int L>
void launch_q8_levels(const MatArgs& a, cudaStream_t s) {
  const Q8Plan p = plan_q8<V, L>(a, g_q8_staged);
  if (p.path != Q8Plan::kPlain) {
    ++g_q8_staged_launches;
    if (p.path == Q8Plan::kStagedGroups) ++g_q8_group_launches;
  }
  if (p.group_kernel) {
    allow_smem(p.group_kernel, p.smem);
    pdl::launch(p.group_kernel, p.grid, p.threads, p.smem, s, a, p.groups);
  } else {
    if (p.smem) allow_smem(p.kernel, p.smem);
    pdl::launch(p.kernel, p.grid, p.threads, p.smem, s, a);
  }
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

template <class V>
void launch_levels(const MatArgs& a, cudaStream_t s) {
  if (a.xr) launch_q8_levels<V, 2>(a, s);
  else launch_q8_levels<V, 1>(a, s);
}

struct Q8Kernels {
  GgmlType type;
  void (*launch)(const MatArgs&, cudaStream_t);
};

// Every weight type with an int8-activation kernel.
constexpr Q8Kernels kQ8Kernels[] = {
    {GgmlType::Q8_0, &launch_levels<Q80Unit>},
    {GgmlType::Q4_K, &launch_levels<Q4KUnit>},
    {GgmlType::Q5_K, &launch_levels<Q5KUnit>},
    {GgmlType::Q6_K, &launch_levels<Q6KUnit>},
    {GgmlType::Q2_K, &launch_levels<Q2KUnit>},
    {GgmlType::Q3_K, &launch_levels<Q3KUnit>},
    {GgmlType::IQ4_XS, &launch_levels<IQ4XSUnit>},
    {GgmlType::IQ2_XXS, &launch_levels<IQ2XXSUnit>},
    {GgmlType::IQ3_XXS, &launch_levels<IQ3XXSUnit>},
    {GgmlType::IQ3_S, &launch_levels<IQ3SUnit>},
    {GgmlType::IQ2_XS, &launch_levels<IQ2XSUnit>},
    {GgmlType::IQ2_S, &launch_levels<IQ2SUnit>},
    {GgmlType::IQ1_S, &launch_levels<IQ1SUnit>},
    {GgmlType::IQ1_M, &launch_levels<IQ1MUnit>},
    {GgmlType::Q4_0, &launch_levels<Q40Unit>},
    {GgmlType::IQ4_NL, &launch_levels<IQ4NLUnit>},
};

const Q8Kernels& q8_kernels_for(GgmlType t, const char* what) {
  for (const Q8Kernels& k : kQ8Kernels)
    if (k.type == t) return k;
  // (The entry points refuse other types first: quant_matmul.cu, checked_q8_product.)
  fail("cuda::{}: internal error: no int8-activation kernel for {}", what, gguf::type_name(t));
}

bool aligned(const void* p, uintptr_t n) { return (reinterpret_cast<uintptr_t>(p) & (n - 1)) == 0; }

}  // namespace

size_t q8_scales_offset(int64_t n_tokens, int64_t n_cols, int levels) {
  return size_t(levels) * ((size_t(n_tokens * n_cols) + 15) / 16 * 16);
}

size_t q8_activation_bytes(int64_t n_tokens, int64_t n_cols, int levels) {
  return q8_scales_offset(n_tokens, n_cols, levels) + size_t(n_tokens * (n_cols / kQ8ActBlock)) * 8;
}

Q8Out q8_output(const char* op, int64_t n_tokens, int64_t n_cols, Q8Activations& out, int levels) {
  if (levels != 1 && levels != 2) fail("cuda::{}: {} levels (1 or 2)", op, levels);
  if (n_tokens < 0 || n_cols <= 0 || n_cols % kQ8ActBlock != 0)
    fail("cuda::{}: {} tokens x {} columns: columns must be a positive multiple of {}", op, n_tokens, n_cols,
         kQ8ActBlock);
  const size_t need = q8_activation_bytes(n_tokens, n_cols, levels);
  if (!out.data || !aligned(out.data, 16) || out.bytes < need)
    fail("cuda::{}: output buffer {} of {} bytes; {} tokens x {} columns need {} bytes, 16-byte aligned", op, out.data,
         out.bytes, n_tokens, n_cols, need);
  out.n_tokens = n_tokens;
  out.n_cols = n_cols;
  out.levels = levels;
  Q8Out o;
  o.q = static_cast<int8_t*>(out.data);
  o.r = levels == 2 ? o.q + q8_scales_offset(n_tokens, n_cols, 1) : nullptr;
  o.blocks = reinterpret_cast<int2*>(static_cast<uint8_t*>(out.data) + q8_scales_offset(n_tokens, n_cols, levels));
  return o;
}

void quantize_activations(const float* x, int64_t n_tokens, int64_t n_cols, Q8Activations& out, Stream s,
                          int levels) {
  if (!aligned(x, 4)) fail("cuda::quantize_activations: input {} is not 4-byte aligned", static_cast<const void*>(x));
  const Q8Out o = q8_output("quantize_activations", n_tokens, n_cols, out, levels);
  const int64_t n_blocks = n_tokens * (n_cols / kQ8ActBlock);
  if (n_blocks == 0) return;
  constexpr int kThreads = 256;
  const unsigned grid = unsigned(ceil_div(n_blocks * 32, kThreads));
  // A plain launch: as a dependent launch (PDL) it measured no faster in the model (H200, session
  // 25: 3-layer Q4_K_M 0.944 against 0.920 ms per step, Q8_0 1.033 against 1.041, 4 rounds), as
  // the other small kernels in session 20.
  const cudaStream_t st = static_cast<cudaStream_t>(s);
  if (levels == 2) quantize_q8_kernel<2><<<grid, kThreads, 0, st>>>(x, n_blocks, o.q, o.r, o.blocks);
  else quantize_q8_kernel<1><<<grid, kThreads, 0, st>>>(x, n_blocks, o.q, o.r, o.blocks);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

void set_q8_staged_loads(bool on) { g_q8_staged = on; }
bool q8_staged_loads() { return g_q8_staged; }
int64_t q8_staged_launches() { return g_q8_staged_launches.load(); }
int64_t q8_staged_group_launches() { return g_q8_group_launches.load(); }

bool q8_supported(gguf::GgmlType t) {
  for (const Q8Kernels& k : kQ8Kernels)
    if (k.type == t) return true;
  return false;
}

void launch_q8(GgmlType t, const MatArgs& a, cudaStream_t s) { q8_kernels_for(t, "launch_q8").launch(a, s); }

std::string q8_type_names() {
  std::string names;
  for (const Q8Kernels& k : kQ8Kernels) names += (names.empty() ? "" : ", ") + std::string(gguf::type_name(k.type));
  return names;
}

}  // namespace sparsemla::cuda
