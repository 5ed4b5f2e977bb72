#include "transport/ucx_socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "common/errors.h"

namespace bagpipe::transport::ucx {
namespace {

std::string Errno(int e) { return std::strerror(e); }

void SetNonBlocking(int fd) {
  const int flags = fcntl(fd, F_GETFL, 0);
  fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

// Waits for `events` on fd until the deadline. Returns revents; 0 on timeout.
short PollOne(int fd, short events, Deadline deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int ms = MillisLeft(deadline);
    const int rc = poll(&p, 1, ms);
    if (rc > 0) return p.revents;
    if (rc == 0) {
      if (Clock::now() >= deadline) return 0;
      continue;
    }
    if (errno != EINTR) throw TransportError("poll on control connection: " + Errno(errno));
  }
}

}  // namespace

Socket& Socket::operator=(Socket&& o) noexcept {
  if (this != &o) {
    Close();
    fd_ = o.fd_;
    o.fd_ = -1;
  }
  return *this;
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

Socket ConnectTcp(const std::string& host, uint16_t port, Deadline deadline) {
  const std::string peer = host + ":" + std::to_string(port);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int gai = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (gai != 0) {
    throw TransportError("cannot resolve PS shard address " + peer + ": " + gai_strerror(gai));
  }
  std::string last_error = "no address";
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    Socket s(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
    if (!s.valid()) {
      last_error = Errno(errno);
      continue;
    }
    SetNonBlocking(s.fd());
    const int one = 1;
    setsockopt(s.fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    int rc = ::connect(s.fd(), ai->ai_addr, ai->ai_addrlen);
    if (rc != 0 && errno != EINPROGRESS) {
      last_error = Errno(errno);
      continue;
    }
    if (rc != 0) {
      const short ev = PollOne(s.fd(), POLLOUT, deadline);
      if (ev == 0) {
        freeaddrinfo(res);
        throw TimeoutError("connecting to PS shard " + peer + " timed out");
      }
      int err = 0;
      socklen_t len = sizeof(err);
      getsockopt(s.fd(), SOL_SOCKET, SO_ERROR, &err, &len);
      if (err != 0) {
        last_error = Errno(err);
        continue;
      }
    }
    freeaddrinfo(res);
    return s;
  }
  freeaddrinfo(res);
  throw TransportError("cannot connect to PS shard " + peer + ": " + last_error);
}

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

Listener::Listener(const std::string& host, uint16_t port) : host_(host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  const int gai = getaddrinfo(host.empty() ? nullptr : host.c_str(), std::to_string(port).c_str(),
                              &hints, &res);
  if (gai != 0) throw TransportError("cannot resolve listen address " + host + ": " + gai_strerror(gai));
  int fd = -1;
  std::string err = "no address";
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      err = Errno(errno);
      continue;
    }
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && ::listen(fd, 128) == 0) break;
    err = Errno(errno);
    ::close(fd);
    fd = -1;
  }
  freeaddrinfo(res);
  if (fd < 0) {
    throw TransportError("cannot listen on " + host + ":" + std::to_string(port) + ": " + err);
  }
  SetNonBlocking(fd);
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
  port_ = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                         : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  if (pipe2(wake_, O_CLOEXEC | O_NONBLOCK) != 0) {
    ::close(fd);
    throw TransportError("pipe: " + Errno(errno));
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

Socket Listener::Accept(int timeout_ms, std::string* peer) {
  const int fd = fd_;
  if (closed_.load()) return Socket();
  pollfd p[2] = {{fd, POLLIN, 0}, {wake_[0], POLLIN, 0}};
  const int rc = poll(p, 2, timeout_ms);
  if (rc <= 0 || (p[1].revents & POLLIN) || closed_.load()) return Socket();
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  const int c = ::accept4(fd, reinterpret_cast<sockaddr*>(&ss), &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
  if (c < 0) return Socket();
  const int one = 1;
  setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  if (peer != nullptr) {
    char host[INET6_ADDRSTRLEN] = {0};
    uint16_t port = 0;
    if (ss.ss_family == AF_INET6) {
      auto* a = reinterpret_cast<sockaddr_in6*>(&ss);
      inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
      port = ntohs(a->sin6_port);
    } else {
      auto* a = reinterpret_cast<sockaddr_in*>(&ss);
      inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
      port = ntohs(a->sin_port);
    }
    *peer = std::string(host) + ":" + std::to_string(port);
  }
  return Socket(c);
}

}  // namespace bagpipe::transport::ucx
