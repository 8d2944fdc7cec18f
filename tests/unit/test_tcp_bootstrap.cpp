// The TCP rendezvous of a multi-process run (dist/tcp_bootstrap.h), with the ranks as threads on
// 127.0.0.1 and rank 0 on a port the OS chooses: the blob and the exchanges on 1 to 8 ranks, and
// each failure (a bad address, a rank that never comes, nobody listening, a world size that
// differs, a rank that connects twice, a peer that disconnects) as an Error on every rank, quickly.
#include <gtest/gtest.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <future>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "dist/tcp_bootstrap.h"
#include "test_util.h"
#include "util/error.h"

namespace sparsemla::dist {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Runs fn(i) on n threads and returns each one's error message ("" when it returned). A hang fails
// the test within a minute (and ends the process, whose threads cannot be joined).
std::vector<std::string> run_threads(int n, const std::function<void(int)>& fn) {
  std::vector<std::string> errors(static_cast<size_t>(n), "");
  auto all = std::async(std::launch::async, [&] {
    std::vector<std::thread> threads;
    for (int i = 0; i < n; ++i)
      threads.emplace_back([&, i] {
        try {
          fn(i);
        } catch (const std::exception& e) {
          errors[size_t(i)] = e.what();
        }
      });
    for (auto& t : threads) t.join();
  });
  if (all.wait_for(60s) != std::future_status::ready) {
    std::fprintf(stderr, "the bootstrap hung: a wait had no deadline\n");
    std::_Exit(1);
  }
  return errors;
}

std::string local(uint16_t port) { return "127.0.0.1:" + std::to_string(port); }

// A port on 127.0.0.1 that nobody listens on (it was free a moment ago).
uint16_t unused_port() { return TcpListener("127.0.0.1:0").port(); }

long ms_since(Clock::time_point t0) {
  return long(std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count());
}

TEST(TcpBootstrap, ParsesHostAndPort) {
  HostPort hp = parse_host_port("127.0.0.1:29500");
  EXPECT_EQ(hp.host, "127.0.0.1");
  EXPECT_EQ(hp.port, 29500);
  EXPECT_EQ(hp.str(), "127.0.0.1:29500");
  hp = parse_host_port("node-0.cluster:1");
  EXPECT_EQ(hp.host, "node-0.cluster");
  EXPECT_EQ(hp.port, 1);
  hp = parse_host_port("[::1]:65535");
  EXPECT_EQ(hp.host, "::1");
  EXPECT_EQ(hp.port, 65535);
  EXPECT_EQ(hp.str(), "[::1]:65535");
  hp = parse_host_port(":0");  // listening on every interface, on a port the OS chooses
  EXPECT_EQ(hp.host, "");
  EXPECT_EQ(hp.port, 0);
}

TEST(TcpBootstrap, RefusesBadAddresses) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"127.0.0.1", "has no port"},
      {"127.0.0.1:", "the port must be a number"},
      {"127.0.0.1:http", "the port must be a number"},
      {"127.0.0.1:70000", "the port must be a number"},
      {"127.0.0.1:-1", "the port must be a number"},
      {"256.1.1.1:80", "'256.1.1.1' is not an IPv4 address"},
      {"10.0.0:80", "'10.0.0' is not an IPv4 address"},
      {"::1:80", "in brackets"},
      {"[::1:80", "[address]:port"},
      {"[::1]80", "[address]:port"},
      {"[fe80::zz]:80", "is not an IPv6 address"},
      {"my host:80", "is not a host name"},
  };
  for (const auto& [address, expected] : cases) {
    const std::string err = test::error_of([&] { parse_host_port(address); });
    EXPECT_TRUE(contains(err, expected) && contains(err, "'" + address + "'")) << address << " -> " << err;
  }
  // Rank 0's address must name a host and a real port; a bad one is an error before any wait.
  std::string err = test::error_of([] { TcpBootstrap::join(":29500", 1, 2, 300ms); });
  EXPECT_TRUE(contains(err, "needs a host")) << err;
  err = test::error_of([] { TcpBootstrap::join("127.0.0.1:0", 1, 2, 300ms); });
  EXPECT_TRUE(contains(err, "port other than 0")) << err;
  err = test::error_of([] { TcpBootstrap::join("127.0.0.1:1", 0, 2, 300ms); });
  EXPECT_TRUE(contains(err, "rank 0 accepts instead")) << err;
  err = test::error_of([] { TcpListener("300.0.0.1:0"); });
  EXPECT_TRUE(contains(err, "not an IPv4 address")) << err;
}

TEST(TcpBootstrap, DeliversTheSameBlobAndGathersOnEveryRank) {
  for (const int N : {1, 2, 4, 8}) {
    SCOPED_TRACE("N = " + std::to_string(N));
    std::vector<uint8_t> blob(128);
    std::mt19937 rng(static_cast<uint32_t>(N));
    for (auto& b : blob) b = uint8_t(rng());
    TcpListener listener("127.0.0.1:0");
    const std::string root = local(listener.port());

    const size_t n_ranks = static_cast<size_t>(N);
    std::vector<std::vector<uint8_t>> blobs(n_ranks);
    std::vector<std::vector<std::vector<uint8_t>>> gathered(n_ranks), gathered_again(n_ranks);
    const auto errors = run_threads(N, [&](int r) {
      TcpBootstrap b =
          r == 0 ? TcpBootstrap::accept(std::move(listener), N, blob, 10s) : TcpBootstrap::join(root, r, N, 10s);
      EXPECT_EQ(b.rank(), r);
      EXPECT_EQ(b.size(), N);
      blobs[size_t(r)] = b.blob();
      // Sizes that differ by rank, rank 2's empty.
      std::vector<uint8_t> mine(r == 2 ? 0 : size_t(r) * 37 + 1, uint8_t(r + 1));
      gathered[size_t(r)] = b.all_gather(mine);
      b.barrier();
      mine.assign(1, uint8_t(100 + r));
      gathered_again[size_t(r)] = b.all_gather(mine);
    });
    for (int r = 0; r < N; ++r) {
      EXPECT_EQ(errors[size_t(r)], "") << "rank " << r;
      EXPECT_EQ(blobs[size_t(r)], blob) << "rank " << r;
      ASSERT_EQ(gathered[size_t(r)].size(), size_t(N)) << "rank " << r;
      for (int s = 0; s < N; ++s) {
        const std::vector<uint8_t> sent(s == 2 ? 0 : size_t(s) * 37 + 1, uint8_t(s + 1));
        EXPECT_EQ(gathered[size_t(r)][size_t(s)], sent) << "rank " << r << " got rank " << s;
        EXPECT_EQ(gathered_again[size_t(r)][size_t(s)], std::vector<uint8_t>{uint8_t(100 + s)}) << "rank " << r;
      }
    }
  }
}

TEST(TcpBootstrap, TimesOutWhenARankNeverComes) {
  TcpListener listener("127.0.0.1:0");
  const std::string root = local(listener.port());
  const auto t0 = Clock::now();
  // World of 3, rank 2 never starts.
  const auto errors = run_threads(2, [&](int r) {
    if (r == 0)
      TcpBootstrap::accept(std::move(listener), 3, {1, 2, 3}, 300ms);
    else
      TcpBootstrap::join(root, 1, 3, 10s);
  });
  EXPECT_LT(ms_since(t0), 5000);
  EXPECT_TRUE(contains(errors[0], "tcp bootstrap " + root + " (rank 0 of 3)") &&
              contains(errors[0], "timed out after 300 ms waiting for rank(s) 2 to connect") &&
              contains(errors[0], "2 of 3 ranks joined"))
      << errors[0];
  // Rank 1 hears it from rank 0 at once, rather than at its own deadline.
  EXPECT_TRUE(contains(errors[1], "tcp bootstrap " + root + " (rank 1 of 3)") &&
              contains(errors[1], "rank 0 gave up") && contains(errors[1], "rank(s) 2"))
      << errors[1];
}

TEST(TcpBootstrap, JoinTimesOutWhenNobodyListensOrRankZeroNeverAnswers) {
  const std::string nobody = local(unused_port());
  auto t0 = Clock::now();
  std::string err = test::error_of([&] { TcpBootstrap::join(nobody, 1, 2, 300ms); });
  EXPECT_GE(ms_since(t0), 300);
  EXPECT_LT(ms_since(t0), 5000);
  EXPECT_TRUE(contains(err, "tcp bootstrap " + nobody + " (rank 1 of 2)") &&
              contains(err, "could not connect to rank 0 within 300 ms") && contains(err, "refused"))
      << err;

  // Listening, but rank 0 never gets to accept.
  TcpListener silent("127.0.0.1:0");
  t0 = Clock::now();
  err = test::error_of([&] { TcpBootstrap::join(local(silent.port()), 1, 2, 300ms); });
  EXPECT_LT(ms_since(t0), 5000);
  EXPECT_TRUE(contains(err, "(rank 1 of 2)") &&
              contains(err, "timed out after 300 ms waiting for rank 0 to send the blob"))
      << err;
}

TEST(TcpBootstrap, MismatchedWorldSizesFailOnBothSides) {
  TcpListener listener("127.0.0.1:0");
  const std::string root = local(listener.port());
  const auto errors = run_threads(2, [&](int r) {
    if (r == 0)
      TcpBootstrap::accept(std::move(listener), 2, {7}, 10s);
    else
      TcpBootstrap::join(root, 1, 3, 10s);
  });
  const std::string what = "world size mismatch: rank 1 was started with world size 3, rank 0 with 2";
  EXPECT_TRUE(contains(errors[0], root) && contains(errors[0], what)) << errors[0];
  EXPECT_TRUE(contains(errors[1], root + " (rank 1 of 3)") && contains(errors[1], "rank 0 gave up") &&
              contains(errors[1], what))
      << errors[1];
}

TEST(TcpBootstrap, ARankThatConnectsTwiceFailsEveryRank) {
  TcpListener listener("127.0.0.1:0");
  const std::string root = local(listener.port());
  // Threads 1 and 2 both claim rank 1 of 3; rank 2 never comes, but the failure must not wait for it.
  const auto t0 = Clock::now();
  const auto errors = run_threads(3, [&](int i) {
    if (i == 0)
      TcpBootstrap::accept(std::move(listener), 3, {7}, 10s);
    else
      TcpBootstrap::join(root, 1, 3, 10s);
  });
  EXPECT_LT(ms_since(t0), 5000);
  for (int i = 0; i < 3; ++i)
    EXPECT_TRUE(contains(errors[size_t(i)], root) && contains(errors[size_t(i)], "rank 1 connected twice"))
        << errors[size_t(i)];
}

TEST(TcpBootstrap, APeerThatDisconnectsFailsTheExchangeOnEveryRank) {
  {  // Rank 1 leaves after joining; ranks 0 and 2 wait for it in an exchange.
    TcpListener listener("127.0.0.1:0");
    const std::string root = local(listener.port());
    const auto errors = run_threads(3, [&](int r) {
      TcpBootstrap b =
          r == 0 ? TcpBootstrap::accept(std::move(listener), 3, {7}, 10s) : TcpBootstrap::join(root, r, 3, 10s);
      if (r != 1) b.barrier();
    });
    EXPECT_TRUE(contains(errors[0], root + " (rank 0 of 3)") && contains(errors[0], "exchange #0: rank 1 disconnected"))
        << errors[0];
    EXPECT_EQ(errors[1], "");
    EXPECT_TRUE(contains(errors[2], root + " (rank 2 of 3)") && contains(errors[2], "rank 0 gave up") &&
                contains(errors[2], "rank 1 disconnected"))
        << errors[2];
  }
  {  // Rank 0 leaves; rank 1 waits for it.
    TcpListener listener("127.0.0.1:0");
    const std::string root = local(listener.port());
    const auto errors = run_threads(2, [&](int r) {
      TcpBootstrap b =
          r == 0 ? TcpBootstrap::accept(std::move(listener), 2, {7}, 10s) : TcpBootstrap::join(root, r, 2, 10s);
      if (r == 1) b.all_gather(std::vector<uint8_t>{1, 2});
    });
    EXPECT_EQ(errors[0], "");
    EXPECT_TRUE(contains(errors[1], root + " (rank 1 of 2)") && contains(errors[1], "exchange #0: lost rank 0"))
        << errors[1];
  }
}

TEST(TcpBootstrap, IgnoresConnectionsThatDoNotSpeakTheProtocol) {
  TcpListener listener("127.0.0.1:0");
  const uint16_t port = listener.port();
  // A health check that sends HTTP, and a port scan that connects and closes, before rank 1 comes.
  auto stranger = [port](const std::string& says) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    if (!says.empty()) {
      ASSERT_EQ(::send(fd, says.data(), says.size(), MSG_NOSIGNAL), ssize_t(says.size()));
    }
    ::close(fd);
  };
  stranger("GET / HTTP/1.0\r\n\r\n");
  stranger("");
  std::vector<std::vector<uint8_t>> blobs(2);
  const auto errors = run_threads(2, [&](int r) {
    TcpBootstrap b = r == 0 ? TcpBootstrap::accept(std::move(listener), 2, {4, 5, 6}, 10s)
                            : TcpBootstrap::join(local(port), r, 2, 10s);
    blobs[size_t(r)] = b.blob();
  });
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
  EXPECT_EQ(blobs[1], (std::vector<uint8_t>{4, 5, 6}));
}

// The watchdog's view of the star: "" while every peer is connected (also once a peer's next
// message waits unread), the rank that went away once its process closes the connection, on rank 0
// and on a worker alike; nothing is consumed, so the exchanges go on as before.
TEST(TcpBootstrap, LostPeerNamesTheRankThatWentAway) {
  TcpListener listener("127.0.0.1:0");
  const std::string root = local(listener.port());
  std::promise<void> leave, left;
  std::string r0_idle, r0_after_msg, r0_lost, r2_idle, r2_lost;
  const auto errors = run_threads(3, [&](int r) {
    if (r == 0) {
      TcpBootstrap b = TcpBootstrap::accept(std::move(listener), 3, {}, 10s);
      r0_idle = b.lost_peer(200ms);
      b.barrier();
      // Rank 1 has sent its part of the next exchange: still alive.
      std::this_thread::sleep_for(200ms);
      r0_after_msg = b.lost_peer(200ms);
      b.barrier();  // the unread message is still there for the exchange
      leave.set_value();
      left.get_future().wait();
      const auto t0 = Clock::now();
      while ((r0_lost = b.lost_peer(100ms)).empty() && ms_since(t0) < 5000) {}
      return;  // rank 2 sees rank 0 go
    }
    TcpBootstrap b = TcpBootstrap::join(root, r, 3, 10s);
    b.barrier();
    if (r == 1) {
      b.barrier();
      leave.get_future().wait();
      return;  // its connection closes here
    }
    r2_idle = b.lost_peer(100ms);
    b.barrier();
    std::this_thread::sleep_for(300ms);
    left.set_value();
    const auto t0 = Clock::now();
    while ((r2_lost = b.lost_peer(100ms)).empty() && ms_since(t0) < 5000) {}
  });
  for (int r = 0; r < 3; ++r) EXPECT_EQ(errors[size_t(r)], "") << "rank " << r;
  EXPECT_EQ(r0_idle, "");
  EXPECT_EQ(r0_after_msg, "");
  EXPECT_EQ(r2_idle, "");
  EXPECT_EQ(r0_lost, "rank 1");
  EXPECT_TRUE(contains(r2_lost, "rank 0")) << r2_lost;
}

}  // namespace
}  // namespace sparsemla::dist
