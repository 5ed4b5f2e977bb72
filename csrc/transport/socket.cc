#include "transport/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/errors.h"

namespace bagpipe::transport {

namespace {

std::string Errno(int err) { return std::strerror(err); }

// Waits for `events` on fd until the deadline. Returns revents; 0 on timeout.
short PollOne(int fd, short events, Deadline deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int rc = ::poll(&p, 1, MillisLeft(deadline));
    if (rc > 0) return p.revents;
    if (rc == 0) {
      if (Clock::now() >= deadline) return 0;
      continue;
    }
    if (errno != EINTR) throw TransportError("poll on a socket: " + Errno(errno));
  }
}

std::string AddressText(const sockaddr_storage& ss) {
  char host[INET6_ADDRSTRLEN] = "?";
  uint16_t port = 0;
  if (ss.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    ::inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
    port = ntohs(a->sin_port);
  } else if (ss.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    ::inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
    port = ntohs(a->sin6_port);
  }
  return std::string(host) + ":" + std::to_string(port);
}

}  // namespace

// ---- Socket ---------------------------------------------------------------------------------

Socket& Socket::operator=(Socket&& o) noexcept {
  if (this != &o) {
    Close();
    fd_ = o.fd_;
    o.fd_ = -1;
  }
  return *this;
}

int Socket::Release() {
  const int fd = fd_;
  fd_ = -1;
  return fd;
}

void Socket::Close() {
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
}

void Socket::Shutdown() {
  if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
}

// ---- options --------------------------------------------------------------------------------

void SetNonBlocking(int fd, bool nonblocking) {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  ::fcntl(fd, F_SETFL, nonblocking ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK));
}

void SetNoDelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

namespace {
void SetTimeout(int fd, int option, double seconds) {
  struct timeval tv{};
  if (seconds > 0) {
    const double s = seconds < 1e7 ? seconds : 1e7;
    tv.tv_sec = static_cast<time_t>(s);
    tv.tv_usec = static_cast<suseconds_t>((s - static_cast<double>(tv.tv_sec)) * 1e6);
    if (tv.tv_sec == 0 && tv.tv_usec == 0) tv.tv_usec = 1000;
  }
  ::setsockopt(fd, SOL_SOCKET, option, &tv, sizeof(tv));
}
}  // namespace

void SetRecvTimeout(int fd, double seconds) { SetTimeout(fd, SO_RCVTIMEO, seconds); }
void SetSendTimeout(int fd, double seconds) { SetTimeout(fd, SO_SNDTIMEO, seconds); }

std::string PeerName(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "?";
  return AddressText(ss);
}

bool IsLoopbackHost(const std::string& host) {
  if (host.empty()) return false;  // the wildcard address
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0) return false;
  bool loopback = res != nullptr;
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    if (ai->ai_family == AF_INET) {
      const auto* a = reinterpret_cast<const sockaddr_in*>(ai->ai_addr);
      loopback = loopback && (ntohl(a->sin_addr.s_addr) >> 24) == 127;
    } else if (ai->ai_family == AF_INET6) {
      const auto* a = reinterpret_cast<const sockaddr_in6*>(ai->ai_addr);
      loopback = loopback && IN6_IS_ADDR_LOOPBACK(&a->sin6_addr);
    } else {
      loopback = false;
    }
  }
  ::freeaddrinfo(res);
  return loopback;
}

// ---- connect / listen -------------------------------------------------------------------------

Socket ConnectTcp(const std::string& host, uint16_t port, Deadline deadline) {
  const std::string where = host + ":" + std::to_string(port);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const std::string port_text = std::to_string(port);
  const int rc = ::getaddrinfo(host.c_str(), port_text.c_str(), &hints, &res);
  if (rc != 0) throw TransportError("cannot resolve PS shard address " + where + ": " + gai_strerror(rc));
  std::string last_error = "no address";
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    Socket s(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
    if (!s.valid()) {
      last_error = Errno(errno);
      continue;
    }
    SetNonBlocking(s.fd(), true);
    int r = ::connect(s.fd(), ai->ai_addr, ai->ai_addrlen);
    if (r != 0 && errno == EINPROGRESS) {
      const short ev = PollOne(s.fd(), POLLOUT, deadline);
      if (ev == 0) {
        ::freeaddrinfo(res);
        throw TimeoutError("connecting to PS shard " + where + " timed out");
      }
      int err = 0;
      socklen_t len = sizeof(err);
      ::getsockopt(s.fd(), SOL_SOCKET, SO_ERROR, &err, &len);
      r = err == 0 ? 0 : -1;
      errno = err;
    }
    if (r == 0) {
      SetNonBlocking(s.fd(), false);
      SetNoDelay(s.fd());
      ::freeaddrinfo(res);
      return s;
    }
    last_error = Errno(errno);
  }
  ::freeaddrinfo(res);
  throw TransportError("cannot connect to PS shard " + where + ": " + last_error);
}

int ListenTcp(const std::string& host, uint16_t port, int backlog, uint16_t* bound_port) {
  const std::string where = host + ":" + std::to_string(port);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  const std::string port_text = std::to_string(port);
  const int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), port_text.c_str(), &hints, &res);
  if (rc != 0) throw ValueError("cannot resolve listen address " + where + ": " + gai_strerror(rc));
  std::string last_error = "no address";
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      last_error = Errno(errno);
      continue;
    }
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && ::listen(fd, backlog) == 0) {
      sockaddr_storage ss{};
      socklen_t len = sizeof(ss);
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
      *bound_port = ss.ss_family == AF_INET6
                        ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                        : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
      ::freeaddrinfo(res);
      return fd;
    }
    last_error = Errno(errno);
    ::close(fd);
  }
  ::freeaddrinfo(res);
  throw IOError("cannot listen on " + where + ": " + last_error);
}

Listener::Listener(const std::string& host, uint16_t port) : host_(host) {
  const int fd = ListenTcp(host, port, 128, &port_);
  SetNonBlocking(fd, true);
  if (::pipe2(wake_, O_CLOEXEC | O_NONBLOCK) != 0) {
    const int err = errno;
    ::close(fd);
    throw IOError("pipe: " + Errno(err));
  }
  fd_ = fd;
}

Listener::~Listener() {
  Close();
  if (fd_ >= 0) ::close(fd_);
  if (wake_[0] >= 0) ::close(wake_[0]);
  if (wake_[1] >= 0) ::close(wake_[1]);
}

void Listener::Close() {
  if (closed_.exchange(true)) return;
  const uint8_t b = 1;
  [[maybe_unused]] ssize_t n = ::write(wake_[1], &b, 1);
  if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
}

Socket Listener::Accept(int timeout_ms, std::string* peer, bool nonblocking) {
  if (closed_.load()) return Socket();
  pollfd p[2] = {{fd_, POLLIN, 0}, {wake_[0], POLLIN, 0}};
  const int rc = ::poll(p, 2, timeout_ms);
  if (rc <= 0 || (p[1].revents & POLLIN) || closed_.load()) return Socket();
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  const int c = ::accept4(fd_, reinterpret_cast<sockaddr*>(&ss), &len,
                          SOCK_CLOEXEC | (nonblocking ? SOCK_NONBLOCK : 0));
  if (c < 0) return Socket();
  SetNoDelay(c);
  if (peer != nullptr) *peer = AddressText(ss);
  return Socket(c);
}

// ---- blocking reads and writes ----------------------------------------------------------------

void WriteAllV(int fd, struct iovec* iov, int iovcnt, const std::string& peer) {
  while (iovcnt > 0) {
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(iovcnt);
    const ssize_t n = ::sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        throw TransportError("write to " + peer + " made no progress within the timeout (the "
                             "peer does not read)");
      }
      throw TransportError("write to " + peer + " failed: " + Errno(errno));
    }
    size_t left = static_cast<size_t>(n);
    while (iovcnt > 0 && left >= iov->iov_len) {
      left -= iov->iov_len;
      ++iov;
      --iovcnt;
    }
    if (iovcnt > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + left;
      iov->iov_len -= left;
    }
  }
}

void WriteAll(int fd, const void* data, size_t len, const std::string& peer) {
  struct iovec iov{const_cast<void*>(data), len};
  WriteAllV(fd, &iov, 1, peer);
}

bool ReadFull(int fd, void* data, size_t len, bool eof_ok, const std::string& peer) {
  auto* p = static_cast<char*>(data);
  size_t got = 0;
  while (got < len) {
    const ssize_t n = ::recv(fd, p + got, len - got, 0);
    if (n > 0) {
      got += static_cast<size_t>(n);
      continue;
    }
    if (n == 0) {
      if (got == 0 && eof_ok) return false;
      throw TransportError(peer + " closed the connection in the middle of a frame");
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      throw TimeoutError("no data from " + peer + " within the receive timeout");
    }
    throw TransportError("read from " + peer + " failed: " + Errno(errno));
  }
  return true;
}

FrameReader::FrameReader(int fd, std::string peer, size_t capacity)
    : fd_(fd), peer_(std::move(peer)), cap_(capacity < 1024 ? 1024 : capacity),
      buf_(new uint8_t[cap_]) {}

bool FrameReader::Read(void* data, size_t len, bool eof_ok) {
  auto* out = static_cast<uint8_t*>(data);
  size_t got = std::min(len, end_ - begin_);
  if (got) {
    std::memcpy(out, buf_.get() + begin_, got);
    begin_ += got;
  }
  if (got == len) return true;
  begin_ = end_ = 0;  // the buffer is empty here
  const size_t rest = len - got;
  if (rest > cap_ / 2) {
    // Large: straight into the destination (no copy through the buffer).
    if (!ReadFull(fd_, out + got, rest, eof_ok && got == 0, peer_)) return false;
    return true;
  }
  // Small: fill the buffer with whatever the socket has (at least `rest` bytes).
  while (end_ < rest) {
    const ssize_t n = ::recv(fd_, buf_.get() + end_, cap_ - end_, 0);
    if (n > 0) {
      end_ += static_cast<size_t>(n);
      continue;
    }
    if (n == 0) {
      if (got == 0 && end_ == 0 && eof_ok) return false;
      throw TransportError(peer_ + " closed the connection in the middle of a frame");
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      throw TimeoutError("no data from " + peer_ + " within the receive timeout");
    }
    throw TransportError("read from " + peer_ + " failed: " + Errno(errno));
  }
  std::memcpy(out + got, buf_.get(), rest);
  begin_ = rest;
  return true;
}

// ---- non-blocking reads and writes ------------------------------------------------------------

void SendAll(int fd, const void* data, size_t len, Deadline deadline, const std::string& peer) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (len > 0) {
    const ssize_t n = ::send(fd, p, len, MSG_NOSIGNAL);
    if (n > 0) {
      p += n;
      len -= static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (PollOne(fd, POLLOUT, deadline) == 0) {
        throw TimeoutError("sending to " + peer + " timed out on the control connection");
      }
      continue;
    }
    throw TransportError("control connection to " + peer + " broke: " + Errno(errno));
  }
}

void RecvAll(int fd, void* data, size_t len, Deadline deadline, const std::string& peer) {
  auto* p = static_cast<uint8_t*>(data);
  while (len > 0) {
    const ssize_t n = ::recv(fd, p, len, 0);
    if (n > 0) {
      p += n;
      len -= static_cast<size_t>(n);
      continue;
    }
    if (n == 0) throw TransportError("control connection to " + peer + " closed by the peer");
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (PollOne(fd, POLLIN, deadline) == 0) {
        throw TimeoutError("no answer from " + peer + " on the control connection within the timeout");
      }
      continue;
    }
    throw TransportError("control connection to " + peer + " broke: " + Errno(errno));
  }
}

}  // namespace bagpipe::transport
