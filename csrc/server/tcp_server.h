// TcpShardServer: serves one shard (a transport::FrameHandler, in practice a PSShard) over
// TCP. It runs on background native threads, so the same class backs the standalone
// `torchrec-bagpipe-ps` program and a shard hosted inside a trainer process that other ranks
// reach over loopback.
//
// Per connection: a reader thread (reads frames, hands them to FrameHandler::HandleFrame) and a
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
//      (their ranks left their sessions through FrameHandler::LinkClosed).
#pragma once

#include <atomic>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "server/server_stats.h"
#include "transport/frame_handler.h"
#include "transport/socket.h"

namespace bagpipe::server {

struct TcpServerOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;               // 0: the kernel picks one (see port())
  std::string job_token;           // clients must present it in their Hello
  double handshake_timeout = 10.0; // seconds a new connection has to authenticate
  size_t max_connections = 1024;
  size_t max_queued_reply_bytes = size_t{1} << 30;  // per connection; beyond: the client is stuck
};

class TcpShardServer {
 public:
  // Binds, listens and starts accepting. Throws IOError / ValueError.
  TcpShardServer(std::shared_ptr<transport::FrameHandler> shard, TcpServerOptions options);
  ~TcpShardServer();  // Stop(0)
  TcpShardServer(const TcpShardServer&) = delete;
  TcpShardServer& operator=(const TcpShardServer&) = delete;

  const std::string& host() const { return options_.host; }
  uint16_t port() const { return listener_.port(); }

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

  const std::shared_ptr<transport::FrameHandler> shard_;
  const TcpServerOptions options_;
  transport::Listener listener_;
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
