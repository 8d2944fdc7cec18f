// What rank 0 of a multi-process tensor-parallel run tells the other ranks (engine/remote_ranks.h):
// once, in the bootstrap, how to load and run (RankConfig); then before every forward, the step
// (RankStep): the batch with its block tables, the device-sampling parameters, or stop. Plain data
// with a versioned little-endian wire format; decoding checks every length and names what is
// malformed, so a stray or truncated message is an Error, never a misread.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "model/batch.h"

namespace sparsemla::dist {

struct RankConfig {
  // The model every rank must have opened: checked against the worker's own file.
  std::string arch;
  uint64_t file_bytes = 0;
  int64_t n_vocab = 0;
  uint32_t n_layer = 0;
  // How the ranks run (rank 0's command line decides for all).
  bool cuda = false;
  bool host_staged = false;  // GPU collectives through the TCP star instead of NCCL
  uint8_t kv_dtype = 0;      // cuda::KvDtype
  bool precise = false;
  bool dense_attention = false;
  bool cuda_graphs = true;
  bool int8_activations = false;
  bool q8_two_level = true;  // model::GpuModelOptions::q8_two_level
  int32_t kv_blocks = 0, block_size = 0;
  int64_t batch_tokens = 0;
  int32_t threads = 0;  // CPU threads per rank (0: all of the worker's)
  std::vector<uint8_t> nccl_id;  // NCCL's unique id (GPU over NCCL), else empty
};

std::vector<uint8_t> encode(const RankConfig& c);
RankConfig decode_config(std::span<const uint8_t> bytes);

// One sequence of a step, owning its block table (model::SeqInput points at one).
struct StepSeq {
  std::vector<int32_t> tokens;
  int64_t pos0 = 0;
  std::vector<int32_t> block_table;
  bool all_logits = false;
};

// ops/cuda/sampling.h's RowSampling, field by field (that header is the GPU build's).
struct StepSampling {
  float temperature = 1.0f, top_p = 1.0f;
  int32_t top_k = 0;
  float min_p = 0.0f;
  uint64_t seed = 0, step = 0;
};

struct RankStep {
  enum class Kind : uint32_t { Forward = 1, Sample = 2, AllReduceTiming = 3, Stop = 4 };
  Kind kind = Kind::Stop;
  std::vector<StepSeq> seqs;          // Forward, Sample
  std::vector<StepSampling> rows;     // Sample: one per logits row
  int64_t n = 0;                      // AllReduceTiming: values per all-reduce

  static RankStep of(Kind kind, const std::vector<model::SeqInput>& batch);
  // SeqInputs pointing at this step's block tables (valid while the step lives).
  std::vector<model::SeqInput> inputs() const;
};

std::vector<uint8_t> encode(const RankStep& s);
RankStep decode_step(std::span<const uint8_t> bytes);

}  // namespace sparsemla::dist
