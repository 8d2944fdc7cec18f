#include "util/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "util/error.h"

namespace sparsemla {

MappedFile::MappedFile(const std::string& path) : path_(path) {
  // O_NONBLOCK so that opening a FIFO by mistake cannot hang; cleared below for regular files.
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd_ < 0) fail("{}: cannot open: {}", path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd_, &st) != 0) {
    int e = errno;
    ::close(fd_);
    fail("{}: cannot stat: {}", path, std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd_);
    fail("{}: not a regular file", path);
  }
  ::fcntl(fd_, F_SETFL, ::fcntl(fd_, F_GETFL) & ~O_NONBLOCK);
  size_ = uint64_t(st.st_size);
}

MappedFile::~MappedFile() {
  if (map_) ::munmap(map_, size_);
  if (fd_ >= 0) ::close(fd_);
}

void MappedFile::read_at(uint64_t offset, void* dst, uint64_t n) {
  if (offset > size_ || n > size_ - offset)
    fail("{}: truncated: needed {} bytes at offset {}, but the file has {} bytes", path_, n, offset, size_);
  auto* out = static_cast<uint8_t*>(dst);
  while (n > 0) {
    ssize_t got = ::pread(fd_, out, n, off_t(offset));
    if (got < 0) {
      if (errno == EINTR) continue;
      fail("{}: read error at offset {}: {}", path_, offset, std::strerror(errno));
    }
    if (got == 0) fail("{}: truncated while reading at offset {} (file shrank?)", path_, offset);
    bytes_read_ += uint64_t(got);
    out += got;
    offset += uint64_t(got);
    n -= uint64_t(got);
  }
}

const uint8_t* MappedFile::map() {
  if (map_) return static_cast<const uint8_t*>(map_);
  if (size_ == 0) return nullptr;
  void* p = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd_, 0);
  if (p == MAP_FAILED) fail("{}: mmap of {} bytes failed: {}", path_, size_, std::strerror(errno));
  map_ = p;
  return static_cast<const uint8_t*>(map_);
}

}  // namespace sparsemla
