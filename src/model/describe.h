// The human-readable report of `sparsemla inspect`: files, architecture and hyperparameters (with
// defaults marked), tokenizer, tensor totals by type, and optionally every tensor.
#pragma once
#include <string>

namespace sparsemla::gguf {
class File;
}

namespace sparsemla::model {

struct DescribeOptions {
  bool list_tensors = false;  // one line per tensor: name, type, shape, file, offset
};

std::string describe(const gguf::File& f, const DescribeOptions& opts = {});

}  // namespace sparsemla::model
