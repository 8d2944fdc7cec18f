#include "dist/tcp_bootstrap.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <system_error>
#include <thread>

#include "util/error.h"

namespace sparsemla::dist {
namespace {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

enum MsgType : uint32_t { kHello = 1, kWelcome = 2, kAbort = 3, kGather = 4, kGathered = 5 };
constexpr uint32_t kMagic = 0x414c4d53;  // "SMLA" in the first four bytes of a hello
constexpr uint32_t kVersion = 1;
constexpr uint32_t kHelloBytes = 16;         // magic, version, rank, world size
constexpr uint32_t kMaxPayload = 64u << 20;  // the blobs are small; a larger length is garbage
// A connection that became readable delivers its hello at once or is taken for a stranger.
constexpr auto kHelloWait = std::chrono::seconds(1);
// Telling the peers why rank 0 gives up is best effort, and brief.
constexpr auto kAbortWait = std::chrono::milliseconds(200);

std::string errno_text(int err) { return std::system_category().message(err); }

// Milliseconds to `d` for poll(), rounded up (so a wait never spins), 0 once it has passed.
int ms_left(Deadline d) {
  if (d == Deadline::max()) return -1;  // no deadline: poll() waits until the socket is ready
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(d - Clock::now()).count();
  return int(std::clamp<int64_t>(left, 0, 1 << 30));
}

void put_u32(std::vector<uint8_t>& b, uint32_t v) {
  for (int i = 0; i < 4; ++i) b.push_back(uint8_t(v >> (8 * i)));
}
void put_u64(std::vector<uint8_t>& b, uint64_t v) {
  for (int i = 0; i < 8; ++i) b.push_back(uint8_t(v >> (8 * i)));
}
void put_bytes(std::vector<uint8_t>& b, std::span<const uint8_t> s) { b.insert(b.end(), s.begin(), s.end()); }

// Reads little-endian fields off a payload; ok() turns false at the first read past the end.
class Reader {
 public:
  explicit Reader(std::span<const uint8_t> s) : s_(s) {}
  uint32_t u32() { return uint32_t(take(4)); }
  uint64_t u64() { return take(8); }
  std::vector<uint8_t> bytes(size_t n) {
    if (n > s_.size() - pos_) {
      ok_ = false;
      return {};
    }
    std::vector<uint8_t> v(s_.begin() + ptrdiff_t(pos_), s_.begin() + ptrdiff_t(pos_ + n));
    pos_ += n;
    return v;
  }
  std::vector<uint8_t> rest() { return bytes(s_.size() - pos_); }
  bool ok() const { return ok_; }
  bool at_end() const { return pos_ == s_.size(); }

 private:
  uint64_t take(size_t n) {
    if (n > s_.size() - pos_) {
      ok_ = false;
      return 0;
    }
    uint64_t v = 0;
    for (size_t i = 0; i < n; ++i) v |= uint64_t(s_[pos_ + i]) << (8 * i);
    pos_ += n;
    return v;
  }
  std::span<const uint8_t> s_;
  size_t pos_ = 0;
  bool ok_ = true;
};

// The I/O helpers return "" on success, else what went wrong, for the caller to put in context.
// Sockets are non-blocking; every wait is a poll() bounded by the deadline.
const std::string kTimedOut = "timed out";
const std::string kClosed = "the connection was closed";

std::string send_all(int fd, const uint8_t* p, size_t n, Deadline d) {
  while (n > 0) {
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k > 0) {
      p += k;
      n -= size_t(k);
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
      return errno == EPIPE || errno == ECONNRESET ? kClosed : "send: " + errno_text(errno);
    pollfd pfd{fd, POLLOUT, 0};
    const int rc = ::poll(&pfd, 1, ms_left(d));
    if (rc == 0) return kTimedOut;
    if (rc < 0 && errno != EINTR) return "poll: " + errno_text(errno);
  }
  return "";
}

std::string recv_all(int fd, uint8_t* p, size_t n, Deadline d) {
  while (n > 0) {
    const ssize_t k = ::recv(fd, p, n, 0);
    if (k > 0) {
      p += k;
      n -= size_t(k);
      continue;
    }
    if (k == 0) return kClosed;
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK)
      return errno == ECONNRESET ? kClosed : "recv: " + errno_text(errno);
    pollfd pfd{fd, POLLIN, 0};
    const int rc = ::poll(&pfd, 1, ms_left(d));
    if (rc == 0) return kTimedOut;
    if (rc < 0 && errno != EINTR) return "poll: " + errno_text(errno);
  }
  return "";
}

struct Message {
  uint32_t type = 0;
  std::vector<uint8_t> payload;
};

std::string send_msg(int fd, uint32_t type, std::span<const uint8_t> payload, Deadline d) {
  std::vector<uint8_t> b;
  b.reserve(8 + payload.size());
  put_u32(b, type);
  put_u32(b, uint32_t(payload.size()));
  put_bytes(b, payload);
  return send_all(fd, b.data(), b.size(), d);
}

std::string send_text(int fd, uint32_t type, const std::string& text, Deadline d) {
  return send_msg(fd, type, {reinterpret_cast<const uint8_t*>(text.data()), text.size()}, d);
}

// max_payload: a longer announced payload is an error (garbage, or not our protocol).
std::string recv_msg(int fd, Message& m, Deadline d, uint32_t max_payload = kMaxPayload) {
  uint8_t head[8];
  if (std::string err = recv_all(fd, head, 8, d); !err.empty()) return err;
  Reader r({head, 8});
  m.type = r.u32();
  const uint32_t n = r.u32();
  if (n > max_payload) return fmt::format("a message of {} bytes (at most {} expected)", n, max_payload);
  m.payload.resize(n);
  return recv_all(fd, m.payload.data(), n, d);
}

std::string text_of(const std::vector<uint8_t>& b) { return std::string(b.begin(), b.end()); }

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i) s += fmt::format("{}{}", i ? ", " : "", ranks[i]);
  return s;
}

bool is_numeric_ipv4_form(const std::string& host) {
  return !host.empty() &&
         std::all_of(host.begin(), host.end(), [](char c) { return (c >= '0' && c <= '9') || c == '.'; });
}

// getaddrinfo for `hp` (passive: for bind). Throws Error unless the failure is temporary
// (EAI_AGAIN), which returns nullptr and leaves the reason in *temporary.
struct AddrInfoDeleter {
  void operator()(addrinfo* a) const { ::freeaddrinfo(a); }
};
using AddrInfo = std::unique_ptr<addrinfo, AddrInfoDeleter>;

AddrInfo resolve(const HostPort& hp, bool passive, const std::string& context, std::string* temporary) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  if (is_numeric_ipv4_form(hp.host) || hp.host.find(':') != std::string::npos) hints.ai_flags |= AI_NUMERICHOST;
  const std::string port = std::to_string(hp.port);
  addrinfo* res = nullptr;
  const int rc = ::getaddrinfo(hp.host.empty() ? nullptr : hp.host.c_str(), port.c_str(), &hints, &res);
  if (rc == EAI_AGAIN && temporary) {
    *temporary = fmt::format("cannot resolve '{}' yet: {}", hp.host, ::gai_strerror(rc));
    return nullptr;
  }
  if (rc != 0)
    fail("{}: cannot resolve '{}': {}", context, hp.host, rc == EAI_SYSTEM ? errno_text(errno) : ::gai_strerror(rc));
  return AddrInfo(res);
}

void set_nodelay(int fd) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);  // small messages: no Nagle delay
}

// One connection attempt to `a` before `d`: the socket, or an invalid one and the reason in *why.
Socket try_connect(const addrinfo& a, Deadline d, std::string* why) {
  Socket s(::socket(a.ai_family, a.ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a.ai_protocol));
  if (!s.valid()) {
    *why = "socket: " + errno_text(errno);
    return {};
  }
  if (::connect(s.fd(), a.ai_addr, a.ai_addrlen) != 0) {
    if (errno != EINPROGRESS) {
      *why = errno_text(errno);
      return {};
    }
    pollfd pfd{s.fd(), POLLOUT, 0};
    int rc;
    do rc = ::poll(&pfd, 1, ms_left(d));
    while (rc < 0 && errno == EINTR);
    if (rc == 0) {
      *why = "connect timed out";
      return {};
    }
    int err = 0;
    socklen_t len = sizeof err;
    if (rc < 0 || ::getsockopt(s.fd(), SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
    if (err != 0) {
      *why = errno_text(err);
      return {};
    }
  }
  set_nodelay(s.fd());
  return s;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Addresses and sockets

std::string HostPort::str() const {
  return host.find(':') != std::string::npos ? fmt::format("[{}]:{}", host, port) : fmt::format("{}:{}", host, port);
}

HostPort parse_host_port(std::string_view address) {
  const std::string a(address);
  HostPort hp;
  std::string port;
  if (!a.empty() && a[0] == '[') {
    const size_t close = a.find(']');
    if (close == std::string::npos || close + 1 >= a.size() || a[close + 1] != ':')
      fail("address '{}': an IPv6 address is written [address]:port", a);
    hp.host = a.substr(1, close - 1);
    port = a.substr(close + 2);
    in6_addr v6;
    if (::inet_pton(AF_INET6, hp.host.c_str(), &v6) != 1) fail("address '{}': '{}' is not an IPv6 address", a, hp.host);
  } else {
    const size_t colon = a.rfind(':');
    if (colon == std::string::npos) fail("address '{}' has no port: write host:port", a);
    hp.host = a.substr(0, colon);
    port = a.substr(colon + 1);
    if (hp.host.find(':') != std::string::npos)
      fail("address '{}': write an IPv6 address in brackets, [address]:port", a);
    if (hp.host.find_first_of(" \t\r\n/") != std::string::npos)
      fail("address '{}': '{}' is not a host name", a, hp.host);
    in_addr v4;
    if (is_numeric_ipv4_form(hp.host) && ::inet_pton(AF_INET, hp.host.c_str(), &v4) != 1)
      fail("address '{}': '{}' is not an IPv4 address", a, hp.host);
  }
  if (port.empty() || port.size() > 5 ||
      !std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; }) || std::stoi(port) > 65535)
    fail("address '{}': the port must be a number from 0 to 65535, got '{}'", a, port);
  hp.port = uint16_t(std::stoi(port));
  return hp;
}

Socket::~Socket() {
  if (fd_ >= 0) ::close(fd_);
}

Socket& Socket::operator=(Socket&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.fd_;
    o.fd_ = -1;
  }
  return *this;
}

TcpListener::TcpListener(std::string_view address) : where_(parse_host_port(address)) {
  const std::string context = fmt::format("tcp bootstrap: listening on '{}'", address);
  const AddrInfo ai = resolve(where_, /*passive=*/true, context, nullptr);
  std::string why = "no address";
  for (const addrinfo* a = ai.get(); a; a = a->ai_next) {
    Socket s(::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol));
    if (!s.valid()) {
      why = "socket: " + errno_text(errno);
      continue;
    }
    // A restarted rank 0 can take its port back while the old connections sit in TIME_WAIT.
    const int one = 1;
    ::setsockopt(s.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(s.fd(), a->ai_addr, a->ai_addrlen) != 0) {
      why = "bind: " + errno_text(errno);
      continue;
    }
    if (::listen(s.fd(), SOMAXCONN) != 0) {
      why = "listen: " + errno_text(errno);
      continue;
    }
    sockaddr_storage bound{};
    socklen_t len = sizeof bound;
    if (::getsockname(s.fd(), reinterpret_cast<sockaddr*>(&bound), &len) != 0)
      fail("{}: getsockname: {}", context, errno_text(errno));
    port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                              : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    sock_ = std::move(s);
    return;
  }
  fail("{}: {}", context, why);
}

std::string TcpListener::address() const {
  HostPort hp = where_;
  hp.port = port_;
  return hp.str();
}

// ---------------------------------------------------------------------------------------------
// The rendezvous

TcpBootstrap::TcpBootstrap(std::string root, int rank, int size, Ms timeout)
    : root_(std::move(root)), rank_(rank), size_(size), timeout_(timeout) {}

TcpBootstrap::~TcpBootstrap() = default;

std::string TcpBootstrap::where() const { return fmt::format("tcp bootstrap {} (rank {} of {})", root_, rank_, size_); }

void TcpBootstrap::fail_all(const std::string& what) {
  const Deadline d = Clock::now() + kAbortWait;
  for (const Socket& p : peers_)
    if (p.valid()) send_text(p.fd(), kAbort, what, d);
  peers_.clear();
  throw Error(fmt::format("{}: {}", where(), what));
}

TcpBootstrap TcpBootstrap::accept(TcpListener listener, int world_size, std::vector<uint8_t> blob, Ms timeout) {
  TcpBootstrap b(listener.address(), 0, world_size, timeout);
  if (world_size < 1) fail("{}: the world size must be at least 1", b.where());
  if (blob.size() > kMaxPayload - 4)
    fail("{}: a blob of {} bytes is too large (at most {})", b.where(), blob.size(), kMaxPayload - 4);
  b.blob_ = std::move(blob);
  b.peers_.resize(size_t(world_size));
  const Deadline d = Clock::now() + timeout;
  const int lfd = listener.sock_.fd();

  std::vector<Socket> pending;  // accepted, hello not read yet
  int joined = 1;               // rank 0 itself
  int strangers = 0;            // connections that did not speak the protocol, dropped
  while (joined < world_size) {
    // [0] the listener, then the pending connections, then the joined ranks (for disconnects).
    std::vector<pollfd> fds{{lfd, POLLIN, 0}};
    for (const Socket& s : pending) fds.push_back({s.fd(), POLLIN, 0});
    std::vector<int> joined_ranks;
    for (int r = 1; r < world_size; ++r)
      if (b.peers_[size_t(r)].valid()) {
        fds.push_back({b.peers_[size_t(r)].fd(), POLLIN, 0});
        joined_ranks.push_back(r);
      }
    const int rc = ::poll(fds.data(), fds.size(), ms_left(d));
    if (rc < 0 && errno == EINTR) continue;
    if (rc < 0) b.fail_all("poll: " + errno_text(errno));
    if (rc == 0) {
      std::vector<int> missing;
      for (int r = 1; r < world_size; ++r)
        if (!b.peers_[size_t(r)].valid()) missing.push_back(r);
      const std::string dropped =
          strangers ? fmt::format("; dropped {} connection(s) that did not speak the bootstrap protocol", strangers) : "";
      b.fail_all(fmt::format("timed out after {} ms waiting for rank(s) {} to connect ({} of {} ranks joined{})",
                             timeout.count(), rank_list(missing), joined, world_size, dropped));
    }

    // A joined rank must stay quiet until the blob comes: readable means it went away or gave up.
    for (size_t i = 0; i < joined_ranks.size(); ++i) {
      if (!fds[1 + pending.size() + i].revents) continue;
      const int r = joined_ranks[i];
      Message m;
      const std::string err = recv_msg(b.peers_[size_t(r)].fd(), m, Clock::now() + kHelloWait);
      b.peers_[size_t(r)] = Socket();
      if (err.empty() && m.type == kAbort) b.fail_all(fmt::format("rank {} gave up: {}", r, text_of(m.payload)));
      b.fail_all(fmt::format("rank {} disconnected before every rank had joined ({})", r,
                             err.empty() ? "it sent an unexpected message" : err));
    }

    std::vector<Socket> still_pending;
    for (size_t i = 0; i < pending.size(); ++i) {
      Socket& s = pending[i];
      if (!fds[1 + i].revents) {
        still_pending.push_back(std::move(s));
        continue;
      }
      Message m;
      const std::string err = recv_msg(s.fd(), m, std::min(d, Clock::now() + kHelloWait), kHelloBytes);
      Reader r(m.payload);
      if (!err.empty() || m.type != kHello || m.payload.size() != kHelloBytes || r.u32() != kMagic) {
        ++strangers;
        continue;  // not one of ours: dropped
      }
      const uint32_t version = r.u32();
      const int rank = int(r.u32());
      const int world = int(r.u32());
      std::string bad;
      if (version != kVersion)
        bad = fmt::format("rank {} speaks bootstrap protocol version {}, rank 0 speaks {}", rank, version, kVersion);
      else if (world != world_size)
        bad = fmt::format("world size mismatch: rank {} was started with world size {}, rank 0 with {}", rank, world,
                          world_size);
      else if (rank < 1 || rank >= world_size)
        bad = fmt::format("a rank {} connected, but the ranks that connect to rank 0 of a world of {} are 1..{}", rank,
                          world_size, world_size - 1);
      else if (b.peers_[size_t(rank)].valid())
        bad = fmt::format("rank {} connected twice (two processes started with the same rank?)", rank);
      if (!bad.empty()) {
        send_text(s.fd(), kAbort, bad, Clock::now() + kAbortWait);
        b.fail_all(bad);
      }
      b.peers_[size_t(rank)] = std::move(s);
      ++joined;
    }
    pending = std::move(still_pending);

    if (fds[0].revents & POLLIN)
      for (;;) {
        Socket s(::accept4(lfd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
        if (!s.valid()) {
          if (errno == EINTR || errno == ECONNABORTED) continue;
          if (errno == EAGAIN || errno == EWOULDBLOCK) break;
          b.fail_all("accept: " + errno_text(errno));
        }
        set_nodelay(s.fd());
        pending.push_back(std::move(s));
      }
  }

  std::vector<uint8_t> welcome;
  put_u32(welcome, uint32_t(world_size));
  put_bytes(welcome, b.blob_);
  for (int r = 1; r < world_size; ++r)
    if (std::string err = send_msg(b.peers_[size_t(r)].fd(), kWelcome, welcome, d); !err.empty())
      b.fail_all(fmt::format("could not send the blob to rank {}: {}", r, err));
  return b;
}

TcpBootstrap TcpBootstrap::join(std::string_view root_address, int rank, int world_size, Ms timeout) {
  const HostPort hp = parse_host_port(root_address);
  TcpBootstrap b(hp.str(), rank, world_size, timeout);
  if (hp.host.empty() || hp.port == 0) fail("{}: rank 0's address needs a host and a port other than 0", b.where());
  if (world_size < 2 || rank < 1 || rank >= world_size)
    fail("{}: the ranks that join rank 0 are 1..world size-1 (rank 0 accepts instead)", b.where());
  const Deadline d = Clock::now() + timeout;

  // Rank 0 may not be listening yet: retry, backing off, until the deadline.
  std::string why;
  auto backoff = std::chrono::milliseconds(10);
  while (!b.root_sock_.valid()) {
    const AddrInfo ai = resolve(hp, /*passive=*/false, b.where(), &why);
    for (const addrinfo* a = ai.get(); a && !b.root_sock_.valid(); a = a->ai_next)
      b.root_sock_ = try_connect(*a, d, &why);
    if (b.root_sock_.valid()) break;
    if (Clock::now() >= d)
      fail("{}: could not connect to rank 0 within {} ms (last attempt: {})", b.where(), timeout.count(), why);
    std::this_thread::sleep_for(std::min<Clock::duration>(backoff, d - Clock::now()));
    backoff = std::min(backoff * 2, std::chrono::milliseconds(500));
  }

  std::vector<uint8_t> hello;
  put_u32(hello, kMagic);
  put_u32(hello, kVersion);
  put_u32(hello, uint32_t(rank));
  put_u32(hello, uint32_t(world_size));
  if (std::string err = send_msg(b.root_sock_.fd(), kHello, hello, d); !err.empty())
    fail("{}: could not introduce this rank to rank 0: {}", b.where(), err);

  Message m;
  if (std::string err = recv_msg(b.root_sock_.fd(), m, d); err == kTimedOut)
    fail("{}: timed out after {} ms waiting for rank 0 to send the blob (it does once every rank has connected)",
         b.where(), timeout.count());
  else if (!err.empty())
    fail("{}: no blob from rank 0: {}", b.where(), err);
  if (m.type == kAbort) fail("{}: rank 0 gave up: {}", b.where(), text_of(m.payload));
  Reader r(m.payload);
  const int world = int(r.u32());
  b.blob_ = r.rest();
  if (m.type != kWelcome || !r.ok()) fail("{}: rank 0 sent message type {} instead of the blob", b.where(), m.type);
  if (world != world_size)
    fail("{}: world size mismatch: rank 0 was started with world size {}, this rank with {}", b.where(), world,
         world_size);
  return b;
}

std::string TcpBootstrap::lost_peer(Ms wait) const {
  std::vector<pollfd> fds;
  std::vector<int> ranks;
  if (rank_ != 0) {
    if (!root_sock_.valid()) return "rank 0 (its connection is closed)";
    fds.push_back({root_sock_.fd(), POLLIN, 0});
    ranks.push_back(0);
  } else {
    for (size_t r = 1; r < peers_.size(); ++r)
      if (peers_[r].valid()) {
        fds.push_back({peers_[r].fd(), POLLIN, 0});
        ranks.push_back(int(r));
      }
  }
  if (fds.empty()) return "";
  const int rc = ::poll(fds.data(), fds.size(), int(std::clamp<int64_t>(wait.count(), 0, 1 << 30)));
  if (rc <= 0) return "";
  for (size_t i = 0; i < fds.size(); ++i) {
    if (!fds[i].revents) continue;
    if (fds[i].revents & (POLLERR | POLLNVAL)) return fmt::format("rank {}", ranks[i]);
    uint8_t byte = 0;
    const ssize_t k = ::recv(fds[i].fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
    if (k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))
      return fmt::format("rank {}", ranks[i]);
  }
  return "";
}

// ---------------------------------------------------------------------------------------------
// Exchanges over the star: every rank sends its bytes to rank 0, which sends everyone all of them.

std::vector<std::vector<uint8_t>> TcpBootstrap::all_gather(std::span<const uint8_t> mine) {
  return all_gather(mine, timeout_);
}

std::vector<std::vector<uint8_t>> TcpBootstrap::all_gather(std::span<const uint8_t> mine, Ms timeout) {
  const uint64_t seq = exchanges_++;
  const Deadline d = timeout == kForever ? Deadline::max() : Clock::now() + timeout;
  std::vector<std::vector<uint8_t>> all(static_cast<size_t>(size_));
  if (size_ == 1) {
    all[0].assign(mine.begin(), mine.end());
    return all;
  }
  if (mine.size() > kMaxPayload / size_t(size_) - 16)
    fail("{}: exchange #{}: {} bytes per rank is too large for the bootstrap", where(), seq, mine.size());

  if (rank_ != 0) {
    if (!root_sock_.valid())
      fail("{}: exchange #{}: the connection to rank 0 is closed after an earlier failure", where(), seq);
    std::vector<uint8_t> out;
    put_u64(out, seq);
    put_bytes(out, mine);
    Message m;
    std::string err = send_msg(root_sock_.fd(), kGather, out, d);
    if (err.empty()) err = recv_msg(root_sock_.fd(), m, d);
    if (!err.empty()) {
      root_sock_ = Socket();
      fail("{}: exchange #{}: {}", where(), seq,
           err == kTimedOut ? fmt::format("timed out after {} ms waiting for the other ranks", timeout.count())
                              : "lost rank 0: " + err);
    }
    if (m.type == kAbort) {
      root_sock_ = Socket();
      fail("{}: exchange #{}: rank 0 gave up: {}", where(), seq, text_of(m.payload));
    }
    Reader r(m.payload);
    const uint64_t their_seq = r.u64();
    const uint32_t n = r.u32();
    for (uint32_t i = 0; i < n && r.ok() && i < uint32_t(size_); ++i) all[i] = r.bytes(r.u32());
    if (m.type != kGathered || !r.ok() || !r.at_end() || n != uint32_t(size_) || their_seq != seq)
      fail("{}: exchange #{}: rank 0 answered with a malformed message (type {}, exchange #{})", where(), seq, m.type,
           their_seq);
    return all;
  }

  if (peers_.size() != size_t(size_))
    fail("{}: exchange #{}: the connections to the other ranks are closed after an earlier failure", where(), seq);
  all[0].assign(mine.begin(), mine.end());
  std::vector<bool> got(size_t(size_), false);
  got[0] = true;
  int n_got = 1;
  while (n_got < size_) {
    std::vector<pollfd> fds;
    std::vector<int> ranks;
    for (int r = 1; r < size_; ++r)
      if (!got[size_t(r)]) {
        fds.push_back({peers_[size_t(r)].fd(), POLLIN, 0});
        ranks.push_back(r);
      }
    const int rc = ::poll(fds.data(), fds.size(), ms_left(d));
    if (rc < 0 && errno == EINTR) continue;
    if (rc < 0) fail_all(fmt::format("exchange #{}: poll: {}", seq, errno_text(errno)));
    if (rc == 0)
      fail_all(fmt::format("exchange #{}: timed out after {} ms waiting for rank(s) {}", seq, timeout.count(),
                           rank_list(ranks)));
    for (size_t i = 0; i < fds.size(); ++i) {
      if (!fds[i].revents) continue;
      const int r = ranks[i];
      Message m;
      if (std::string err = recv_msg(peers_[size_t(r)].fd(), m, d); !err.empty()) {
        peers_[size_t(r)] = Socket();
        fail_all(fmt::format("exchange #{}: rank {} {}", seq, r,
                             err == kClosed ? "disconnected" : "failed: " + err));
      }
      if (m.type == kAbort) fail_all(fmt::format("exchange #{}: rank {} gave up: {}", seq, r, text_of(m.payload)));
      Reader rd(m.payload);
      const uint64_t their_seq = rd.u64();
      if (m.type != kGather || !rd.ok())
        fail_all(fmt::format("exchange #{}: rank {} sent message type {} instead of its bytes", seq, r, m.type));
      if (their_seq != seq)
        fail_all(fmt::format("exchange #{}: rank {} is at exchange #{} (the ranks called different exchanges)", seq, r,
                             their_seq));
      all[size_t(r)] = rd.rest();
      got[size_t(r)] = true;
      ++n_got;
    }
  }

  std::vector<uint8_t> out;
  put_u64(out, seq);
  put_u32(out, uint32_t(size_));
  for (const auto& v : all) {
    put_u32(out, uint32_t(v.size()));
    put_bytes(out, v);
  }
  for (int r = 1; r < size_; ++r)
    if (std::string err = send_msg(peers_[size_t(r)].fd(), kGathered, out, d); !err.empty())
      fail_all(fmt::format("exchange #{}: could not send the result to rank {}: {}", seq, r, err));
  return all;
}

}  // namespace sparsemla::dist
