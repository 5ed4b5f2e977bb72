// UcxShardServer: serves one shard (a transport::FrameHandler, in practice a PSShard) over
// the rdma (UCX) backend — the shard side of transport/ucx_channel.h. Clients bootstrap on a
// TCP control port (ucx_acceptor.h); each connection gets its own UCX worker and registered
// slot ring, and its frames are handed to FrameHandler::HandleFrame straight from the ring
// slot they were written into (no copy).
//
// Thread safety: every public method is thread-safe. Each connection's frames are handled
// on its endpoint's progress thread, one at a time, in the order the client posted them;
// replies (ServerLink::Send) may come from any thread.
//
// Invariants:
//   1. A frame is handed to the shard only if its header is well formed and names the slot
//      and tag its doorbell announced; otherwise the connection is closed (the client sees a
//      torn connection), as the TCP server does for a malformed header.
//   2. A reply payload is written by the shard's fill callback into a pooled buffer that
//      stays alive until UCX finished sending it.
//   3. Connections are closed (endpoint joined) only off their own progress thread, by the
//      server's reaper; the handler's LinkClosed runs exactly once per connection.
//   4. After Stop() returns, no thread of the server runs and every connection is closed.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "server/server_stats.h"
#include "server/ucx_acceptor.h"
#include "transport/frame_handler.h"

namespace bagpipe::server {

namespace ucx = transport::ucx;

struct UcxServerOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;                  // 0: an ephemeral port (see port())
  std::string job_token;
  bool allow_no_token = false;        // as TcpServerOptions: no token off loopback needs it
  ucx::UcxConfig config;              // empty fields: UCX_TLS / UCX_NET_DEVICES
  double handshake_timeout = 10.0;    // seconds from accept to the bootstrap reply (absolute)
  size_t max_connections = 1024;      // established connections
  size_t max_unauthenticated = 256;   // connections still bootstrapping (ucx_acceptor.h)
  size_t max_unauthenticated_per_host = 32;
  size_t io_threads = 2;              // bootstrap loop threads
  size_t progress_threads = 2;        // threads driving every established connection
  size_t max_ring_bytes = size_t{1} << 30;  // per connection
};

class UcxShardServer {
 public:
  // Binds the control port and starts accepting. REQUIRES: shard != nullptr; a job token, a
  // loopback host or allow_no_token (ValueError otherwise). Throws ValueError / IOError
  // (the address does not resolve / cannot be bound), TransportError (UCX cannot initialise).
  UcxShardServer(std::shared_ptr<transport::FrameHandler> shard, UcxServerOptions options);
  ~UcxShardServer();  // Stop(0)
  UcxShardServer(const UcxShardServer&) = delete;
  UcxShardServer& operator=(const UcxShardServer&) = delete;

  // Where the control port listens (port: the bound one), and the handler it serves.
  const std::string& host() const { return options_.host; }
  uint16_t port() const { return acceptor_->port(); }
  const std::shared_ptr<transport::FrameHandler>& shard() const { return shard_; }

  // Stops accepting, waits up to drain_timeout seconds for clients to close, then closes the
  // rest (they see the shard say goodbye) and joins every thread. Idempotent.
  void Stop(double drain_timeout);
  bool stopped() const { return stopped_.load(); }
  ServerStats stats();

 private:
  class Link;
  struct Conn {
    std::shared_ptr<ucx::Endpoint> endpoint;
    std::shared_ptr<Link> link;
    bool dead = false;
  };

  ucx::EndpointHandlers Attach(const std::shared_ptr<ucx::Endpoint>& ep);
  void OnFrame(const std::shared_ptr<Link>& link, const ucx::RingFrame& f);
  // Closes a connection for a protocol violation (the endpoint fails; OnDead follows).
  void CloseLink(const std::shared_ptr<Link>& link, const std::string& why);
  void OnDead(Link* link);
  void ReaperLoop();

  const std::shared_ptr<transport::FrameHandler> shard_;
  const UcxServerOptions options_;
  std::shared_ptr<ucx::ProgressPool> progress_;  // drives every endpoint (ucx_progress.h)
  std::unique_ptr<UcxAcceptor> acceptor_;
  std::atomic<bool> stopped_{false};
  std::atomic<uint64_t> frames_{0};
  std::atomic<uint64_t> bytes_in_{0};
  std::atomic<uint64_t> closed_by_server_{0};
  std::atomic<uint64_t> refused_full_{0};

  std::mutex stop_mu_;  // serializes Stop
  std::mutex mu_;       // guards conns_, reaper_stop_, bytes_out_
  std::condition_variable cv_;
  std::list<Conn> conns_;
  bool reaper_stop_ = false;
  uint64_t bytes_out_ = 0;
  std::thread reaper_;
};

}  // namespace bagpipe::server
