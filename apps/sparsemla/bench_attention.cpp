// `sparsemla bench attention`: the sparse-attention kernels (lightning indexer, top-k, sparse MLA)
// at GLM-5's and DeepSeek-V3.2's shapes, batches and contexts, next to the device's measured
// ceilings (a large device-to-device copy; a large bf16 GEMM through cuBLAS).
#include <fmt/format.h>

#include <cstdio>
#include <string>
#include <vector>

#include "commands.h"
#include "util/error.h"

#if SPARSEMLA_HAVE_CUDA
#include <algorithm>
#include <numeric>
#include <random>

#include "ops/cuda/attention.h"
#include "ops/cuda/buffer.h"
#include "ops/cuda/ceilings.h"
#include "ops/device.h"
#include "ops/select/select.h"
#endif

namespace sparsemla::app {
namespace {

struct BenchAttentionArgs {
  std::vector<std::string> shapes = {"glm5", "dsv32"};
  std::vector<int> batches = {1, 8, 64, 128};
  std::vector<int> contexts = {4096, 32768, 131072};
  std::vector<std::string> dtypes = {"bf16", "fp8"};
  std::string kernel = "auto";
  bool dense = false;
  int splits = 0;           // attention split-KV; 0: the kernel's own choice
  int heads_per_block = 0;  // attention heads per block (16, 32, 64); 0: the kernel's own choice
  int rotate = 0;           // sets of sequences the timed calls cycle through; 0: 8 / batch (at least 1)
  bool one_sequence = false;  // a call's tokens are one sequence's, as a prefill's (their rows shared in L2)
  int smem_limit = 0;       // attention: shared memory per block to fit into (0: the device's)
  int smem_per_sm = 0;      // attention: shared memory per SM to emulate (blocks per SM; 0: the device's)
  int reps = 5;
  std::string topk_path = "auto";  // auto, block, rows, team, spans: the top-k path (cuda::TopKPath)
  int topk_threads = 0;            // threads per block of the team and block paths (cuda::TopKWorkspace::threads)
  int prefill = 0;  // > 0: the indexer's scores for a prefill of this many tokens instead of the decode table
};

#if SPARSEMLA_HAVE_CUDA

struct Shape {
  const char* name;
  int heads, kv_lora, rope, idx_heads, idx_dim, top_k;
};
// The models' shapes, and one GPU's share of them under tensor parallelism (the query heads split
// over the ranks; the indexer replicated on every rank: dist/shard_plan.h).
const Shape kShapes[] = {{"glm5", 64, 512, 64, 32, 128, 2048},     {"dsv32", 128, 512, 64, 64, 128, 2048},
                         {"glm5-tp2", 32, 512, 64, 32, 128, 2048}, {"glm5-tp8", 8, 512, 64, 32, 128, 2048},
                         {"dsv32-tp2", 64, 512, 64, 64, 128, 2048}, {"dsv32-tp8", 16, 512, 64, 64, 128, 2048}};
constexpr int64_t kScoreSlack = 128;  // score row stride over the context

struct Timed {
  double us = 0;
};

// Kernel time per call, replayed from a CUDA graph of 10 calls (as a captured decode step runs it).
template <class F>
double time_us(int reps, F&& f) {
  struct Ctx {
    F* f;
  } ctx{&f};
  return cuda::graph_time_us(reps, 10, [](void* p, void* stream) { (*static_cast<Ctx*>(p)->f)(stream); }, &ctx);
}

// Random indexer queries and head weights for T tokens (seeds `seed`, `seed` + 1), the 16-bit copy
// the mma kernel reads (index_queries, no rotation), and the arguments that score them over `keys`
// into rows of `stride` scores; the caller sets the tokens' sequences and contexts.
struct IndexerInputs {
  cuda::DeviceBuffer q, w, q16, pos;
  cuda::IndexerArgs args;
};
IndexerInputs indexer_inputs(const Shape& sh, int T, cuda::KvDtype dt, cuda::IndexerKernel ik, uint64_t seed,
                             const cuda::PagedRows& keys, float* scores, int64_t stride) {
  IndexerInputs in{cuda::DeviceBuffer(size_t(T) * sh.idx_heads * sh.idx_dim * 4),
                   cuda::DeviceBuffer(size_t(T) * sh.idx_heads * 4),
                   cuda::DeviceBuffer(size_t(T) * sh.idx_heads * sh.idx_dim * 2), cuda::DeviceBuffer(size_t(T) * 8),
                   {}};
  cuda::fill_uniform(in.q.as<float>(), int64_t(T) * sh.idx_heads * sh.idx_dim, seed);
  cuda::fill_uniform(in.w.as<float>(), int64_t(T) * sh.idx_heads, seed + 1, 0.1f);
  in.pos.zero();
  cuda::index_queries(in.q.as<float>(), in.w.as<float>(), T, sh.idx_heads, sh.idx_dim, cuda::RopeTable{},
                      in.pos.as<int64_t>(), 1.0f, dt, in.q16.as<uint16_t>(), nullptr);
  cuda::IndexerArgs& ia = in.args;
  ia.q = in.q.as<float>();
  ia.q16 = ik == cuda::IndexerKernel::Mma ? in.q16.as<uint16_t>() : nullptr;
  ia.w = in.w.as<float>();
  ia.T = T;
  ia.heads = sh.idx_heads;
  ia.dim = sh.idx_dim;
  ia.max_ctx = stride;
  ia.keys = keys;
  ia.dtype = dt;
  ia.scores = scores;
  ia.score_stride = stride;
  return in;
}

// --prefill T: the indexer's scores for T tokens of one sequence ending at each context (the causal
// mask: token t sees context - T + 1 + t keys), every mma kernel that takes the call asked for by name
// (the tokens kernel, the default in a prefill, and qfrag and staged, which score one token per
// block), in TFLOP/s (2 x heads x dim per key and token) against the cuBLAS bf16 GEMM's.
void bench_prefill_indexer(const BenchAttentionArgs& a, const Shape& sh, const std::string& dname, cuda::KvDtype dt,
                           const cuda::PagedRows& key_rows, cuda::IndexerKernel ik, double gemm_flops) {
  for (int ctx : a.contexts) {
    const int T = std::min(a.prefill, ctx);
    std::vector<int32_t> seq(static_cast<size_t>(T), 0), n_ctx(static_cast<size_t>(T));
    double keys_scored = 0;
    for (int t = 0; t < T; ++t) {
      n_ctx[size_t(t)] = ctx - T + 1 + t;
      keys_scored += n_ctx[size_t(t)];
    }
    cuda::DeviceBuffer d_seq = cuda::to_device(seq), d_n = cuda::to_device(n_ctx);
    cuda::DeviceBuffer scores(size_t(T) * size_t(ctx) * 4);
    IndexerInputs in = indexer_inputs(sh, T, dt, ik, 21, key_rows, scores.as<float>(), ctx);
    cuda::IndexerArgs& ia = in.args;
    ia.seq = d_seq.as<int32_t>();
    ia.n_ctx = d_n.as<int32_t>();
    ia.tokens_per_run = T;
    const double flops = 2.0 * sh.idx_heads * sh.idx_dim * keys_scored;
    std::vector<cuda::IndexerMma> done;
    for (cuda::IndexerMma k : {cuda::IndexerMma::kTokens, cuda::IndexerMma::kQfrag, cuda::IndexerMma::kStaged}) {
      ia.mma = k;
      const cuda::IndexerMma ran = ik == cuda::IndexerKernel::Mma ? cuda::indexer_mma_choice(ia) : cuda::IndexerMma::kAuto;
      if (std::find(done.begin(), done.end(), ran) != done.end()) continue;  // (a fallback already timed)
      done.push_back(ran);
      const double us = time_us(a.reps, [&](void* st) { cuda::indexer_scores(ia, ik, st); });
      std::printf("prefill indexer %-9s %-4s %5d tokens ending at %7d | %-6s %10.1f us %7.1f TFLOP/s %4.0f%% of the GEMM\n",
                  sh.name, dname.c_str(), T, ctx, ik == cuda::IndexerKernel::Mma ? cuda::indexer_mma_name(ran) : "fma", us,
                  flops / us * 1e-6, 100.0 * flops / (us * 1e-6) / gemm_flops);
      std::fflush(stdout);
      if (ik != cuda::IndexerKernel::Mma) break;
    }
  }
}

int run_bench_attention(const BenchAttentionArgs& a) {
  const auto devs = ops::list_devices();
  if (devs.empty()) fail("bench attention needs a CUDA device");
  const double copy_bps = cuda::measure_copy_bytes_per_s();
  const double gemm_flops = cuda::measure_bf16_gemm_flops();
  std::printf("device: %s (compute capability %d.%d, %d SMs)\n", devs[0].name.c_str(), devs[0].cc_major,
              devs[0].cc_minor, devs[0].sm_count);
  std::printf("ceilings: device-to-device copy %.0f GB/s (read + write), bf16 GEMM 8192^3 %.0f TFLOP/s\n",
              copy_bps / 1e9, gemm_flops / 1e12);
  // The attention kernel asked for, or (auto) the one the model would take for the shape on this
  // device: the backend selector's choice, as the GPU model makes it.
  auto attention_kernel = [&](const Shape& sh, bool fp8) {
    std::string backend = "cuda-" + a.kernel;
    if (a.kernel == "wgmma") backend = "cuda-wgmma-sm90";
    if (a.kernel == "auto") {
      ops::DeviceInfo dev = devs[0];
      if (a.smem_limit > 0) dev.smem_per_block_optin = uint64_t(a.smem_limit);  // as such a device would choose
      if (a.smem_per_sm > 0) dev.smem_per_sm = uint64_t(a.smem_per_sm);
      backend = ops::select_backends(ops::attention_problem(&dev, sh.heads, sh.kv_lora, sh.rope, sh.idx_heads,
                                                            sh.idx_dim, !a.dense, fp8))
                    .get("attention")
                    .chosen;
    }
    cuda::AttentionKernel k = cuda::AttentionKernel::Mma;
    if (!cuda::attention_kernel_named(backend, &k)) fail("bench attention: no GPU attention kernel ({})", backend);
    return k;
  };
  const cuda::IndexerKernel ik = a.kernel == "fma" ? cuda::IndexerKernel::Fma : cuda::IndexerKernel::Mma;
  std::printf("kernels: attention %s, indexer %s\n",
              a.kernel == "auto" ? "as the model takes it on this device (last column)" : a.kernel.c_str(),
              a.kernel == "fma" ? "fma" : "mma");
  // Consecutive timed calls read different sequences (sets of `batch` each), so that a small batch
  // does not find the previous call's keys and rows in the L2 cache (50 MB on an H200).
  auto sets_of = [&](int B) { return a.rotate > 0 ? a.rotate : std::max(1, 8 / B); };
  int n_seq = 0;
  for (int B : a.batches) n_seq = std::max(n_seq, B * sets_of(B));
  const int max_ctx = *std::max_element(a.contexts.begin(), a.contexts.end());
  const int bs = 64;
  const int blocks_per_seq = (max_ctx + bs - 1) / bs;
  const int64_t n_slots = int64_t(n_seq) * blocks_per_seq * bs;

  if (a.prefill == 0)
    std::printf("%-9s %-4s %5s %7s | %9s %7s %5s | %8s %8s | %9s | %9s %7s %5s %7s %5s | %9s %5s | %s\n", "shape",
                "kv", "batch", "context", "indexer", "GB/s", "%bw", "top-k", "tied", "idx+top-k", "attention", "GB/s",
                "%bw", "TFLOP/s", "%mma", "step", "%bw", "kernels");
  for (const std::string& dname : a.dtypes) {
    const cuda::KvDtype dt = dname == "fp8" ? cuda::KvDtype::FP8 : cuda::KvDtype::BF16;
    for (const Shape& sh : kShapes) {
      if (std::find(a.shapes.begin(), a.shapes.end(), sh.name) == a.shapes.end()) continue;
      const cuda::AttentionKernel ak = attention_kernel(sh, dt == cuda::KvDtype::FP8);
      const int64_t lrow = cuda::latent_row_bytes(dt, sh.kv_lora, sh.rope);
      const int64_t krow = cuda::index_key_row_bytes(dt, sh.idx_dim);
      cuda::DeviceBuffer latent(size_t(n_slots * lrow)), keys(size_t(n_slots * krow));
      {  // random rows, written through the cache kernels in chunks
        const int64_t chunk = 1 << 20;
        cuda::DeviceBuffer tmp(size_t(chunk) * (sh.kv_lora + sh.rope) * 4), slots(size_t(chunk) * 8);
        std::vector<int64_t> ids(static_cast<size_t>(chunk));
        for (int64_t s0 = 0; s0 < n_slots; s0 += chunk) {
          const int64_t n = std::min(chunk, n_slots - s0);
          std::iota(ids.begin(), ids.begin() + n, s0);
          slots.upload(ids.data(), size_t(n) * 8);
          cuda::fill_uniform(tmp.as<float>(), n * (sh.kv_lora + sh.rope), uint64_t(s0) + 1);
          cuda::write_latent_rows(tmp.as<float>(), slots.as<int64_t>(), n, dt, sh.kv_lora, sh.rope, latent.get(), lrow,
                                  nullptr);
          cuda::fill_uniform(tmp.as<float>(), n * sh.idx_dim, uint64_t(s0) + 7);
          cuda::write_index_keys(tmp.as<float>(), slots.as<int64_t>(), n, dt, sh.idx_dim, keys.get(), krow, nullptr);
        }
      }
      std::vector<int32_t> table(size_t(n_seq) * blocks_per_seq);
      std::iota(table.begin(), table.end(), 0);
      std::shuffle(table.begin(), table.end(), std::mt19937(1));
      cuda::DeviceBuffer d_table = cuda::to_device(table);
      const cuda::PagedRows latent_rows{latent.get(), lrow, d_table.as<int32_t>(), blocks_per_seq, bs};
      const cuda::PagedRows key_rows{keys.get(), krow, d_table.as<int32_t>(), blocks_per_seq, bs};
      if (a.prefill > 0) {
        bench_prefill_indexer(a, sh, dname, dt, key_rows, ik, gemm_flops);
        continue;
      }
      cuda::AttentionWorkspace ws;
      if (a.smem_limit > 0) {  // the mma kernel's shapes on a device with this much (launches are checked against it)
        ws.sm_count = devs[0].sm_count;
        ws.smem_optin = a.smem_limit;
      }
      ws.smem_per_sm = a.smem_per_sm;
      cuda::TopKWorkspace topk_ws;
      topk_ws.path = a.topk_path == "rows"    ? cuda::TopKPath::kRows
                     : a.topk_path == "block" ? cuda::TopKPath::kBlock
                     : a.topk_path == "team"  ? cuda::TopKPath::kTeam
                     : a.topk_path == "spans" ? cuda::TopKPath::kSpans
                                              : cuda::TopKPath::kAuto;
      topk_ws.threads = a.topk_threads;
      for (int B : a.batches)
        for (int ctx : a.contexts) {
          const int sets = sets_of(B);
          std::vector<cuda::DeviceBuffer> d_seqs;
          for (int set = 0; set < sets; ++set) {
            std::vector<int32_t> seq(static_cast<size_t>(B));
            if (a.one_sequence) std::fill(seq.begin(), seq.end(), set);
            else std::iota(seq.begin(), seq.end(), set * B);
            d_seqs.push_back(cuda::to_device(seq));
          }
          int call = 0;
          auto next_seq = [&] { return d_seqs[size_t(call++ % sets)].as<int32_t>(); };
          std::vector<int32_t> n_ctx(static_cast<size_t>(B), ctx);
          cuda::DeviceBuffer d_n = cuda::to_device(n_ctx);
          // Score rows a little longer than the context, as the model's (its stride is the cache's
          // capacity): the top-k takes the path it takes in the model.
          const int64_t sstride = ctx + kScoreSlack;
          cuda::DeviceBuffer scores(size_t(B * sstride) * 4), sel(size_t(B) * sh.top_k * 4);
          cuda::DeviceBuffer tied(size_t(B * sstride) * 4);  // all scores equal, as a model with zero weights gives
          cuda::fill_uniform(tied.as<float>(), B * sstride, 1, 0.0f);
          cuda::DeviceBuffer q(size_t(B) * sh.heads * (sh.kv_lora + sh.rope) * 4), out(size_t(B) * sh.heads * sh.kv_lora * 4);
          cuda::fill_uniform(q.as<float>(), int64_t(B) * sh.heads * (sh.kv_lora + sh.rope), 13, 0.1f);
          // The indexer's queries as the model hands them to the mma kernel too (rounded to its 16-bit type).
          IndexerInputs idx_in = indexer_inputs(sh, B, dt, ik, 11, key_rows, scores.as<float>(), sstride);
          cuda::IndexerArgs& ia = idx_in.args;
          ia.seq = next_seq();
          ia.n_ctx = d_n.as<int32_t>();
          const double t_idx = time_us(a.reps, [&](void* st) {
            ia.seq = next_seq();
            cuda::indexer_scores(ia, ik, st);
          });
          const double t_topk = time_us(a.reps, [&](void* st) {
            cuda::top_k(scores.as<float>(), B, sstride, d_n.as<int32_t>(), sh.top_k, sel.as<int32_t>(), st, &topk_ws);
          });
          const double t_topk_tied = time_us(a.reps, [&](void* st) {
            cuda::top_k(tied.as<float>(), B, sstride, d_n.as<int32_t>(), sh.top_k, sel.as<int32_t>(), st, &topk_ws);
          });
          // Both in one graph, as the model runs them: the top-k's first launch is scheduled while the
          // indexer drains (programmatic dependent launch), and the mma indexer counts the top-k's first
          // histogram as it writes the scores (top_k_counts).
          const double t_pair = time_us(a.reps, [&](void* st) {
            cuda::IndexerArgs pa = ia;
            pa.seq = next_seq();
            if (ik == cuda::IndexerKernel::Mma)
              pa.counts = cuda::top_k_counts(scores.as<float>(), B, sstride, sh.top_k, st, &topk_ws);
            cuda::indexer_scores(pa, ik, st);
            cuda::top_k(scores.as<float>(), B, sstride, d_n.as<int32_t>(), sh.top_k, sel.as<int32_t>(), st, &topk_ws);
          });
          cuda::AttentionArgs aa;
          aa.q = q.as<float>();
          aa.T = B;
          aa.heads = sh.heads;
          aa.kv_lora = sh.kv_lora;
          aa.rope = sh.rope;
          aa.scale = 0.07f;
          aa.seq = next_seq();
          aa.n_ctx = d_n.as<int32_t>();
          aa.selected = a.dense ? nullptr : sel.as<int32_t>();
          aa.top_k = sh.top_k;
          aa.max_ctx = ctx;
          aa.selected_front = true;  // top_k's order
          aa.latent = latent_rows;
          aa.dtype = dt;
          aa.out = out.as<float>();
          const double t_att = time_us(a.reps, [&](void* st) {
            aa.seq = next_seq();
            cuda::sparse_mla(aa, ak, ws, st, a.splits, a.heads_per_block);
          });
          const double rows = a.dense ? double(ctx) : double(std::min(ctx, sh.top_k));
          const double idx_bytes = double(B) * ctx * krow;
          const double att_bytes = double(B) * rows * lrow;
          const double att_flops = double(B) * sh.heads * rows * (sh.kv_lora + sh.rope + sh.kv_lora) * 2.0;
          const double step = t_pair + t_att;
          // What ran (the launch decides some of it: the mma kernel takes bf16 batches under 8 tokens from
          // the Hopper one, and fp8 rows by batch and shared memory): kernel, heads per block x tiles in
          // flight, split-KV blocks per token.
          const std::string ran = fmt::format("{}{}, {}x{}, {} split{}{}", ws.last.kernel,
                                              ws.last_paired ? " pairs" : "",
                                              ws.last.heads_per_block, ws.last.stages, ws.last.splits,
                                              ws.last.splits == 1 ? "" : "s",
                                              ws.last_split_cluster ? " merged in clusters" : "") +
                                  (topk_ws.last_path == cuda::TopKPath::kTeam    ? "; top-k team"
                                   : topk_ws.last_path == cuda::TopKPath::kSpans ? "; top-k spans"
                                   : topk_ws.last_path == cuda::TopKPath::kBlock ? "; top-k block"
                                                                                 : "; top-k rows") +
                                  (ik == cuda::IndexerKernel::Mma
                                       ? std::string("; indexer ") + cuda::indexer_mma_name(cuda::indexer_mma_choice(ia))
                                       : std::string("; indexer fma"));
          std::printf("%-9s %-4s %5d %7d | %7.1fus %7.0f %4.0f%% | %6.1fus %6.1fus | %7.1fus | %7.1fus %7.0f %4.0f%% %7.1f "
                      "%4.0f%% | %7.1fus %4.0f%% | %s\n",
                      sh.name, dname.c_str(), B, ctx, t_idx, idx_bytes / t_idx * 1e-3,
                      100.0 * idx_bytes / (t_idx * 1e-6) / copy_bps, t_topk, t_topk_tied, t_pair, t_att, att_bytes / t_att * 1e-3,
                      100.0 * att_bytes / (t_att * 1e-6) / copy_bps, att_flops / t_att * 1e-6,
                      100.0 * att_flops / (t_att * 1e-6) / gemm_flops, step,
                      100.0 * (idx_bytes + att_bytes) / (step * 1e-6) / copy_bps, ran.c_str());
          std::fflush(stdout);
        }
    }
  }
  if (a.prefill > 0) {
    std::printf("times: per call, replayed from a CUDA graph (no launch overhead). TFLOP/s: 2 x index heads x dim "
                "per key scored (the causal half counted once); %%: of the cuBLAS bf16 GEMM rate.\n");
    return 0;
  }
  std::printf("times: per call, replayed from a CUDA graph (no launch overhead), consecutive calls on different "
              "sequences (%s%s). ", a.rotate > 0 ? "--rotate sets" : "8 / batch sets",
              a.one_sequence ? "; a call's tokens all on one sequence, as a prefill's" : "");
  std::printf("indexer GB/s: index-key bytes read; top-k: over the indexer's scores, rows of context + %d as the "
              "model's; tied: over all-equal scores; idx+top-k: the indexer and the top-k timed together, as the model "
              "runs them (the top-k starts while the indexer drains); attention GB/s: selected latent rows gathered; "
              "step: idx+top-k + attention per layer, %%bw of all their bytes. %%mma: of the cuBLAS bf16 GEMM rate.\n",
              int(kScoreSlack));
  return 0;
}

#else

int run_bench_attention(const BenchAttentionArgs&) { fail("bench attention needs a CUDA build (nvcc was not found)"); }

#endif

}  // namespace

Runner add_bench_attention(CLI::App& bench) {
  auto a = std::make_shared<BenchAttentionArgs>();
  CLI::App* cmd = bench.add_subcommand("attention", "Time the sparse-attention kernels at GLM-5 and DeepSeek-V3.2 shapes");
  cmd->add_option("--shapes", a->shapes,
                  "glm5, dsv32 (default both), and one GPU's share under tensor parallelism: glm5-tp2, glm5-tp8, "
                  "dsv32-tp2, dsv32-tp8 (the query heads split, the indexer whole)")
      ->check(CLI::IsMember({"glm5", "dsv32", "glm5-tp2", "glm5-tp8", "dsv32-tp2", "dsv32-tp8"}));
  cmd->add_option("--batch", a->batches, "decode batch sizes");
  cmd->add_option("--context", a->contexts, "context lengths");
  cmd->add_option("--kv", a->dtypes, "cache dtypes: bf16, fp8");
  cmd->add_option("--kernel", a->kernel,
                  "auto (the attention kernel the model takes on this device: the backend selector's choice), mma "
                  "(tensor cores, any GPU), wgmma (the Hopper attention kernel; its indexer is mma) or fma (the "
                  "fallback)")
      ->check(CLI::IsMember({"auto", "mma", "wgmma", "fma"}));
  cmd->add_flag("--dense", a->dense, "attend to every position instead of the top-k");
  cmd->add_option("--splits", a->splits, "attention split-KV blocks per token (0: chosen by the kernel)");
  cmd->add_option("--heads-per-block", a->heads_per_block, "attention heads per block: 16, 32, 64 (0: chosen by the kernel)")
      ->check(CLI::IsMember({0, 16, 32, 64}));
  cmd->add_option("--smem-limit", a->smem_limit,
                  "shared memory per block the attention kernel fits its shape into, in bytes (0: the device's); "
                  "101376 gives the shapes of SM86/SM89/SM12x devices (99 KB), timed with this device's SMs")
      ->check(CLI::Range(0, 1 << 30));
  cmd->add_option("--smem-per-sm", a->smem_per_sm,
                  "shared memory per SM to emulate, in bytes (0: the device's): the mma attention kernel asks for "
                  "more than it uses so that as few of its blocks share an SM as on such a device (102400: SM12x, "
                  "one 99 KB block per SM; 167936: A100)")
      ->check(CLI::Range(0, 1 << 30));
  cmd->add_option("--rotate", a->rotate, "sets of sequences the timed calls cycle through (0: 8 / batch, at least 1)");
  cmd->add_flag("--one-sequence", a->one_sequence,
               "a call's tokens all attend to one sequence's cache (as a prefill's tokens do: their selected rows "
               "overlap and come mostly from L2) instead of one sequence each");
  cmd->add_option("--reps", a->reps, "timed repetitions (best is reported)");
  cmd->add_option("--topk-path", a->topk_path,
                  "the top-k's path: auto (the engine's choice), block (one block per row, its keys in registers: "
                  "rows up to 16K; auto takes it up to 4K), rows (one block per row, reading the row on every pass), "
                  "team (one cooperative launch, where the row's blocks fit on the device), spans (three launches)")
      ->check(CLI::IsMember({"auto", "block", "rows", "team", "spans"}));
  cmd->add_option("--prefill", a->prefill,
                  "instead of the decode table: the indexer's scores for a prefill of this many tokens of one "
                  "sequence ending at each --context, per mma kernel (tokens, qfrag, staged), in TFLOP/s; use "
                  "--batch 1 (the cache is sized by the batches)")
      ->check(CLI::Range(0, 1 << 20));
  cmd->add_option("--topk-threads", a->topk_threads,
                  "threads per block of the top-k's team path and of its block path on rows of up to 4K: 256, 512 "
                  "or 1024 (0: the engine's choice)")
      ->check(CLI::IsMember({0, 256, 512, 1024}));
  return [a] { return run_bench_attention(*a); };
}

}  // namespace sparsemla::app
