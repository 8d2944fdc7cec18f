// Helpers shared by the unit tests: paths to data, temporary folders.
#pragma once
#include <cstdint>
#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>

#include "util/error.h"

namespace sparsemla::test {

inline std::string data_path(const std::string& rel) { return std::string(SPARSEMLA_TEST_DATA) + "/" + rel; }
// $SPARSEMLA_FIXTURES_DIR when set (tests run from a copy of the tree elsewhere, as on a GPU
// machine), else the fixtures of the source tree the tests were built from.
inline std::string fixture_path(const std::string& rel) {
  const char* dir = std::getenv("SPARSEMLA_FIXTURES_DIR");
  return std::string(dir && *dir ? dir : SPARSEMLA_FIXTURES) + "/" + rel;
}
// n draws of N(mean, sd^2) from a generator seeded with `seed`: the same values on every run.
inline std::vector<float> randn(size_t n, uint32_t seed, float sd = 1.0f, float mean = 0.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(mean, sd);
  std::vector<float> v(n);
  for (float& x : v) x = nd(rng);
  return v;
}

// A fixture's model: llama.cpp's converter named its output model-f32.gguf, the project's own
// fixtures are model.gguf.
inline std::string fixture_model_path(const std::string& name) {
  const std::string converted = fixture_path(name + "/model-f32.gguf");
  return std::filesystem::exists(converted) ? converted : fixture_path(name + "/model.gguf");
}
// The model bundled in the repository (models/), found from the fixtures directory.
inline std::string bundled_model_path() { return fixture_path("../../models/tiny-glm5-q8_0.gguf"); }
// The sparsemla binary: $SPARSEMLA_BINARY_PATH when set, else the one built with the tests.
inline std::string binary_path() {
  const char* bin = std::getenv("SPARSEMLA_BINARY_PATH");
  return bin && *bin ? std::string(bin) : std::string(SPARSEMLA_BINARY);
}

// Runs the sparsemla binary with `args` (stderr folded into the output), as a user would.
struct CliResult {
  int status;  // exit status, -1 when killed by a signal
  std::string out;
};
inline CliResult run_cli(const std::string& args) {
  const std::string cmd = binary_path() + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  if (!p) return {-1, "popen failed"};
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int st = pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, out};
}

// A whole file as raw bytes, or as little-endian values of T (int32 token ids, float32 logits).
inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}
template <class T>
std::vector<T> read_values(const std::string& path) {
  const std::string bytes = read_file(path);
  std::vector<T> v(bytes.size() / sizeof(T));
  std::copy_n(bytes.data(), v.size() * sizeof(T), reinterpret_cast<char*>(v.data()));
  return v;
}

// The message of the sparsemla::Error that fn throws, or "(no error)".
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

inline int32_t argmax(const float* x, int64_t n) {
  int64_t b = 0;
  for (int64_t i = 1; i < n; ++i)
    if (x[i] > x[b]) b = i;
  return int32_t(b);
}

// A fresh folder under the system temp dir, removed when the object goes away.
class TempDir {
 public:
  explicit TempDir(const std::string& tag) {
    path_ = std::filesystem::temp_directory_path() /
            ("sparsemla-" + tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter()++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  const std::filesystem::path& path() const { return path_; }

 private:
  static int& counter() {
    static int c = 0;
    return c;
  }
  std::filesystem::path path_;
};

}  // namespace sparsemla::test
