// TcpConnection: one client connection of a TcpShardServer (tcp_server.h), driven by the
// server's EventLoop. It reads frames non-blockingly (header, then body straight into a
// RecvBuffer the handler may take over), hands each complete frame to the FrameHandler, and
// writes replies without blocking: at once when the socket takes them, else queued and
// flushed when the socket is writable again.
//
// Lifecycle: reading -> closing (no more frames read; queued replies flushed, bounded) ->
// lingering (FIN sent; what the peer still sends is read off, so closing with unread input
// cannot reset the connection under the last reply) -> removed. A Kill (shed, deadline,
// stop) skips straight to removed.
//
// Thread safety: the read side, the phase and the ServerLink authentication fields belong to
// the thread running OnEvents (one at a time, EventLoop invariant 1). Send, Kill and the
// accessors are thread-safe; mu_ guards the socket's write side and the reply queue and is a
// leaf apart from EventLoop::AddInterest.
//
// Invariants:
//   1. Replies leave in Send order: a send goes straight to the socket only when nothing is
//      queued; queued bytes are written under mu_ in order.
//   2. FrameHandler::LinkClosed runs exactly once, when reading ends (after the last
//      HandleFrame), whatever ends it.
//   3. The descriptor is closed in OnRemoved only, under mu_, after which Send returns false
//      and Kill does nothing.
#pragma once

#include <sys/epoll.h>

#include <atomic>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/deadline.h"
#include "protocol/wire.h"
#include "server/event_loop.h"
#include "transport/frame_handler.h"
#include "transport/recv_buffer.h"

namespace bagpipe::server {

// What a connection reports to, and needs from, its server.
class TcpConnectionOwner {
 public:
  virtual ~TcpConnectionOwner() = default;
  // The handler every request frame goes to.
  virtual transport::FrameHandler& shard() = 0;
  // Reply bytes a connection may queue unsent; beyond it the client is stuck and dropped.
  virtual size_t max_queued_reply_bytes() const = 0;
  // Counters: request frames and bytes read, reply bytes written (any loop thread).
  virtual void CountIn(size_t frames, size_t bytes) = 0;
  virtual void CountOut(size_t bytes) = 0;
  // Connection `id` completed its Hello (once per connection).
  virtual void ConnectionAuthenticated(uint64_t id) = 0;
  // A connection from `peer` was closed for a protocol violation.
  virtual void ConnectionViolated(const std::string& peer) = 0;
  // Connection `id` left the loop (once per connection, after its last event).
  virtual void ConnectionRemoved(uint64_t id) = 0;
};

class TcpConnection : public transport::ServerLink,
                      public EventLoop::Handler,
                      public std::enable_shared_from_this<TcpConnection> {
 public:
  // Takes ownership of fd (non-blocking). `owner` outlives the connection's registration.
  TcpConnection(TcpConnectionOwner* owner, uint64_t id, int fd, std::string peer);
  ~TcpConnection() override;

  // REQUIRES: called once, right after the registration was added to the loop.
  void Attach(EventLoop* loop, std::shared_ptr<EventLoop::Registration> reg);

  // ---- transport::ServerLink -----------------------------------------------------------
  bool Send(protocol::wire::MsgType type, protocol::wire::Status status, uint64_t tag,
            uint32_t slot, const void* fixed, size_t fixed_len, size_t payload_len,
            const transport::PayloadFill& fill) override;
  // "tcp <peer>", for log lines.
  std::string Describe() const override { return "tcp " + peer_; }

  // ---- EventLoop::Handler -----------------------------------------------------------------
  uint32_t OnEvents(uint32_t events) override;
  void OnRemoved() override;

  // Closes the connection from any thread, without flushing (shed, deadline, stop).
  void Kill();

  // As accepted: the server's id for it and the client's address; authed() once its Hello
  // succeeded (any thread).
  uint64_t id() const { return id_; }
  const std::string& peer() const { return peer_; }
  bool authed() const { return authed_.load(std::memory_order_acquire); }
  // When a byte last arrived (or the connection was accepted).
  Clock::time_point last_received() const;
  // True if a complete Hello frame waits unread in the socket (the connection is about to
  // authenticate: Admission spares it). Any thread.
  bool HelloWaiting() const;
  // True while closing or lingering past its bound (the tick then kills it).
  bool overdue(Clock::time_point now) const;

 private:
  // A growable byte buffer that does not zero-fill on growth (replies of many MB).
  struct Buffer {
    std::unique_ptr<uint8_t[]> data;
    size_t cap = 0;
    size_t len = 0;
    size_t sent = 0;  // bytes already written
    void Reserve(size_t n);
  };
  enum class Phase : uint8_t { kReading, kClosing, kLinger };
  enum class ReadEnd : uint8_t { kMore, kAgain, kEof, kViolation, kError };

  ReadEnd ReadFrames();
  ReadEnd Dispatch();
  // Ends reading (invariant 2); replies queued so far still go out.
  void EndReading();
  // Writes queued bytes until the socket is full. False: the socket broke.
  bool Flush();
  // Reads off and drops input (closing / lingering). True once the peer closed or enough
  // was read.
  bool Discard();
  bool SendBytes(const uint8_t* bytes, size_t total, Buffer buf);
  Buffer TakeBuffer(size_t need);
  void PoolLocked(Buffer b);
  void Touch();

  TcpConnectionOwner* const owner_;
  const uint64_t id_;
  const std::string peer_;
  std::atomic<bool> kill_{false};
  std::atomic<bool> authed_{false};
  std::atomic<bool> hello_read_{false};  // a whole first frame was read (being handled)
  std::atomic<int64_t> last_rx_;          // Clock ticks
  std::atomic<int64_t> phase_deadline_{0};  // closing / lingering bound, Clock ticks; 0: none

  // ---- the handler thread -------------------------------------------------------------------
  Phase phase_ = Phase::kReading;
  bool left_ = false;  // LinkClosed ran
  uint8_t head_[protocol::wire::kHeaderBytes];
  size_t head_got_ = 0;
  bool in_body_ = false;
  protocol::wire::FrameHeader header_{};
  transport::RecvBuffer body_;  // a commit chunk may take it (and give another back)
  size_t body_got_ = 0;
  size_t discarded_ = 0;

  // ---- shared ---------------------------------------------------------------------------------
  mutable std::mutex mu_;  // guards everything below
  int fd_;
  EventLoop* loop_ = nullptr;
  std::shared_ptr<EventLoop::Registration> reg_;
  std::list<Buffer> queue_;
  size_t queued_bytes_ = 0;
  std::vector<Buffer> pool_;
  size_t pool_bytes_ = 0;
  bool closed_ = false;  // no more replies accepted
  static constexpr size_t kPoolBuffers = 16;
  static constexpr size_t kSmallFrame = 256;
  static constexpr size_t kPoolBytes = size_t{64} << 20;
};

}  // namespace bagpipe::server
