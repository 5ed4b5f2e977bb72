// The one TCP socket library of the native code: connecting and listening with deadlines,
// exact-length reads and writes on blocking sockets (the tcp channel, the TCP shard server,
// the frame fuzzers, the loopback probe) and on non-blocking ones (the UCX control
// connection), and a buffered frame reader.
//
// Thread safety: free functions; a socket may be written by one thread and read by another.
// A Socket object is used by one thread at a time; Listener::Accept by one thread,
// Listener::Close by any.
//
// Invariants:
//   1. Every write uses MSG_NOSIGNAL: a peer that went away yields TransportError, never
//      SIGPIPE. Every socket is close-on-exec.
//   2. Short reads/writes and EINTR are retried; ReadFull returns false only on a clean EOF
//      before the first byte, and throws TransportError on EOF inside a frame.
//   3. Every call that can wait is bounded: by a deadline (ConnectTcp, SendAll, RecvAll:
//      TimeoutError past it), by a socket timeout set with SetRecvTimeout / SetSendTimeout
//      (blocking reads and writes), or by Accept's timeout.
//   4. A refused, reset or closed connection is a TransportError naming the peer.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "common/deadline.h"

namespace bagpipe::transport {

// An owned socket descriptor, closed by the destructor.
class Socket {
 public:
  // Owns nothing / owns fd (any descriptor, -1: nothing).
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket() { Close(); }
  // Take o's descriptor (this one's, if any, is closed first); o is left owning nothing.
  Socket(Socket&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Socket& operator=(Socket&& o) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;

  // The descriptor (-1 when none), and whether there is one.
  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  // Gives up ownership: the caller closes the returned descriptor.
  int Release();
  void Close();
  // Disables further sends and receives, waking any poll on the socket. Idempotent.
  void Shutdown();

 private:
  int fd_ = -1;
};

// Connects to host:port (IPv4 or IPv6, any address getaddrinfo returns) before the
// deadline. The socket is blocking, with TCP_NODELAY. Throws TimeoutError / TransportError
// naming host:port.
Socket ConnectTcp(const std::string& host, uint16_t port, Deadline deadline);

// Binds and listens (blocking descriptor); returns the fd and writes the bound port (useful
// with port 0). Throws ValueError (address does not resolve) / IOError (cannot bind).
int ListenTcp(const std::string& host, uint16_t port, int backlog, uint16_t* bound_port);

// A listening socket whose Accept waits a bounded time and can be woken by Close.
class Listener {
 public:
  // Binds host:port (port 0: an ephemeral port) and listens. Throws as ListenTcp.
  Listener(const std::string& host, uint16_t port);
  ~Listener();
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;

  // Where it listens (port: the bound one, also when asked for 0).
  uint16_t port() const { return port_; }
  const std::string& host() const { return host_; }
  // Waits up to timeout_ms for a connection; an invalid Socket when none came or the
  // listener was closed. The accepted socket has TCP_NODELAY and is non-blocking when
  // `nonblocking`. *peer (if not null) receives "ip:port".
  Socket Accept(int timeout_ms, std::string* peer, bool nonblocking);
  // Stops accepting; a concurrent Accept returns an invalid Socket. Idempotent.
  void Close();

 private:
  const std::string host_;
  uint16_t port_ = 0;
  int fd_ = -1;                    // set by the constructor, closed by the destructor
  std::atomic<bool> closed_{false};
  int wake_[2] = {-1, -1};  // pipe: Close() wakes a blocked Accept
};

// ---- blocking sockets -------------------------------------------------------------------
// Writes all bytes of the iovecs (modified in place). Throws TransportError (also when a
// send timeout expired: the peer does not read).
void WriteAllV(int fd, struct iovec* iov, int iovcnt, const std::string& peer);
void WriteAll(int fd, const void* data, size_t len, const std::string& peer);

// Reads exactly len bytes. Returns false on EOF before the first byte when eof_ok;
// otherwise throws TransportError (TimeoutError if a receive timeout set with
// SetRecvTimeout expired).
bool ReadFull(int fd, void* data, size_t len, bool eof_ok, const std::string& peer);

// A buffered reader of one socket's byte stream, for frame receive loops: small frames
// (headers, ACKs, notifications) arrive several per recv() instead of one recv() per field,
// while a large read (a GET reply's rows, a commit chunk) goes from the socket straight into
// its destination once the few bytes already buffered are copied out.
// Thread safety: one reader thread per FrameReader.
// Invariants:
//   1. The buffered bytes are exactly the stream bytes after those already returned: Read
//      consumes the stream in order, as ReadFull would, with the same errors and EOF rules.
//   2. At most capacity() bytes are held; a read larger than half of it bypasses the buffer.
class FrameReader {
 public:
  // REQUIRES: capacity >= 1024. The socket stays owned by the caller.
  FrameReader(int fd, std::string peer, size_t capacity = size_t{16} << 10);
  // As ReadFull(fd, data, len, eof_ok, peer) (invariant 1).
  bool Read(void* data, size_t len, bool eof_ok);
  size_t capacity() const { return cap_; }
  size_t buffered() const { return end_ - begin_; }

 private:
  const int fd_;
  const std::string peer_;
  const size_t cap_;
  std::unique_ptr<uint8_t[]> buf_;
  size_t begin_ = 0;  // first unread byte in buf_
  size_t end_ = 0;    // one past the last buffered byte
};

// ---- non-blocking sockets (deadline-bounded) -----------------------------------------------
// Writes exactly len bytes. `peer` names the other side in errors.
void SendAll(int fd, const void* data, size_t len, Deadline deadline, const std::string& peer);
// Reads exactly len bytes; EOF before that is a TransportError.
void RecvAll(int fd, void* data, size_t len, Deadline deadline, const std::string& peer);

// ---- options ---------------------------------------------------------------------------
void SetNonBlocking(int fd, bool nonblocking);
// SO_RCVTIMEO / SO_SNDTIMEO; seconds <= 0 clears it.
void SetRecvTimeout(int fd, double seconds);
void SetSendTimeout(int fd, double seconds);
void SetNoDelay(int fd);
// "host:port" of the socket's peer.
std::string PeerName(int fd);
// True if every address `host` resolves to is a loopback address (127.0.0.0/8, ::1);
// false for wildcard and routable addresses, and for a name that does not resolve.
bool IsLoopbackHost(const std::string& host);

}  // namespace bagpipe::transport
