// API keys: "Authorization: Bearer <key>", compared in time that does not depend on how much of a
// guess is right.
#pragma once
#include <string>

#include "server/http.h"

namespace sparsemla::server {

// Whether `given` equals `key`; the time taken depends only on the length of `key`.
bool keys_equal(const std::string& given, const std::string& key);
// Throws ApiError 401 unless the request carries `key`.
void check_api_key(const HttpRequest& req, const std::string& key);

}  // namespace sparsemla::server
