// What differs between the architectures of the family; each arch's file fills one ArchSpec.
#pragma once
#include "model/hparams.h"
#include "ops/cpu/rope.h"

namespace sparsemla::model {

struct ArchSpec {
  Arch arch;
  const char* name;
  ops::RopeStyle main_rope;     // q_pe / k_pe of the main attention
  ops::RopeStyle indexer_rope;  // the indexer's q / k rope dims
  bool sparse_attention;        // has the DSA lightning indexer
  bool index_share;             // "shared" layers reuse the previous full layer's top-k
};

const ArchSpec& glm_dsa_spec();
const ArchSpec& deepseek32_spec();
const ArchSpec& deepseek2_spec();
const ArchSpec& arch_spec(Arch a);

}  // namespace sparsemla::model
