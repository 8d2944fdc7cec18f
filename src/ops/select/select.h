// Backend selection: every implementation of an attention-side operation declares what it supports
// (architectures, head counts and dims, cache dtype, sparse or dense); for a model and a device the
// selector takes the best supported one and keeps, for every candidate, why it was taken or refused.
// There is always a candidate: the CPU reference accepts everything, and an unknown GPU gets the
// generic kernels with a warning rather than a refusal.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace sparsemla::model {
struct HParams;
}

namespace sparsemla::ops {

struct DeviceInfo;

// What the model asks of the attention path on one device (per GPU under tensor parallelism).
struct AttentionProblem {
  bool cuda = false;  // a CUDA device is present and this build has CUDA
  std::string device_name = "CPU";
  int cc_major = 0, cc_minor = 0;
  uint64_t smem_optin = 0;
  uint64_t smem_per_sm = 0;
  int heads = 0;      // query heads on this device
  int kv_lora = 0, rope = 0;
  int idx_heads = 0, idx_dim = 0;  // 0 without an indexer
  bool sparse = true;
  bool fp8_cache = false;          // fp8 latent rows and index keys, else bf16 (fp32 on the CPU)
  bool f32_cache = false;          // fp32 rows on the GPU (the reference format: FMA kernels only)
  bool sm90a_code = false;         // this build carries sm_90a machine code (the Hopper wgmma kernel)
};

AttentionProblem attention_problem(const model::HParams& hp, const DeviceInfo* dev, bool sparse, bool fp8_cache,
                                   int tensor_parallel = 1);
// The same from the attention's own dimensions (idx_heads 0: no indexer), for kernels benchmarked
// without a model.
AttentionProblem attention_problem(const DeviceInfo* dev, int heads, int kv_lora, int rope, int idx_heads, int idx_dim,
                                   bool sparse, bool fp8_cache);

struct Candidate {
  std::string name;
  bool supported = false;
  std::string reason;  // why it is refused, or what it is when supported
  int rank = 0;        // larger is preferred among supported ones
};

struct Selection {
  std::string op;  // "indexer", "top-k", "attention"
  std::string chosen;
  std::vector<Candidate> candidates;
};

struct BackendPlan {
  std::vector<Selection> ops;
  std::vector<std::string> warnings;
  const Selection& get(const std::string& op) const;
};

BackendPlan select_backends(const AttentionProblem& p);

// The table printed by `inspect --backends` and at start-up with --verbose.
std::string format_plan(const AttentionProblem& p, const BackendPlan& plan);

}  // namespace sparsemla::ops
