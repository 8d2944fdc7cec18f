// The chat page served at /: one HTML file with its script, no outside resources.
#pragma once
#include <string_view>

namespace sparsemla::server {

extern const std::string_view kChatPage;

}  // namespace sparsemla::server
