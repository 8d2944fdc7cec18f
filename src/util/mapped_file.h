// A read-only regular file: bounded positional reads (counted) and a lazy whole-file mapping.
#pragma once
#include <cstdint>
#include <string>

namespace sparsemla {

class MappedFile {
 public:
  // Opens a regular file for reading; Error for a missing file, a directory, a FIFO or a device.
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::string& path() const { return path_; }
  uint64_t size() const { return size_; }
  // Reads exactly `n` bytes at `offset`; Error naming the file when the file is shorter.
  void read_at(uint64_t offset, void* dst, uint64_t n);
  uint64_t bytes_read() const { return bytes_read_; }
  // Maps the whole file read-only. Mapping reads nothing; pages come in when touched.
  const uint8_t* map();

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
  uint64_t bytes_read_ = 0;
  void* map_ = nullptr;
};

}  // namespace sparsemla
