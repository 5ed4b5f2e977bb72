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

// SO_RCVTIMEO / SO_SNDTIMEO; seconds <= 0 clears it.
void SetRecvTimeout(int fd, double seconds);
void SetSendTimeout(int fd, double seconds);
void SetNoDelay(int fd);
// "host:port" of the socket's peer.
std::string PeerName(int fd);

// Splits "host:port" / "[v6]:port" / "tcp://host:port". Throws ValueError.
void ParseHostPort(const std::string& address, std::string* host, uint16_t* port);

}  // namespace bagpipe::transport
