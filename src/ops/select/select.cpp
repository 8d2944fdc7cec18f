#include "ops/select/select.h"

#include <fmt/format.h>

#include <algorithm>

#include "model/hparams.h"
#include "ops/cuda/attention_smem.h"
#include "ops/device.h"
#include "util/error.h"

namespace sparsemla::ops {
namespace {

// Architectures the fatbinary carries machine code for (CMakeLists.txt); others run its PTX.
bool known_arch(int major, int minor) {
  const int cc = major * 10 + minor;
  for (int k : {80, 86, 87, 89, 90, 100, 103, 110, 120, 121})
    if (cc == k) return true;
  return false;
}

struct Impl {
  const char* op;
  const char* name;
  int rank;
  // "" when supported, else the reason it is refused.
  std::string (*refuse)(const AttentionProblem&);
  const char* what;
  // What it does for this problem on this device, appended to `what` (nullptr: nothing to add).
  std::string (*detail)(const AttentionProblem&) = nullptr;
};

std::string need_cuda(const AttentionProblem& p) {
  if (!p.cuda) return built_with_cuda() ? "no CUDA device" : "this build has no CUDA";
  if (p.cc_major < 8) return fmt::format("compute capability {}.{} < 8.0 (the kernels need Ampere or newer)", p.cc_major, p.cc_minor);
  return "";
}

std::string idx_mma(const AttentionProblem& p) {
  if (auto r = need_cuda(p); !r.empty()) return r;
  if (p.f32_cache) return "takes bf16 or fp8 keys, the cache is f32";
  if (p.idx_dim != 64 && p.idx_dim != 128) return fmt::format("index dim {} is not 64 or 128", p.idx_dim);
  return "";
}
std::string idx_fma(const AttentionProblem& p) {
  if (auto r = need_cuda(p); !r.empty()) return r;
  if (p.fp8_cache && p.idx_dim > 128) return fmt::format("fp8 index keys need dim <= 128, got {}", p.idx_dim);
  return "";
}
std::string any(const AttentionProblem&) { return ""; }
std::string attn_mma(const AttentionProblem& p) {
  if (auto r = need_cuda(p); !r.empty()) return r;
  if (p.f32_cache) return "takes bf16 or fp8 latent rows, the cache is f32";
  if (p.kv_lora % 8 || (p.kv_lora + p.rope) % 8)
    return fmt::format("kv_lora {} and kv_lora + rope {} must be multiples of 8", p.kv_lora, p.kv_lora + p.rope);
  if (p.kv_lora > 512) return fmt::format("kv_lora {} > 512", p.kv_lora);
  const uint64_t smem = cuda::mla_smem::min_bytes(p.kv_lora, p.rope);  // the kernel's smallest variant
  if (p.smem_optin && smem > p.smem_optin)
    return fmt::format("needs {} bytes of shared memory per block, the device allows {}", smem, p.smem_optin);
  return "";
}
// The mma kernel's largest block on this device (large batches; small ones take fewer heads per
// block to cover the SMs), from the byte counts its launch fits with.
std::string attn_mma_detail(const AttentionProblem& p) {
  if (!p.cuda || !p.smem_optin) return "";
  auto fit = [&](auto bytes, int max_stages, int min_stages) {
    const cuda::mla_smem::Fit f = cuda::mla_smem::fit(4, max_stages, min_stages, p.smem_optin, bytes);
    return fmt::format("{} heads per block, {} tile{} in flight", f.hg * 16, f.stages, f.stages > 1 ? "s" : "");
  };
  const int stride = cuda::mla_smem::stride(p.kv_lora, p.rope);
  // Small batches: two sets of warps per head group where 16 heads with two tiles hold them.
  const int64_t row_bytes = p.fp8_cache ? cuda::mla_smem::fp8_latent_row_bytes(p.kv_lora, p.rope)
                                        : 2 * int64_t(p.kv_lora + p.rope);
  const std::string tile_pairs =
      cuda::mla_smem::tile_pairs_hold(1, p.fp8_cache, p.kv_lora, p.rope, row_bytes, p.smem_optin)
          ? "; small batches: two sets of warps per 16 heads taking alternate tiles (tile pairs)"
          : "";
  if (p.fp8_cache && p.kv_lora == 512 && p.rope == 64 &&
      cuda::mla_smem::fp8_rows_bytes(1, 2) <= p.smem_optin)
    return "; fp8 rows read as stored and widened in registers; on this device " +
           (cuda::mla_smem::fp8_rows_two_per_sm(p.smem_per_sm)
                ? std::string("32 heads per block, 2 tiles in flight, two blocks per SM")
                : "up to " + fit([](int hg, int st) { return cuda::mla_smem::fp8_rows_bytes(hg, st); }, 3, 2)) +
           " (under 8 or 64 tokens the bf16-tile kernel where it keeps two tiles" + tile_pairs + ")";
  if (p.fp8_cache) return "; fp8 rows widened into bf16 tiles" + tile_pairs;
  return "; on this device up to " +
         fit([&](int hg, int st) { return cuda::mla_smem::bytes(hg, st, false, stride, 2 * int64_t(p.kv_lora + p.rope)); },
             2, 1) +
         tile_pairs;
}
std::string attn_wgmma(const AttentionProblem& p) {
  if (auto r = need_cuda(p); !r.empty()) return r;
  if (p.cc_major != 9 || p.cc_minor != 0)
    return fmt::format("compute capability {}.{} is not 9.0 (wgmma is Hopper's alone)", p.cc_major, p.cc_minor);
  if (!p.sm90a_code) return "this build has no sm_90a machine code (90 is not in CMAKE_CUDA_ARCHITECTURES)";
  if (p.f32_cache) return "takes bf16 or fp8 latent rows, the cache is f32";
  if (p.kv_lora != 512 || p.rope != 64) return fmt::format("latent {} + rope {} is not 512 + 64", p.kv_lora, p.rope);
  // 8-32 heads (tensor-parallel shares of GLM-5 and DeepSeek-V3.2) were timed padded to a block of 64
  // (PERFORMANCE.md, session 49); fewer were not, and would leave more than 7/8 of each block idle.
  if (p.heads < 8)
    return fmt::format("{} heads is fewer than 8 (a block computes 64 heads; fewer go to cuda-mma)", p.heads);
  if (p.smem_optin && cuda::mla_smem::kWgmmaBytes > p.smem_optin)
    return fmt::format("needs {} bytes of shared memory per block, the device allows {}", cuda::mla_smem::kWgmmaBytes,
                       p.smem_optin);
  return "";
}
std::string attn_fma(const AttentionProblem& p) {
  if (auto r = need_cuda(p); !r.empty()) return r;
  if (p.kv_lora > 1024) return fmt::format("kv_lora {} > 1024", p.kv_lora);
  return "";
}

const Impl kImpls[] = {
    {"indexer", "cuda-mma", 3, idx_mma, "tensor cores (mma.sync bf16, fp8 keys widened to fp16); the queries held in registers for bf16 keys of up to 64 heads and fp8 keys of up to 32, else both from shared memory"},
    {"indexer", "cuda-fma", 2, idx_fma, "one warp per key, any head count and dim"},
    {"indexer", "cpu", 1, any, "CPU reference (fp32 keys)"},
    {"top-k", "cuda-radix", 3, need_cuda,
     "radix select, lowest index on ties; rows up to 4K: one block each, keys in registers; a few longer rows: one "
     "launch whose blocks meet at barriers, more: three launches over many blocks per row"},
    {"top-k", "cpu", 1, any, "CPU partial sort"},
    {"attention", "cuda-wgmma-sm90", 4, attn_wgmma,
     "Hopper wgmma (bf16, operands in shared memory), 64 heads and 64 rows per step (8 heads or more; fewer "
     "than 64, as one GPU's share under tensor parallelism, pad a block of 64), fp8 rows widened by a "
     "producer warpgroup, split-KV; small batches go to cuda-mma"},
    {"attention", "cuda-mma", 3, attn_mma,
     "tensor cores (mma.sync), 16, 32 or 64 heads per block by batch and shared memory, split-KV", attn_mma_detail},
    {"attention", "cuda-fma", 2, attn_fma, "one block per token and head, any shape"},
    {"attention", "cpu", 1, any, "CPU reference (fp32 latent rows)"},
};

}  // namespace

AttentionProblem attention_problem(const DeviceInfo* dev, int heads, int kv_lora, int rope, int idx_heads, int idx_dim,
                                   bool sparse, bool fp8_cache) {
  AttentionProblem p;
  if (dev) {
    p.cuda = true;
    p.device_name = dev->name;
    p.cc_major = dev->cc_major;
    p.cc_minor = dev->cc_minor;
    p.smem_optin = dev->smem_per_block_optin;
    p.smem_per_sm = dev->smem_per_sm;
  }
  p.heads = heads;
  p.kv_lora = kv_lora;
  p.rope = rope;
  p.idx_heads = idx_heads;
  p.idx_dim = idx_heads > 0 ? idx_dim : 0;
  p.sparse = sparse && idx_heads > 0;
  p.fp8_cache = fp8_cache;
#if SPARSEMLA_HAVE_SM90A
  p.sm90a_code = true;
#endif
  return p;
}

AttentionProblem attention_problem(const model::HParams& hp, const DeviceInfo* dev, bool sparse, bool fp8_cache,
                                   int tensor_parallel) {
  const bool idx = hp.has_indexer();
  return attention_problem(dev, int(hp.n_head) / std::max(1, tensor_parallel), int(hp.kv_lora_rank), int(hp.qk_rope),
                           idx ? int(hp.idx_heads) : 0, idx ? int(hp.idx_dim) : 0, sparse, fp8_cache);
}

const Selection& BackendPlan::get(const std::string& op) const {
  for (const Selection& s : ops)
    if (s.op == op) return s;
  fail("backend plan has no operation '{}'", op);
}

BackendPlan select_backends(const AttentionProblem& p) {
  BackendPlan plan;
  if (p.cuda && !known_arch(p.cc_major, p.cc_minor) && p.cc_major >= 8)
    plan.warnings.push_back(fmt::format(
        "{} (compute capability {}.{}) is not an architecture this build has machine code for; the generic "
        "kernels run from PTX (compiled by the driver at first use)",
        p.device_name, p.cc_major, p.cc_minor));
  if (p.cuda && p.cc_major < 8)
    plan.warnings.push_back(fmt::format("{} (compute capability {}.{}) is older than Ampere: attention runs on the CPU",
                                        p.device_name, p.cc_major, p.cc_minor));
  std::vector<std::string> ops = {"attention"};
  if (p.sparse) ops = {"indexer", "top-k", "attention"};
  for (const std::string& op : ops) {
    Selection s;
    s.op = op;
    for (const Impl& impl : kImpls) {
      if (op != impl.op) continue;
      Candidate c;
      c.name = impl.name;
      c.rank = impl.rank;
      const std::string why = impl.refuse(p);
      c.supported = why.empty();
      c.reason = c.supported ? impl.what + (impl.detail ? impl.detail(p) : std::string()) : why;
      s.candidates.push_back(c);
    }
    const Candidate* best = nullptr;
    for (const Candidate& c : s.candidates)
      if (c.supported && (!best || c.rank > best->rank)) best = &c;
    s.chosen = best->name;  // the cpu candidate accepts everything
    plan.ops.push_back(s);
  }
  return plan;
}

std::string format_plan(const AttentionProblem& p, const BackendPlan& plan) {
  std::string out = fmt::format("backends for {}{}: {} heads, latent {} + rope {}, ", p.device_name,
                                p.cuda ? fmt::format(" (compute capability {}.{})", p.cc_major, p.cc_minor) : "",
                                p.heads, p.kv_lora, p.rope);
  out += p.sparse ? fmt::format("sparse (indexer {} heads x {})", p.idx_heads, p.idx_dim) : std::string("dense");
  out += fmt::format(", {} cache\n", p.cuda ? (p.fp8_cache ? "fp8" : p.f32_cache ? "f32" : "bf16") : "fp32 (the CPU cache is always fp32)");
  for (const Selection& s : plan.ops) {
    out += fmt::format("  {}:\n", s.op);
    for (const Candidate& c : s.candidates)
      out += fmt::format("    {} {:<15} {}\n", c.name == s.chosen ? "*" : (c.supported ? "+" : "-"), c.name,
                         c.name == s.chosen ? "chosen: " + c.reason
                                            : (c.supported ? "supported, lower rank: " + c.reason : "refused: " + c.reason));
  }
  for (const std::string& w : plan.warnings) out += "  warning: " + w + "\n";
  return out;
}

}  // namespace sparsemla::ops
