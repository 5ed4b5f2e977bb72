// The client side of the one transport interface between PS clients and PS shards. Every
// backend (local: in-process, tcp: sockets, ucx_*: RDMA through UCX) carries the frames of
// protocol/wire.h and differs only behind Channel (the shard side of a connection is
// frame_handler.h):
//
//   Channel     client side of one (client, shard) connection. It OWNS SLOT OWNERSHIP AND THE
//               IN-FLIGHT WINDOW: a request frame is staged into one of num_slots fixed-size
//               slot buffers (registered memory for RDMA), posted, and the slot returns to the
//               free list only after the request's reply (ACK or data) has been delivered and,
//               for data, materialised by the request (copied out of the slot, or received
//               straight into the request's sink). So at most num_slots requests are in
//               flight per channel, whatever the backend. Backends implement DoPost ("put the
//               packet of slot i"), DoFlush ("make posted packets visible / ring the
//               doorbell") and DoClose, and feed replies back through Expect/Complete.
//
// Thread safety:
//   Channel: AcquireSlot / SlotBuffer / Post / Flush / ReleaseUnposted are called by one
//   producer thread at a time (the client's worker); the receive path (Expect, ReplyBuffer,
//   Complete, DeliverNotification) runs on the backend's receive thread, or synchronously
//   inside DoPost (local backend), or on a shard thread that completes a deferred request.
//   Everything else is thread-safe. No Channel lock is held while calling a PendingRequest or
//   the notification handler, or while calling DoPost.
//
// Invariants:
//   1. A slot is in exactly one state: free, acquired (staging, not yet posted), or in flight
//      (posted, owned by exactly one PendingRequest until its reply or the channel's failure).
//   2. Each PendingRequest gets exactly one terminal callback (OnReply or OnFailure), after
//      which its slot is free; ReplySink, if called, is called before OnReply.
//   3. Once a channel failed, every in-flight request gets OnFailure with the channel's error
//      and every later AcquireSlot/Post throws TransportError with that error.
//   4. After Close() returns, the backend delivers nothing more and holds no thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "common/deadline.h"
#include "protocol/wire.h"

namespace bagpipe::transport {

// What kind of error a failed request carries; maps onto the Python exception raised.
enum class ErrorKind : uint8_t {
  kTransport = 0,  // TransportError (ConnectionError)
  kSession = 1,    // SessionError
  kValue = 2,      // ValueError
  kTimeout = 3,    // TimeoutError
  kInternal = 4,   // RuntimeError
  kShuttingDown = 5,  // ShuttingDownError (a TransportError): the shard is draining
  kStartStep = 6,     // StartStepError (a ValueError): the session's start step was refused
};

struct Error {
  ErrorKind kind = ErrorKind::kTransport;
  std::string message;
};

// The error kind a client raises for a reply status (ValueError for kInvalidArgument,
// SessionError for a failed, unopened or overloaded session, ...).
ErrorKind KindOfStatus(protocol::wire::Status status);
// Throws the bagpipe exception (common/errors.h) matching error.kind.
[[noreturn]] void ThrowError(const Error& error);

// A reply frame as the receive path hands it to a request: the header, the fixed body of
// its type and the bulk payload (rows, or an error text). Pointers are valid only during
// the callback.
struct Reply {
  protocol::wire::FrameHeader header;
  const uint8_t* fixed = nullptr;
  size_t fixed_len = 0;
  const uint8_t* payload = nullptr;
  size_t payload_len = 0;

  // The header's type and status as enums (unchecked: compare, do not switch exhaustively).
  protocol::wire::MsgType type() const {
    return static_cast<protocol::wire::MsgType>(header.type);
  }
  protocol::wire::Status status() const {
    return static_cast<protocol::wire::Status>(header.status);
  }
  // The error text of an kError / kNotifyFailed reply.
  std::string Text() const;
};

// The request occupying an in-flight slot. Implemented by the protocol layer (the client).
class PendingRequest {
 public:
  virtual ~PendingRequest() = default;
  // Where the reply's payload should land (payload_len bytes), or nullptr to receive it into
  // the slot's reply buffer. Lets a GET reply go straight into the caller's output tensor.
  virtual uint8_t* ReplySink(const Reply& head, size_t payload_len) {
    (void)head;
    (void)payload_len;
    return nullptr;
  }
  // The reply arrived (any status). Must not call back into the channel.
  virtual void OnReply(const Reply& reply) = 0;
  // The channel failed or closed before a reply arrived.
  virtual void OnFailure(const Error& error) = 0;

  // Claims the single terminal callback (invariant 2); used by Channel.
  bool Claim() { return !finished_.exchange(true); }

 private:
  std::atomic<bool> finished_{false};
};

// A request whose caller waits for the answer (Hello, Open, Close): records the reply's
// type, status, fixed body and error text, or the failure. Fields are guarded by mu and
// final once done is true.
class ReplyCapture : public PendingRequest {
 public:
  // Record the reply (type, status, a copy of the fixed body, a kError's text) or the
  // failure, then wake WaitUntil.
  void OnReply(const Reply& reply) override;
  void OnFailure(const Error& error) override;
  // Waits until the reply or failure arrived; false if the deadline passed first.
  bool WaitUntil(Deadline deadline);

  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  protocol::wire::MsgType type = protocol::wire::MsgType::kError;
  protocol::wire::Status status = protocol::wire::Status::kOk;
  std::vector<uint8_t> fixed;
  std::string text;
  std::optional<Error> failure;
};

// A borrowed byte range (a piece of a gathered frame).
struct ConstSpan {
  const uint8_t* data = nullptr;
  size_t len = 0;
};

struct ChannelOptions {
  uint32_t num_slots = 8;  // the in-flight window; REQUIRES: >= 1
  size_t slot_bytes = 0;   // capacity of each request slot (the largest frame); REQUIRES: > header
  double io_timeout = 120.0;  // seconds a blocking socket write may make no progress
  // tcp: a channel that has sent nothing for this many seconds sends a keep-alive Ping
  // (notification-style, no slot), so a server's idle_timeout never closes a live client;
  // 0: never. Set from ConnectOptions by ConnectChannel.
  double keepalive_interval = 30.0;
};

// How a channel to a remote shard is established (tcp, ucx; the local backend needs none).
struct ConnectOptions {
  std::string job_token;        // presented in the Hello; REQUIRES: <= wire::kMaxTokenBytes
  double connect_timeout = 30.0;  // seconds to connect and authenticate
  // tcp: keep-alive Ping after this many seconds without sending (ChannelOptions); keep it
  // well below the servers' idle_timeout (default 300 s). 0: never.
  double keepalive_interval = 30.0;
};

struct ChannelStats {
  uint64_t frames_sent = 0;
  uint64_t bytes_sent = 0;
  uint64_t frames_received = 0;
  uint64_t bytes_received = 0;
  uint64_t slot_waits = 0;  // AcquireSlot calls that had to wait for a reply (window full)
  uint64_t flushes = 0;
  // Filled by backends that have them (BackendStats); 0 elsewhere.
  uint64_t one_sided_writes = 0;  // rdma: frames written one-sided into the shard's slots
  uint64_t doorbells = 0;         // rdma: doorbell messages announcing written frames
};

class Channel {
 public:
  // REQUIRES: options.num_slots >= 1, options.slot_bytes > wire::kHeaderBytes (ValueError
  // otherwise).
  Channel(std::string peer, const ChannelOptions& options);
  // REQUIRES: the derived destructor called Close().
  virtual ~Channel();
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  // As constructed: who the shard is (for messages), the in-flight window, the slot size.
  const std::string& peer() const { return peer_; }
  uint32_t num_slots() const { return static_cast<uint32_t>(slots_.size()); }
  size_t slot_bytes() const { return slot_bytes_; }
  // The backend's name ("local", "tcp", ...).
  virtual const char* kind() const = 0;
  // The shard's identity as it announced itself (HelloOk), or what the backend knows.
  uint32_t remote_shard_id() const { return remote_shard_id_; }
  uint32_t remote_num_shards() const { return remote_num_shards_; }
  uint64_t remote_max_frame() const { return remote_max_frame_; }

  // on_notify: called for every notification frame (slot == kNoSlot); on_failure: called
  // once, when the channel fails or closes (after its in-flight requests got OnFailure).
  // REQUIRES: set before the first Post; neither may call back into the channel.
  void SetHandlers(std::function<void(const Reply&)> on_notify,
                   std::function<void(const Error&)> on_failure);

  // Waits until a slot is free (blocking while num_slots requests are in flight) and
  // acquires it. Throws TimeoutError at the deadline, TransportError if the channel failed,
  // SessionError if *cancel becomes true meanwhile (checked at least every 20 ms).
  uint32_t AcquireSlot(Deadline deadline, const std::atomic<bool>* cancel = nullptr);
  // The slot's frame buffer (slot_bytes). REQUIRES: the slot is acquired by the caller.
  uint8_t* SlotBuffer(uint32_t slot) { return slots_[slot].frame.get(); }
  // Returns an acquired slot that was not posted.
  void ReleaseUnposted(uint32_t slot);
  // Sends the frame staged in `slot` (frame_len bytes, header first; the channel writes the
  // header's slot, tag and job fields). `request` owns the slot until its terminal callback.
  // REQUIRES: slot acquired; frame_len <= slot_bytes. Throws TransportError if the channel
  // failed (the request then got OnFailure).
  void Post(uint32_t slot, size_t frame_len, std::shared_ptr<PendingRequest> request);
  // As Post, for a frame whose first head_len bytes are staged in `slot` and whose remaining
  // bytes are the n_extra pieces of `extra`, in order (borrowed: read only during the call).
  // A backend that can send from several buffers (CanGather) sends them as they are, with no
  // staging copy; otherwise the pieces are copied into the slot after the head first.
  // REQUIRES: as Post, with head_len + the pieces' bytes <= slot_bytes; n_extra <= 8.
  void PostGather(uint32_t slot, size_t head_len, const ConstSpan* extra, size_t n_extra,
                  std::shared_ptr<PendingRequest> request);
  // Makes every posted frame visible to the shard.
  void Flush();
  // Waits until no request is in flight. Throws TimeoutError at the deadline.
  void WaitIdle(Deadline deadline);
  // Requests posted and not yet answered.
  uint32_t in_flight() const;

  // Whether the channel failed (or was closed), and the first error.
  bool failed() const;
  Error error() const;
  // Closes the backend; requests still in flight fail with "channel closed". Idempotent.
  void Close();
  // Counters since construction (the backend's own ones included).
  ChannelStats stats() const;

 protected:
  // ---- backend hooks -------------------------------------------------------------------
  // Puts the packet of `slot` on its way. May deliver its reply synchronously (local).
  // Throws TransportError when the connection is broken.
  virtual void DoPost(uint32_t slot, const uint8_t* frame, size_t frame_len) = 0;
  // Whether DoPostGather sends pieces without staging them (the base copies them into the
  // slot and calls DoPost).
  virtual bool CanGather() const { return false; }
  // Puts a frame made of `head` (the slot's head_len staged bytes) then the pieces on its way.
  // Only called when CanGather(). Throws TransportError when the connection is broken.
  virtual void DoPostGather(uint32_t slot, const uint8_t* head, size_t head_len,
                            const ConstSpan* extra, size_t n_extra) {
    (void)slot;
    (void)head;
    (void)head_len;
    (void)extra;
    (void)n_extra;
  }
  virtual void DoFlush() {}
  // Stops the backend's receive path and joins its threads. After it returns, no receive
  // path call (Expect, Complete, ...) is in progress or will start.
  virtual void DoClose() = 0;
  // Adds backend-specific counters to a stats() snapshot. Thread-safe.
  virtual void BackendStats(ChannelStats* stats) const { (void)stats; }

  // ---- receive path, for backends ------------------------------------------------------
  // The request in flight in h.slot if h.tag matches; otherwise fails the channel (a stray
  // or duplicated reply is a protocol violation) and returns nullptr.
  std::shared_ptr<PendingRequest> Expect(const protocol::wire::FrameHeader& h);
  // Slot-owned memory for reply bytes (grown on demand). REQUIRES: the slot is in flight and
  // the caller is the one delivering its reply.
  uint8_t* ReplyBuffer(uint32_t slot, size_t bytes);
  // Delivers `reply` to `request` (the result of Expect) and frees its slot.
  void Complete(const std::shared_ptr<PendingRequest>& request, const Reply& reply);
  void DeliverNotification(const Reply& reply);
  // Fails the channel (first error wins) and every request in flight.
  void FailChannel(const Error& error);
  void CountReceived(size_t bytes);
  void SetRemote(uint32_t shard_id, uint32_t num_shards, uint64_t max_frame);
  // The digest stamped into every frame's header (TCP: the job token's digest).
  void SetJobDigest(uint64_t digest) { job_digest_ = digest; }
  uint64_t job_digest() const { return job_digest_; }

 private:
  struct Slot {
    std::unique_ptr<uint8_t[]> frame;  // request staging buffer (slot_bytes)
    std::vector<uint8_t> reply;        // reply buffer, grown on demand
    std::shared_ptr<PendingRequest> request;  // set while in flight
    uint64_t tag = 0;
    enum class State : uint8_t { kFree, kAcquired, kInFlight } state = State::kFree;
  };

  void FreeSlotLocked(uint32_t slot);
  // Post / PostGather: stamps the header of a frame_len-byte frame whose first head_len
  // bytes are in the slot, then hands it to the backend.
  void PostFrame(uint32_t slot, size_t head_len, size_t frame_len, const ConstSpan* extra,
                 size_t n_extra, std::shared_ptr<PendingRequest> request);

  const std::string peer_;
  const size_t slot_bytes_;
  uint64_t job_digest_ = 0;          // set by the backend before the first Post
  uint32_t remote_shard_id_ = 0;     // set by the backend before the first Post
  uint32_t remote_num_shards_ = 0;
  uint64_t remote_max_frame_ = 0;
  std::function<void(const Reply&)> notify_;       // set before the first Post
  std::function<void(const Error&)> on_failure_;   // set before the first Post

  mutable std::mutex mu_;  // guards every field below and the slots' state/request/tag
  std::condition_variable slot_cv_;
  std::vector<Slot> slots_;
  std::vector<uint32_t> free_;
  uint32_t in_flight_ = 0;
  uint64_t next_tag_ = 0;
  bool failed_ = false;
  bool closed_ = false;
  Error error_;
  ChannelStats stats_;
};

}  // namespace bagpipe::transport
