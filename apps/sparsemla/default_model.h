// The model `run` and `serve` use when no --model is given: the small model bundled in models/.
#pragma once
#include <string>

namespace sparsemla::app {

// $SPARSEMLA_MODEL, else models/tiny-glm5-q8_0.gguf next to the binary (build/../models) or in the
// source tree this binary was built from. Error naming the places searched when none exists.
std::string default_model_path();

}  // namespace sparsemla::app
