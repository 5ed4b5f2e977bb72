// TcpShardServer: serves one shard (a transport::FrameHandler, in practice a PSShard) over
// TCP. It runs on background native threads, so the same class backs the standalone
// `torchrec-bagpipe-ps` program and a shard hosted inside a trainer process that other ranks
// reach over loopback.
//
// Event-driven (server/event_loop.h): a fixed pool of io_threads loop threads shares one
// epoll set holding the listener and every connection; a connection is a registration and a
// few hundred bytes until it sends something, so thousands of idle (or hostile) connections
// cost memory, not threads. Reads and writes are non-blocking; a frame is handed to
// FrameHandler::HandleFrame once complete, on the loop thread that read it; replies are
// written at once when the socket takes them and queued otherwise (flushed on EPOLLOUT),
// so a shard thread that completes a step never blocks on a slow client's socket.
//
// Thread safety: every public method is thread-safe.
// Invariants:
//   1. Before a connection authenticates it may send only a Hello of bounded size, within
//      handshake_timeout of being accepted (an absolute deadline: a byte a second does not
//      extend it); anything else closes it. Frames are never trusted: a malformed header
//      closes the connection, a malformed body gets an error reply; nothing a peer sends can
//      crash the server or make it allocate more than max_frame_bytes per frame.
//   2. Admission (server/admission.h): at most max_unauthenticated connections have not
//      authenticated, at most max_unauthenticated_per_host of them from one address; a new
//      connection sheds the oldest of those instead of being refused, so a legitimate client
//      gets in during a flood. At most max_connections connections in all; past that, when
//      every one is authenticated, new ones are closed at once.
//   3. An authenticated connection from which nothing arrives for idle_timeout seconds (> 0)
//      is closed (clients send keep-alive Pings well within it).
//   4. A connection's descriptor is closed only after it left the epoll set and its last
//      handler returned (EventLoop invariant 2); Send on a closed connection returns false.
//   5. After Stop() returns, no thread of the server runs and every connection is closed
//      (their ranks left their sessions through FrameHandler::LinkClosed, once each).
//   6. The job token never appears in a log line or an error text.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "server/admission.h"
#include "server/event_loop.h"
#include "server/server_stats.h"
#include "server/tcp_connection.h"
#include "transport/frame_handler.h"

namespace bagpipe::server {

struct TcpServerOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;               // 0: the kernel picks one (see port())
  std::string job_token;           // clients must present it in their Hello
  // An empty job_token on an address other than loopback is refused (ValueError) unless
  // this is set: anyone who reaches the port could then read and write every table.
  bool allow_no_token = false;
  double handshake_timeout = 10.0; // seconds from accept to a completed Hello (absolute)
  double idle_timeout = 300.0;     // seconds an authenticated connection may stay silent; 0: off
  size_t max_connections = 1024;
  size_t max_unauthenticated = 256;
  size_t max_unauthenticated_per_host = 32;
  size_t io_threads = 4;           // loop threads serving every connection
  size_t max_queued_reply_bytes = size_t{1} << 30;  // per connection; beyond: the client is stuck
};

class TcpShardServer {
 public:
  // Binds, listens and starts serving. REQUIRES: shard != nullptr; a job token, a loopback
  // host or allow_no_token (ValueError otherwise). Throws IOError / ValueError (a bad option,
  // naming it).
  TcpShardServer(std::shared_ptr<transport::FrameHandler> shard, TcpServerOptions options);
  ~TcpShardServer();  // Stop(0)
  TcpShardServer(const TcpShardServer&) = delete;
  TcpShardServer& operator=(const TcpShardServer&) = delete;

  // Where it listens (port: the bound one, also when options.port was 0).
  const std::string& host() const { return options_.host; }
  uint16_t port() const { return port_; }

  // Stops accepting, then waits up to drain_timeout seconds for clients to close their
  // connections, then closes the rest and stops every thread. Idempotent.
  void Stop(double drain_timeout);
  bool stopped() const { return stopped_.load(); }
  ServerStats stats();
  size_t threads() const { return loop_ ? loop_->threads() : 0; }

 private:
  class Owner;
  class Acceptor;
  friend class Owner;
  friend class Acceptor;

  // The listener's handler: accepts until the backlog is empty (or a batch is done).
  uint32_t AcceptBatch();
  void Admit(int fd);
  // A connection authenticated (Admission bookkeeping).
  void OnAuthenticated(uint64_t id);
  // A connection's registration is gone: forget it.
  void OnRemoved(uint64_t id);
  void Tick();
  void NoteViolation(const std::string& peer);
  void Note(std::atomic<uint64_t>& counter, const std::string& what);

  const std::shared_ptr<transport::FrameHandler> shard_;
  const TcpServerOptions options_;
  std::unique_ptr<TcpConnectionOwner> owner_;  // what every connection reports to
  uint16_t port_ = 0;
  int listen_fd_ = -1;
  std::unique_ptr<EventLoop> loop_;
  std::shared_ptr<EventLoop::Registration> listener_;
  std::atomic<bool> accepting_{true};
  std::atomic<bool> stopped_{false};
  Clock::time_point accept_paused_until_{};  // guarded by mu_

  std::atomic<uint64_t> accepted_{0};
  std::atomic<uint64_t> refused_{0};
  std::atomic<uint64_t> shed_{0};
  std::atomic<uint64_t> handshake_timeouts_{0};
  std::atomic<uint64_t> idle_timeouts_{0};
  std::atomic<uint64_t> frames_{0};
  std::atomic<uint64_t> bytes_in_{0};
  std::atomic<uint64_t> bytes_out_{0};
  std::atomic<uint64_t> closed_by_server_{0};

  std::mutex stop_mu_;  // serializes Stop
  std::mutex mu_;       // guards conns_, admission_, next_id_ (a leaf: no callout under it)
  std::condition_variable cv_;  // conns_ shrank
  std::unordered_map<uint64_t, std::shared_ptr<TcpConnection>> conns_;
  Admission admission_;
  uint64_t next_id_ = 1;
};

}  // namespace bagpipe::server
