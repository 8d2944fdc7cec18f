// DeepSeek-V3.2 (deepseek32): MLA + DSA indexer + MoE with group-limited routing and YaRN. The
// main attention's RoPE is interleaved; the indexer's is NOT (half split), as in DeepSeek's code.
#include "model/arch/arch.h"

namespace sparsemla::model {

const ArchSpec& deepseek32_spec() {
  static const ArchSpec spec{Arch::DeepSeek32, "deepseek32", ops::RopeStyle::Interleaved,
                             ops::RopeStyle::HalfSplit, true, false};
  return spec;
}

}  // namespace sparsemla::model
