// The shard side of the UCX transport's bootstrap: a TCP listener whose accepted control
// connections run the ucx_wire.h handshake. Event-driven like the TCP server
// (server/event_loop.h, server/admission.h): a connection's bootstrap request is read
// without blocking on a small pool of loop threads, bounded as soon as its fixed part
// arrives, and only a complete request reaches Endpoint::Accept (a few milliseconds of UCX
// set-up on the loop thread). A slow or hostile client costs a registration, never a thread.
//
// Thread safety: all methods are thread-safe. Callbacks run on loop threads, concurrently for
// different connections.
//
// Invariants:
//   1. A handshake never outlives options.handshake_timeout from accept (an absolute
//      deadline); garbage, a wrong token or oversized ring parameters get a BootReply saying
//      why (when the client still listens) and never reach on_connection.
//   2. Connections still bootstrapping are bounded as the TCP server's unauthenticated ones
//      (options.admission): a new one sheds the oldest, so a legitimate client gets in
//      during a flood.
//   3. on_connection runs once per accepted endpoint, before its client may send a frame; the
//      returned handlers own what they capture; the callback's caller keeps the endpoint.
//   4. After Stop() returns no callback runs and no thread of the acceptor is left.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "server/admission.h"
#include "server/event_loop.h"
#include "transport/ucx_endpoint.h"

namespace bagpipe::server {

struct UcxAcceptorOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;  // 0: an ephemeral port
  transport::ucx::UcxConfig config;
  transport::ucx::Endpoint::AcceptLimits limits;
  double handshake_timeout = 10.0;  // seconds from accept to the reply (absolute)
  // max_connections bounds the connections still bootstrapping here (established ones are
  // the server's business).
  AdmissionLimits admission{256, 256, 32};
  size_t io_threads = 2;
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
  // Stop(), then the control port closes.
  ~UcxAcceptor();
  UcxAcceptor(const UcxAcceptor&) = delete;
  UcxAcceptor& operator=(const UcxAcceptor&) = delete;

  // Where the control port listens (port: the bound one, also when asked for 0).
  uint16_t port() const { return port_; }
  const std::string& host() const { return options_.host; }
  // Stops accepting and ends every handshake in progress. Idempotent.
  void Stop();

  // Counters since construction (any thread): handshakes that became endpoints, connections
  // refused (by admission or by the bootstrap), handshakes shed for the admission bounds and
  // past their timeout; then handshakes in progress now, and the loop threads.
  uint64_t accepted() const { return accepted_.load(); }
  uint64_t refused() const { return refused_.load(); }
  uint64_t shed() const { return shed_.load(); }
  uint64_t handshake_timeouts() const { return handshake_timeouts_.load(); }
  size_t bootstrapping() const;
  size_t threads() const { return loop_ ? loop_->threads() : 0; }
  // Why the most recent failed handshake failed ("" if none did).
  std::string last_error() const;

 private:
  class Listener;
  class Bootstrap;
  friend class Listener;
  friend class Bootstrap;

  uint32_t AcceptBatch();
  void Admit(int fd);
  void Finished(uint64_t id, bool accepted, const std::string& error);
  void Tick();

  const UcxAcceptorOptions options_;
  const Authorize authorize_;
  const OnConnection on_connection_;
  std::shared_ptr<transport::ucx::Context> context_;
  uint16_t port_ = 0;
  int listen_fd_ = -1;
  std::unique_ptr<EventLoop> loop_;
  std::shared_ptr<EventLoop::Registration> listener_;
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> accepted_{0};
  std::atomic<uint64_t> refused_{0};
  std::atomic<uint64_t> shed_{0};
  std::atomic<uint64_t> handshake_timeouts_{0};

  std::mutex stop_mu_;  // serializes Stop
  mutable std::mutex mu_;  // guards every field below (a leaf)
  Admission admission_;
  std::unordered_map<uint64_t, std::shared_ptr<Bootstrap>> boots_;
  uint64_t next_id_ = 1;
  Clock::time_point accept_paused_until_{};
  std::string last_error_;
};

}  // namespace bagpipe::server
