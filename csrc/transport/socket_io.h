// Blocking TCP socket helpers shared by the tcp client channel and the shard server.
//
// Thread safety: free functions; a socket may be written by one thread and read by another.
// Invariants:
//   1. Every write uses MSG_NOSIGNAL: a peer that went away yields TransportError, never
//      SIGPIPE.
//   2. Short reads/writes and EINTR are retried; a read returns false only on a clean EOF
//      before the first byte, and throws TransportError on EOF inside a frame.
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "transport/transport.h"

namespace bagpipe::transport {

// Connects to host:port (IPv4 or IPv6, any address getaddrinfo returns) before the
// deadline; sets TCP_NODELAY. Throws TimeoutError / TransportError naming host:port.
int ConnectTcp(const std::string& host, uint16_t port, Deadline deadline);

// Binds and listens; returns the fd and writes the bound port (useful with port 0).
int ListenTcp(const std::string& host, uint16_t port, int backlog, uint16_t* bound_port);

// Writes all bytes of the iovecs (modified in place). Throws TransportError.
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

// SO_RCVTIMEO / SO_SNDTIMEO; seconds <= 0 clears it.
void SetRecvTimeout(int fd, double seconds);
void SetSendTimeout(int fd, double seconds);
void SetNoDelay(int fd);
// "host:port" of the socket's peer.
std::string PeerName(int fd);

}  // namespace bagpipe::transport
