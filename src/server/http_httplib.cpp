// HttpServer on cpp-httplib (Debian's build: a compiled library whose feature macros come from
// pkg-config, which is why only this file includes httplib.h).
#include <httplib.h>

#include <atomic>
#include <cctype>
#include <mutex>
#include <thread>

#include "server/http.h"

namespace sparsemla::server {
namespace {

// How much of a body over the limit is read and thrown away before the connection is closed.
constexpr size_t kMaxDiscard = 64 << 20;

std::string lower(std::string s) {
  for (char& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

HttpRequest convert(const httplib::Request& req) {
  HttpRequest r;
  r.method = req.method;
  r.path = req.path;
  for (const auto& [k, v] : req.headers) r.headers[lower(k)] = v;
  return r;
}

class SinkWriter : public ResponseWriter {
 public:
  explicit SinkWriter(httplib::DataSink& sink) : sink_(sink) {}
  bool write(const std::string& data) override { return ok_ = ok_ && sink_.write(data.data(), data.size()); }
  bool alive() override { return ok_ = ok_ && sink_.is_writable(); }
  bool ok() const { return ok_; }

 private:
  httplib::DataSink& sink_;
  bool ok_ = true;
};

void apply(const HttpResponse& from, httplib::Response& to) {
  to.status = from.status;
  for (const auto& [k, v] : from.headers) to.set_header(k, v);
  if (!from.stream) {
    to.set_content(from.body, from.content_type);
    return;
  }
  auto stream = from.stream;
  to.set_chunked_content_provider(from.content_type, [stream](size_t, httplib::DataSink& sink) {
    SinkWriter w(sink);
    stream(w);
    if (w.ok()) sink.done();
    return w.ok();
  });
}

class HttplibServer : public HttpServer {
 public:
  explicit HttplibServer(const HttpOptions& opt) : opt_(opt) {
    const size_t threads = size_t(std::max(opt.threads, 2));
    srv_.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
    srv_.set_payload_max_length(opt.max_body_bytes);
    srv_.set_error_handler(
        httplib::Server::HandlerWithResponse([this](const httplib::Request&, httplib::Response& res) {
          if (!res.body.empty() || !error_body_) return httplib::Server::HandlerResponse::Unhandled;
          res.set_content(error_body_(res.status), "application/json");
          return httplib::Server::HandlerResponse::Handled;
        }));
    srv_.set_post_routing_handler([this](const httplib::Request&, httplib::Response& res) {
      if (observe_) observe_(res.status);
    });
  }

  void route(const std::string& method, const std::string& path, Handler handler) override {
    if (method == "GET") {
      srv_.Get(path,
               [handler](const httplib::Request& req, httplib::Response& res) { apply(handler(convert(req)), res); });
      return;
    }
    // POST bodies are read here, so that a chunked body is held to the limit too.
    const size_t limit = opt_.max_body_bytes;
    srv_.Post(path, [handler, limit](const httplib::Request& req, httplib::Response& res,
                                     const httplib::ContentReader& reader) {
      HttpRequest r = convert(req);
      bool too_large = false;
      size_t discarded = 0;
      const bool read = reader([&](const char* data, size_t n) {
        if (!too_large && r.body.size() + n <= limit) {
          r.body.append(data, n);
          return true;
        }
        if (!too_large) {
          too_large = true;
          std::string().swap(r.body);
        }
        // Read on, up to a bound, so that a client still sending gets the 413 rather than a reset.
        discarded += n;
        return discarded <= kMaxDiscard;
      });
      if (too_large || (!read && res.status == 413)) {
        r.body_too_large = true;
        r.body.clear();
        if (!read) res.set_header("Connection", "close");  // the rest of the body was not read
      } else if (!read) {
        res.status = 400;
        res.set_header("Connection", "close");
        return;
      }
      apply(handler(r), res);
    });
  }

  void error_body(std::function<std::string(int)> make) override { error_body_ = std::move(make); }
  void observe(std::function<void(int)> fn) override { observe_ = std::move(fn); }

  int bind(const std::string& host, int port) override {
    if (port == 0) return srv_.bind_to_any_port(host);
    return srv_.bind_to_port(host, port) ? port : -1;
  }

  void serve() override {
    {
      std::lock_guard lk(mu_);
      if (stopped_) return;
      serving_ = true;
    }
    srv_.listen_after_bind();
    serving_ = false;
  }

  void stop() override {
    {
      std::lock_guard lk(mu_);
      stopped_ = true;
    }
    // httplib ignores a stop() that comes before listen_after_bind() is running.
    while (serving_ && !srv_.is_running()) std::this_thread::yield();
    srv_.stop();
  }

 private:
  HttpOptions opt_;
  httplib::Server srv_;
  std::function<std::string(int)> error_body_;
  std::function<void(int)> observe_;
  std::mutex mu_;
  bool stopped_ = false;
  std::atomic<bool> serving_{false};
};

}  // namespace

std::unique_ptr<HttpServer> make_http_server(const HttpOptions& options) {
  return std::make_unique<HttplibServer>(options);
}

}  // namespace sparsemla::server
