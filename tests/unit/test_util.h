// Helpers shared by the unit tests: paths to data, temporary folders.
#pragma once
#include <filesystem>
#include <string>

#include <unistd.h>

namespace sparsemla::test {

inline std::string data_path(const std::string& rel) { return std::string(SPARSEMLA_TEST_DATA) + "/" + rel; }
inline std::string fixture_path(const std::string& rel) { return std::string(SPARSEMLA_FIXTURES) + "/" + rel; }

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
