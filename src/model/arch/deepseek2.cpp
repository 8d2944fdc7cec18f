// DeepSeek-V2/V3/R1, Kimi-K2, GLM-4.7-Flash (deepseek2): MLA with dense attention over every
// position, MoE. No indexer.
#include "model/arch/arch.h"

namespace sparsemla::model {

const ArchSpec& deepseek2_spec() {
  static const ArchSpec spec{Arch::DeepSeek2, "deepseek2", ops::RopeStyle::Interleaved,
                             ops::RopeStyle::Interleaved, false, false};
  return spec;
}

}  // namespace sparsemla::model
