// Errors as the OpenAI API reports them: an HTTP status and
// {"error": {"message", "type", "param", "code"}}.
#pragma once
#include <nlohmann/json.hpp>
#include <string>

#include "util/error.h"

namespace sparsemla::server {

class ApiError : public Error {
 public:
  ApiError(int status, std::string message, std::string param = {}, std::string code = {})
      : Error(message), status(status), param(std::move(param)), code(std::move(code)) {}
  int status;
  std::string param;  // the request field at fault, if one is
  std::string code;   // a machine-readable reason, if there is one
};

// "invalid_request_error" for 4xx, "authentication_error" for 401, "server_error" for 5xx.
std::string error_type(int status);
nlohmann::json error_object(int status, const std::string& message, const std::string& param = {},
                            const std::string& code = {});

// A 400 naming the field.
template <class... Args>
[[noreturn]] void invalid(const std::string& param, fmt::format_string<Args...> f, Args&&... args) {
  throw ApiError(400, fmt::format(f, std::forward<Args>(args)...), param);
}

}  // namespace sparsemla::server
