// The shard side of the UCX transport's bootstrap: a TCP listener whose accepted control
// connections run the ucx_wire.h handshake (Endpoint::Accept), each on its own short-lived
// handshake thread, so a slow or hostile client never delays another.
//
// Thread safety: all methods are thread-safe. Callbacks run on handshake threads, concurrently
// for different connections.
//
// Invariants:
//   1. A handshake never outlives options.handshake_timeout; garbage, a wrong token or
//      oversized ring parameters get a BootReply saying why (when the client still listens)
//      and never reach on_connection.
//   2. on_connection runs once per accepted endpoint, before its client may send a frame; the
//      returned handlers own what they capture; the callback's caller keeps the endpoint.
//   3. After Stop() returns no callback runs and no thread of the acceptor is left.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "transport/socket.h"
#include "transport/ucx_endpoint.h"

namespace bagpipe::server {

struct UcxAcceptorOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;  // 0: an ephemeral port
  transport::ucx::UcxConfig config;
  transport::ucx::Endpoint::AcceptLimits limits;
  double handshake_timeout = 10.0;  // seconds
};

class UcxAcceptor {
 public:
  // false refuses the client; *why (preset to "wrong job token") is what it is told.
  using Authorize = std::function<bool(const std::string& token, std::string* why)>;
  // Receives the new endpoint and returns its handlers; keeping the endpoint is the
  // callee's business (the acceptor drops its reference when the handshake ends).
  using OnConnection = std::function<transport::ucx::EndpointHandlers(
      const std::shared_ptr<transport::ucx::Endpoint>&)>;

  // Binds and starts accepting. Throws ValueError / IOError if the address does not resolve /
  // cannot be bound (transport/socket.h ListenTcp), TransportError if UCX cannot initialise
  // with options.config.
  UcxAcceptor(UcxAcceptorOptions options, Authorize authorize, OnConnection on_connection);
  ~UcxAcceptor();
  UcxAcceptor(const UcxAcceptor&) = delete;
  UcxAcceptor& operator=(const UcxAcceptor&) = delete;

  uint16_t port() const { return listener_.port(); }
  const std::string& host() const { return listener_.host(); }
  // Stops accepting and joins every handshake thread. Idempotent.
  void Stop();

  uint64_t accepted() const { return accepted_.load(); }
  uint64_t refused() const { return refused_.load(); }
  // Why the most recent failed handshake failed ("" if none did).
  std::string last_error() const;

 private:
  void AcceptLoop();
  void Reap(bool all);

  const UcxAcceptorOptions options_;
  const Authorize authorize_;
  const OnConnection on_connection_;
  std::shared_ptr<transport::ucx::Context> context_;
  transport::Listener listener_;
  std::thread accept_thread_;
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> accepted_{0};
  std::atomic<uint64_t> refused_{0};

  struct Handshake {
    std::thread thread;
    std::atomic<bool> done{false};
  };
  mutable std::mutex mu_;  // guards every field below
  std::list<std::unique_ptr<Handshake>> handshakes_;
  std::string last_error_;
};

}  // namespace bagpipe::server
