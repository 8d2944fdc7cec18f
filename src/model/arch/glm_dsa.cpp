// GLM-5 (glm-dsa): MLA + DSA indexer + MoE. In GGUF files both the main attention and the indexer
// use interleaved RoPE pairs (llama.cpp's converter permutes the checkpoint's rotate-half rows).
// GLM-5.2 adds IndexShare: layers marked "shared" in attention.indexer.types have no indexer and
// reuse the previous full layer's selection.
#include "model/arch/arch.h"

namespace sparsemla::model {

const ArchSpec& glm_dsa_spec() {
  static const ArchSpec spec{Arch::GlmDsa, "glm-dsa", ops::RopeStyle::Interleaved, ops::RopeStyle::Interleaved,
                             true, true};
  return spec;
}

const ArchSpec& arch_spec(Arch a) {
  switch (a) {
    case Arch::GlmDsa: return glm_dsa_spec();
    case Arch::DeepSeek32: return deepseek32_spec();
    case Arch::DeepSeek2: return deepseek2_spec();
  }
  return glm_dsa_spec();
}

}  // namespace sparsemla::model
