#include "server/auth.h"

#include <algorithm>
#include <cctype>

#include "server/api_error.h"

namespace sparsemla::server {

bool keys_equal(const std::string& given, const std::string& key) {
  // Every byte of the key is compared, whatever was found before; volatile keeps the compiler from
  // ending the loop early.
  volatile unsigned char diff = given.size() != key.size();
  for (size_t i = 0; i < key.size(); ++i) diff = diff | (unsigned char)(key[i] ^ (i < given.size() ? given[i] : 0));
  return diff == 0;
}

void check_api_key(const HttpRequest& req, const std::string& key) {
  const std::string auth = req.header("authorization");
  static const std::string kBearer = "bearer ";
  if (auth.size() < kBearer.size() ||
      !std::equal(kBearer.begin(), kBearer.end(), auth.begin(), [](char a, char b) { return a == std::tolower(b); }))
    throw ApiError(401, "no API key: send 'Authorization: Bearer <key>'", {}, "invalid_api_key");
  if (!keys_equal(auth.substr(kBearer.size()), key)) throw ApiError(401, "incorrect API key", {}, "invalid_api_key");
}

}  // namespace sparsemla::server
