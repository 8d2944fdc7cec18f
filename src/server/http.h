// The HTTP layer the server needs, and no more: routes by method and exact path, bodies read with a
// size limit, and responses that are either whole or written piece by piece (SSE) while the client
// is still there. cpp-httplib implements it (http_httplib.cpp); nothing else includes httplib.h.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

namespace sparsemla::server {

struct HttpRequest {
  std::string method;
  std::string path;
  std::map<std::string, std::string> headers;  // names in lower case
  std::string body;
  bool body_too_large = false;  // the body went past the limit and was not read

  std::string header(const std::string& lower_name) const {
    auto it = headers.find(lower_name);
    return it == headers.end() ? std::string() : it->second;
  }
};

// Where a streamed response goes. write() returns false once the client is gone; alive() tells the
// same without writing (a client that closed its connection).
class ResponseWriter {
 public:
  virtual ~ResponseWriter() = default;
  virtual bool write(const std::string& data) = 0;
  virtual bool alive() = 0;
};

struct HttpResponse {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  std::map<std::string, std::string> headers;
  // When set, the body is written by this function (chunked), after status and headers went out.
  std::function<void(ResponseWriter&)> stream;
};

using Handler = std::function<HttpResponse(const HttpRequest&)>;

struct HttpOptions {
  size_t max_body_bytes = 8 << 20;
  int threads = 16;  // connections served at once (each streaming client holds one)
};

class HttpServer {
 public:
  virtual ~HttpServer() = default;
  // GET or POST on an exact path.
  virtual void route(const std::string& method, const std::string& path, Handler handler) = 0;
  // The body of an error the HTTP layer answers by itself: no route (404), a body over the limit
  // (413), a request it could not parse (400).
  virtual void error_body(std::function<std::string(int status)> make) = 0;
  // Called with the status of every response.
  virtual void observe(std::function<void(int status)> fn) = 0;
  // Binds (port 0: any free port) and returns the port; serve() then runs until stop().
  virtual int bind(const std::string& host, int port) = 0;
  virtual void serve() = 0;
  virtual void stop() = 0;
};

std::unique_ptr<HttpServer> make_http_server(const HttpOptions& options);

}  // namespace sparsemla::server
