// The sparse MLA attention tests' cases and inputs, on the GPU (test_cuda_attention.cpp) and in the
// host emulation (test_sparse_mla_host.cpp): query tokens over sequences of a paged cache, latent
// rows, queries and top-k selections. Host code only.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "paged_test_util.h"
#include "util/half.h"

namespace sparsemla::cuda::test_paged {

struct MlaCase {
  int heads, kv_lora, rope;
  std::vector<int> ctx;  // per query token (token t in sequence t % n_seq)
  int top_k;             // 0: dense
  int n_seq;
  int block_size;
  // Selections in top_k's order (positions ascending, then the -1 entries) and launched with
  // AttentionArgs::selected_front; else in random order with the -1 entries among them.
  bool front = false;
  // > 0: rows along one direction u with magnitudes growing as exp(growth * pos / len) and every
  // head's query along u, so that in position order a row's scores keep rising far past the lazy
  // softmax maximum's slack and the fp8 group scales past their lazy bound (sparse_mla_tile.cuh,
  // sparse_mla_fp8.cu): the rescaling those make rare is taken tile after tile. Else i.i.d. rows.
  float growth = 0.0f;
  // With front: the entries past a token's context hold position 0 instead of -1 (a stale tail the
  // kernels must not read: AttentionArgs::selected_front says a token's positions are its first
  // min(top_k, n_ctx) entries), so that a kernel going over them adds row 0 and fails the reference,
  // which takes only those entries (mla_rows).
  bool stale_tail = false;
  // q multiplied by q_gain and the softmax scale divided by it (the same weights): 1e5 takes q past
  // fp16's largest value (65504), 1e-6 into its subnormals, which a kernel holding q as fp16 must
  // scale q out of (sparse_mla_sm90.cu's load_q).
  float q_gain = 1.0f;
  // The output written this many floats past the start of its buffer: 2 keeps the 8 bytes every
  // kernel's float2 stores need but not the 16 of the Hopper kernel's bulk stores (it then stores
  // from registers).
  int out_shift = 0;
};

// The selection entries of token t the kernels (and the reference) take: AttentionArgs's contract.
inline int mla_rows(const MlaCase& c, int n_ctx) {
  if (c.top_k <= 0) return n_ctx;
  return c.front ? std::min(c.top_k, n_ctx) : c.top_k;
}

// Each sequence's length: the longest context of its query tokens (at least 1).
inline std::vector<int> mla_lens(const MlaCase& c) {
  std::vector<int> l(size_t(c.n_seq), 1);
  for (size_t t = 0; t < c.ctx.size(); ++t) l[t % size_t(c.n_seq)] = std::max(l[t % size_t(c.n_seq)], c.ctx[t]);
  return l;
}

struct MlaInputs {
  std::vector<int32_t> seq, n_ctx;  // per query token
  std::vector<float> rows;          // [pg.n_slots(), kv_lora + rope], a latent row per slot
  std::vector<float> q;             // [T, heads, kv_lora + rope]
  std::vector<int32_t> sel;         // [T, top_k]: distinct positions < n_ctx, -1 past the context
  int64_t max_ctx = 0;
};

// A case's inputs over the tables pg (built from mla_lens(c)), drawn from rng in this order: the
// rows, the queries, the growth direction, the selections.
inline MlaInputs mla_inputs(const MlaCase& c, const Paged& pg, std::mt19937& rng) {
  const int T = int(c.ctx.size()), D = c.kv_lora + c.rope;
  MlaInputs in;
  for (int t = 0; t < T; ++t) {
    in.seq.push_back(t % c.n_seq);
    in.n_ctx.push_back(c.ctx[size_t(t)]);
  }
  in.max_ctx = *std::max_element(in.n_ctx.begin(), in.n_ctx.end());
  in.rows = random_vec(size_t(pg.n_slots() * D), rng);
  in.q = random_vec(size_t(T) * c.heads * D, rng, 0.3f);
  if (c.growth > 0.0f) {
    const std::vector<int> lens = mla_lens(c);
    const std::vector<float> u = random_vec(size_t(D), rng);
    for (int s = 0; s < c.n_seq; ++s)
      for (int p = 0; p < lens[size_t(s)]; ++p) {
        const float g = std::exp(c.growth * float(p) / float(lens[size_t(s)]));
        float* r = in.rows.data() + pg.slot(s, p) * D;
        for (int i = 0; i < D; ++i) r[i] = g * (u[size_t(i)] + 0.5f * r[i]);
      }
    // bf16 values (exact in fp16 too), so that every kernel's query is the reference's: at scores of
    // ~55 log2 units the kernels' own roundings of q (bf16, or fp16 in the fp8-row kernel) would
    // move P by more than the tests' tolerance.
    for (size_t i = 0; i < in.q.size(); ++i)
      in.q[i] = sparsemla::bf16_to_f32(sparsemla::f32_to_bf16(0.05f * (u[i % size_t(D)] + in.q[i] / 0.3f)));
  }
  if (c.top_k > 0) {
    in.sel.assign(size_t(T) * c.top_k, -1);
    for (int t = 0; t < T; ++t) {
      std::vector<int32_t> all(size_t(in.n_ctx[size_t(t)]));
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), rng);
      const int n_sel = std::min(c.top_k, in.n_ctx[size_t(t)]);
      for (int i = 0; i < n_sel; ++i) in.sel[size_t(t) * c.top_k + i] = all[size_t(i)];
      const auto first = in.sel.begin() + int64_t(t) * c.top_k;
      if (c.front) std::sort(first, first + n_sel);
      else std::shuffle(first, first + c.top_k, rng);
      if (c.front && c.stale_tail) std::fill(first + n_sel, first + c.top_k, 0);
    }
  }
  return in;
}

}  // namespace sparsemla::cuda::test_paged
