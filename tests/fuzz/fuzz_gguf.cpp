// libFuzzer target: any byte string given to the GGUF reader must be accepted or refused with an
// Error, never crash, hang, or allocate by an unchecked length. Accepted files also go through
// `inspect`'s report (hyperparameters, tokenizer) and the dequantization of every tensor's first row.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <string>
#include <vector>

#include "gguf/quants.h"
#include "gguf/reader.h"
#include "model/describe.h"
#include "util/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const int fd = memfd_create("fuzz.gguf", 0);
  if (fd < 0) return 0;
  if (size > 0 && write(fd, data, size) != ssize_t(size)) {
    close(fd);
    return 0;
  }
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  try {
    auto f = sparsemla::gguf::File::open(path);
    sparsemla::model::describe(*f, {.list_tensors = true});
    std::vector<float> row;
    for (const auto& t : f->tensors()) {
      if (!sparsemla::gguf::traits(t.type).dequantizable || t.ne[0] > 4096) continue;
      row.resize(size_t(t.ne[0]));
      sparsemla::gguf::dequantize_row(t.type, t.data, row.data(), t.ne[0]);
    }
  } catch (const sparsemla::Error&) {
  }
  close(fd);
  return 0;
}
