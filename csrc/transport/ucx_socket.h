// The TCP control connection of the UCX transport: connect and accept with deadlines, and
// exact-length reads and writes that never block past a deadline.
//
// Thread safety: a Socket is used by one thread at a time (the handshake thread, then the
// endpoint's progress thread); Listener::Accept by one thread, Listener::Close by any.
//
// Invariants:
//   1. Every call that can wait takes a deadline: past it, TimeoutError.
//   2. A refused, reset or closed connection is a TransportError naming the peer.
//   3. Sockets are non-blocking and close-on-exec; SIGPIPE is never raised (MSG_NOSIGNAL).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "transport/ucx_context.h"

namespace bagpipe::transport::ucx {

class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket() { Close(); }
  Socket(Socket&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Socket& operator=(Socket&& o) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;

  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void Close();
  // Disables further sends and receives, waking any poll on the socket. Idempotent.
  void Shutdown();

 private:
  int fd_ = -1;
};

// Connects to host:port. TransportError when refused/unreachable, TimeoutError at deadline.
Socket ConnectTcp(const std::string& host, uint16_t port, Deadline deadline);
// Writes exactly len bytes. `peer` names the other side in errors.
void SendAll(int fd, const void* data, size_t len, Deadline deadline, const std::string& peer);
// Reads exactly len bytes; EOF before that is a TransportError.
void RecvAll(int fd, void* data, size_t len, Deadline deadline, const std::string& peer);

class Listener {
 public:
  // Binds host:port (port 0: an ephemeral port) and listens. Throws TransportError.
  Listener(const std::string& host, uint16_t port);
  ~Listener();
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;

  uint16_t port() const { return port_; }
  const std::string& host() const { return host_; }
  // Waits up to timeout_ms for a connection; an invalid Socket when none came or the
  // listener was closed. *peer receives "ip:port".
  Socket Accept(int timeout_ms, std::string* peer);
  // Stops accepting; a concurrent Accept returns an invalid Socket. Idempotent.
  void Close();

 private:
  const std::string host_;
  uint16_t port_ = 0;
  int fd_ = -1;                    // set by the constructor, closed by the destructor
  std::atomic<bool> closed_{false};
  int wake_[2] = {-1, -1};  // pipe: Close() wakes a blocked Accept
};

}  // namespace bagpipe::transport::ucx
