#include "server/api_error.h"

namespace sparsemla::server {

std::string error_type(int status) {
  if (status == 401) return "authentication_error";
  if (status == 404) return "not_found_error";
  if (status == 429) return "rate_limit_error";
  if (status >= 500) return status == 503 ? "unavailable_error" : "server_error";
  return "invalid_request_error";
}

nlohmann::json error_object(int status, const std::string& message, const std::string& param, const std::string& code) {
  nlohmann::json e = {{"message", message}, {"type", error_type(status)}, {"param", nullptr}, {"code", nullptr}};
  if (!param.empty()) e["param"] = param;
  if (!code.empty()) e["code"] = code;
  return {{"error", e}};
}

}  // namespace sparsemla::server
