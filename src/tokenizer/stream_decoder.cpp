// StreamDecoder (declared in tokenizer.h): incremental decoding that never cuts a UTF-8 character.
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace sparsemla::tokenizer {

std::string StreamDecoder::push(int32_t id) {
  const std::string& bytes = tok_.token_bytes(id);
  if (skip_special_ && tok_.is_special(id)) return {};
  pending_ += bytes;
  std::string out;
  pending_.erase(0, utf8::append_complete(out, pending_));
  return out;
}

std::string StreamDecoder::flush() {
  std::string out;
  utf8::append_lossy(out, pending_);
  pending_.clear();
  return out;
}

}  // namespace sparsemla::tokenizer
