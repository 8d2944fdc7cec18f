#include "model/cost.h"

#include <cstdlib>
#include <string>

#include "gguf/reader.h"
#include "model/hparams.h"

namespace sparsemla::model {

TokenCost token_cost(const gguf::File& f, const HParams& hp) {
  TokenCost c;
  for (const auto& t : f.tensors()) {
    const std::string& n = t.name;
    if (n.rfind("blk.", 0) == 0 && std::strtoul(n.c_str() + 4, nullptr, 10) >= hp.n_layer) continue;  // next-n
    uint64_t bytes = t.nbytes, elems = uint64_t(t.n_elements());
    if (n == "token_embd.weight") {
      c.weight_bytes += t.row_bytes();
      continue;
    }
    if (n.find("_exps.") != std::string::npos && hp.n_expert > 0) {
      bytes = bytes / hp.n_expert * hp.n_expert_used;
      elems = elems / hp.n_expert * hp.n_expert_used;
    }
    c.weight_bytes += bytes;
    if (t.n_dims >= 2) c.flops += 2 * elems;
  }
  return c;
}

}  // namespace sparsemla::model
