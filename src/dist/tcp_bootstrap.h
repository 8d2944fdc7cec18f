// The rendezvous of a multi-process (multi-node) run over plain TCP: rank 0 listens, ranks
// 1..N-1 connect to it, and rank 0 hands every rank the same opaque blob (the NCCL unique id) and
// the world size. The connections stay open as a star around rank 0 for small host-side exchanges
// (all_gather of byte blobs, barrier) that a launch needs before and beside the GPU collectives.
//
//   rank 0:  TcpListener l("0.0.0.0:29500");  auto b = TcpBootstrap::accept(std::move(l), N, id, timeout);
//   rank r:  auto b = TcpBootstrap::join("node0:29500", r, N, timeout);   // b.blob() == id
//
// Nothing blocks past a deadline: every wait (connecting, with retries while rank 0 is not up yet;
// the other ranks arriving; each exchange) ends by `timeout` with an Error. Errors name rank 0's
// host:port, this rank, and what went wrong: a timeout (and which ranks never came), a rank that
// connects twice, a world size that differs from rank 0's, a peer that disconnects. Rank 0 passes
// a failure on to every rank still connected, so that each throws at once rather than at its own
// deadline. Name resolution (getaddrinfo) is the one step bounded by the system resolver's own
// timeouts instead.
//
// Wire format (fixed little-endian, so hosts need not agree on byte order): each message is a
// u32 type, a u32 payload length, and the payload. A connection whose first message is not a
// bootstrap hello (a port scanner, a health check) is dropped and otherwise ignored.
#pragma once
#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace sparsemla::dist {

// "host:port": host is an IPv4 address, a name, or "[IPv6]"; port 0..65535. For listening, an
// empty host (":29500") means every interface.
struct HostPort {
  std::string host;
  uint16_t port = 0;
  std::string str() const;  // as it was written: "node0:29500", "[::1]:29500"
};
// Throws Error quoting `address` when it is not host:port.
HostPort parse_host_port(std::string_view address);

// A socket file descriptor, closed when the object goes away.
class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket();
  Socket(Socket&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Socket& operator=(Socket&& o) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

// Rank 0's listening socket, bound and listening as soon as it is made, so that the port is known
// (port 0 asks the OS for a free one) before any other rank is told where to connect. Ranks that
// connect before accept() is called wait in the listen queue.
class TcpListener {
 public:
  explicit TcpListener(std::string_view address);
  uint16_t port() const { return port_; }
  // host:port as given, with the port the OS chose when 0 was asked for.
  std::string address() const;

 private:
  friend class TcpBootstrap;
  HostPort where_;
  uint16_t port_ = 0;
  Socket sock_;
};

// One rank's end of the rendezvous; used by one thread at a time.
class TcpBootstrap {
 public:
  using Ms = std::chrono::milliseconds;

  // Rank 0: waits (until `timeout`) for ranks 1..world_size-1 to connect to `listener`, checks that
  // each is a new rank of the same world size, and sends each `blob`. Returns once every rank has
  // it. world_size 1 accepts nobody.
  static TcpBootstrap accept(TcpListener listener, int world_size, std::vector<uint8_t> blob, Ms timeout);
  // Ranks 1..world_size-1: connects to rank 0 at `root_address`, retrying while nobody listens there
  // yet, and waits for the blob. All within `timeout`.
  static TcpBootstrap join(std::string_view root_address, int rank, int world_size, Ms timeout);

  TcpBootstrap(TcpBootstrap&&) noexcept = default;
  TcpBootstrap& operator=(TcpBootstrap&&) noexcept = default;
  ~TcpBootstrap();

  int rank() const { return rank_; }
  int size() const { return size_; }
  // The blob rank 0 gave: the same bytes on every rank.
  const std::vector<uint8_t>& blob() const { return blob_; }
  // Rank 0's host:port, as the errors quote it.
  const std::string& root_address() const { return root_; }

  // Every rank's bytes, in rank order, on every rank; the sizes may differ between ranks. Each call
  // waits at most the bootstrap's timeout. Every rank must call the same exchanges in the same order.
  std::vector<std::vector<uint8_t>> all_gather(std::span<const uint8_t> mine);
  // The same with a deadline of its own for this call; kForever waits as long as the peers stay
  // connected (a worker waiting for rank 0's next step: a peer that goes away still ends it).
  static constexpr Ms kForever = Ms::max();
  std::vector<std::vector<uint8_t>> all_gather(std::span<const uint8_t> mine, Ms timeout);
  // Returns once every rank has called it.
  void barrier() { all_gather({}); }

  // Watches the connections (rank 0: to every rank; others: to rank 0) for up to `wait`, without
  // reading anything: "" while they are open (a peer that has sent its next message is alive),
  // else which rank went away. For a watchdog thread while this rank is in collectives that have
  // no deadline of their own (NCCL): the only call that may run beside the others.
  std::string lost_peer(Ms wait) const;

 private:
  TcpBootstrap(std::string root, int rank, int size, Ms timeout);
  [[noreturn]] void fail_all(const std::string& what);  // rank 0: tells every peer, then throws
  std::string where() const;                            // "tcp bootstrap HOST:PORT (rank R of N)"

  std::string root_;
  int rank_ = 0;
  int size_ = 1;
  Ms timeout_{0};
  std::vector<uint8_t> blob_;
  uint64_t exchanges_ = 0;     // all_gather calls so far, checked against the peers'
  Socket root_sock_;           // ranks 1..N-1: the connection to rank 0
  std::vector<Socket> peers_;  // rank 0: [size] the connection to each rank (peers_[0] unused)
};

}  // namespace sparsemla::dist
