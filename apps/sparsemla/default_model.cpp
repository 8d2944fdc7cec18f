#include "default_model.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <vector>

#include "util/error.h"

namespace sparsemla::app {

std::string default_model_path() {
  if (const char* env = std::getenv("SPARSEMLA_MODEL"); env && *env) return env;
  namespace fs = std::filesystem;
  const char* kName = "models/tiny-glm5-q8_0.gguf";
  std::vector<fs::path> candidates;
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    candidates.push_back(exe.parent_path() / kName);
    candidates.push_back(exe.parent_path().parent_path() / kName);
  }
  candidates.push_back(fs::path(SPARSEMLA_SOURCE_DIR) / kName);
  std::string searched;
  for (const auto& c : candidates) {
    if (fs::exists(c)) return c.string();
    searched += " " + c.string();
  }
  fail("no --model given and the bundled model was not found (searched:{}; or set SPARSEMLA_MODEL)", searched);
}

}  // namespace sparsemla::app
