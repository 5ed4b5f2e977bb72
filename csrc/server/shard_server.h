// ShardServer: serves one PSShard over TCP. It runs on background native threads, so the
// same class backs the standalone `torchrec-bagpipe-ps` program and a shard hosted inside a
// trainer process that other ranks reach over loopback.
//
// Per connection: a reader thread (reads frames, hands them to PSShard::HandleFrame) and a
// writer thread (drains the connection's reply queue), so a shard thread that completes a
// step never blocks on a slow client's socket.
//
// Thread safety: every public method is thread-safe.
// Invariants:
//   1. Before a connection authenticates, it may send only a Hello of bounded size within
//      handshake_timeout; anything else closes it. Frames are never trusted: a malformed
//      header closes the connection, a malformed body gets an error reply; nothing a peer
//      sends can crash the server or make it allocate more than max_frame_bytes per frame.
//   2. A connection's socket is closed only after both of its threads have exited, so a
//      descriptor is never reused under a running thread.
//   3. At most max_connections connections are open; more are accepted and closed at once.
//   4. After Stop() returns, no thread of the server runs and every connection is closed
//      (their ranks left their sessions through PSShard::LinkClosed).
#pragma once

#include <atomic>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "commit/ps_shard.h"
#include "transport/server_stats.h"

namespace bagpipe::server {

struct ServerOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;               // 0: the kernel picks one (see port())
  std::string job_token;           // clients must present it in their Hello
  double handshake_timeout = 10.0; // seconds a new connection has to authenticate
  size_t max_connections = 1024;
  size_t max_queued_reply_bytes = size_t{1} << 30;  // per connection; beyond: the client is stuck
};

using transport::ServerStats;

class ShardServer {
 public:
  // Binds, listens and starts accepting. Throws IOError / ValueError.
  ShardServer(std::shared_ptr<commit::PSShard> shard, ServerOptions options);
  ~ShardServer();  // Stop(0)
  ShardServer(const ShardServer&) = delete;
  ShardServer& operator=(const ShardServer&) = delete;

  const std::string& host() const { return options_.host; }
  uint16_t port() const { return port_; }
  const std::shared_ptr<commit::PSShard>& shard() const { return shard_; }

  // Stops accepting, then waits up to drain_timeout seconds for clients to close their
  // connections, then closes the rest and joins every thread. Idempotent.
  void Stop(double drain_timeout);
  bool stopped() const { return stopped_.load(); }
  ServerStats stats();

 private:
  class Connection;
  void AcceptLoop();
  void ReapLocked(bool all);
  void NoteViolation(const std::string& peer);

  const std::shared_ptr<commit::PSShard> shard_;
  const ServerOptions options_;
  int listen_fd_ = -1;
  uint16_t port_ = 0;
  std::atomic<bool> stop_accepting_{false};
  std::atomic<bool> stopped_{false};
  std::thread acceptor_;

  std::atomic<uint64_t> accepted_{0};
  std::atomic<uint64_t> refused_{0};
  std::atomic<uint64_t> frames_{0};
  std::atomic<uint64_t> bytes_in_{0};
  std::atomic<uint64_t> bytes_out_{0};
  std::atomic<uint64_t> closed_by_server_{0};

  std::mutex stop_mu_;  // serializes Stop
  std::mutex mu_;       // guards conns_ (never held by a connection's own threads)
  std::list<std::shared_ptr<Connection>> conns_;
};

}  // namespace bagpipe::server
