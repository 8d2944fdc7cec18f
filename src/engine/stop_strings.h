// Stop strings over streamed text: text is released as it is generated, except a tail that could be
// the start of a stop string, so that no part of a stop string is ever sent to the client; when one
// appears (possibly across several tokens), the text ends just before it.
#pragma once
#include <string>
#include <string_view>
#include <vector>

namespace sparsemla::engine {

class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops);

  struct Released {
    std::string text;      // safe to send
    bool stopped = false;  // a stop string was found; text ends before it
  };
  Released push(std::string_view text);
  // The held-back tail, at the end of generation (no stop string came).
  std::string flush();

 private:
  std::vector<std::string> stops_;  // non-empty strings
  std::string held_;                // text that may still become a stop string
};

}  // namespace sparsemla::engine
