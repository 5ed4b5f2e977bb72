#include "testing/loopback_probe.h"

#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <thread>

#include "common/errors.h"
#include "transport/socket.h"

namespace bagpipe::testing {
namespace {

using transport::ConnectTcp;
using transport::ListenTcp;
using transport::ReadFull;
using transport::SetNoDelay;
using transport::WriteAll;

struct Pair {
  int client = -1;
  int server = -1;
  ~Pair() {
    if (client >= 0) ::close(client);
    if (server >= 0) ::close(server);
  }
};

void Connect(Pair* p) {
  uint16_t port = 0;
  const int lfd = ListenTcp("127.0.0.1", 0, 1, &port);
  std::thread acceptor([&] { p->server = ::accept(lfd, nullptr, nullptr); });
  p->client = ConnectTcp("127.0.0.1", port, DeadlineAfter(10)).Release();
  acceptor.join();
  ::close(lfd);
  if (p->server < 0) throw TransportError("loopback probe: accept failed");
  SetNoDelay(p->server);
}

}  // namespace

double RawLoopbackSeconds(size_t total_bytes, size_t chunk_bytes) {
  if (chunk_bytes == 0) throw ValueError("chunk_bytes must be > 0");
  Pair p;
  Connect(&p);
  std::unique_ptr<char[]> src(new char[chunk_bytes]);
  for (size_t i = 0; i < chunk_bytes; ++i) src[i] = static_cast<char>(i);
  std::unique_ptr<char[]> dst(new char[chunk_bytes]);
  std::chrono::steady_clock::time_point done;
  std::thread receiver([&] {
    size_t got = 0;
    while (got < total_bytes) {
      const ssize_t n = ::recv(p.server, dst.get(), chunk_bytes, 0);
      if (n <= 0) break;
      got += static_cast<size_t>(n);
    }
    done = std::chrono::steady_clock::now();
  });
  const auto start = std::chrono::steady_clock::now();
  for (size_t sent = 0; sent < total_bytes; sent += chunk_bytes) {
    WriteAll(p.client, src.get(), std::min(chunk_bytes, total_bytes - sent), "probe");
  }
  receiver.join();
  return std::chrono::duration<double>(done - start).count();
}

std::vector<double> RawPingPongSeconds(size_t iterations, size_t msg_bytes) {
  if (msg_bytes == 0) throw ValueError("msg_bytes must be > 0");
  Pair p;
  Connect(&p);
  std::thread echo([&] {
    std::unique_ptr<char[]> buf(new char[msg_bytes]);
    for (size_t i = 0; i < iterations; ++i) {
      if (!ReadFull(p.server, buf.get(), msg_bytes, true, "probe")) return;
      WriteAll(p.server, buf.get(), msg_bytes, "probe");
    }
  });
  std::unique_ptr<char[]> buf(new char[msg_bytes]());
  std::vector<double> rtt;
  rtt.reserve(iterations);
  for (size_t i = 0; i < iterations; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    WriteAll(p.client, buf.get(), msg_bytes, "probe");
    ReadFull(p.client, buf.get(), msg_bytes, false, "probe");
    rtt.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  echo.join();
  return rtt;
}

}  // namespace bagpipe::testing
