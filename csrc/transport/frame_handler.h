// The shard side of the transport interface: a backend (local channel, TCP server, UCX
// server) delivers each request frame it receives to a FrameHandler, together with the
// ServerLink the replies go back through. The transport layer knows no more of the shard
// than this interface (shard::PSShard implements it), so no backend depends on the shard
// layer.
//
//   ServerLink    shard side of one connection: how the handler sends a reply frame back.
//                 The payload of a reply is produced by a fill callback writing straight into
//                 the backend's memory (a TCP send buffer, the client's sink for the local
//                 backend, a registered reply slot for RDMA).
//   FrameHandler  what answers the frames: HandleFrame per request, LinkClosed once per
//                 connection, and the facts a backend needs up front (Identity, log sink).
//
// Thread safety:
//   ServerLink: Send is thread-safe; frames sent by one thread arrive in that order. The
//   authentication fields and `state` are touched only by the thread that delivers this
//   link's requests (one at a time) and by LinkClosed after the last delivery.
//   FrameHandler: HandleFrame is called concurrently for different links, one call at a
//   time per link; LinkClosed once per link, after its last HandleFrame returned.
//
// Invariants:
//   1. A backend calls HandleFrame only with a header whose body_len bytes follow in `body`;
//      when HandleFrame returns false, the backend closes the connection.
//   2. LinkClosed runs exactly once per link a backend created, and nothing is delivered on
//      that link afterwards.
//   3. `state` belongs to the handler: created, read and destroyed only by it (invariant of
//      the delivering thread above); backends never look inside.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "common/log.h"
#include "protocol/wire.h"
#include "transport/recv_buffer.h"

namespace bagpipe::transport {

using PayloadFill = std::function<void(uint8_t* dst)>;

// Per-link state a FrameHandler keeps on the link (e.g. the session a connection opened).
class LinkState {
 public:
  virtual ~LinkState() = default;
};

class ServerLink {
 public:
  virtual ~ServerLink() = default;

  // Sends one frame: the header (type, status, tag, slot; job and body_len filled in), the
  // fixed body, then payload_len bytes written by `fill` (which must write exactly that
  // many). Returns false, dropping the frame, when the link is closed. If fill throws,
  // nothing is delivered and the exception propagates (the caller then sends an error).
  virtual bool Send(protocol::wire::MsgType type, protocol::wire::Status status, uint64_t tag,
                    uint32_t slot, const void* fixed, size_t fixed_len, size_t payload_len,
                    const PayloadFill& fill) = 0;
  // Who is on the other side, for log lines ("tcp 127.0.0.1:53412", "local").
  virtual std::string Describe() const = 0;

  // Sends a kError reply carrying `text` (truncated to wire::kMaxMessageBytes).
  bool SendError(uint64_t tag, uint32_t slot, protocol::wire::Status status, uint64_t session_id,
                 const std::string& text);

  // ---- authentication (the Hello): set by the backend, checked and completed by the handler
  std::string expected_token;   // set by the accepting server before the first request
  uint64_t job_digest = 0;      // digest of the token; stamped into replies
  bool authenticated = false;   // after a valid Hello (local links start authenticated)

  // ---- the handler's own per-link state (invariant 3) ------------------------------------
  std::unique_ptr<LinkState> state;
};

class FrameHandler {
 public:
  // What the handler announces to a client in its HelloOk.
  struct Identity {
    uint32_t shard_id = 0;
    uint32_t num_shards = 1;
    uint64_t max_frame_bytes = protocol::wire::kDefaultMaxFrameBytes;  // header + body
  };

  virtual ~FrameHandler() = default;

  // What HelloOk announces; fixed for the handler's life.
  virtual Identity identity() const = 0;
  // Where a backend logs connection events (violations); may be empty.
  virtual const LogFn& log() const = 0;

  // Handles one request frame from `link` and replies through it. Returns false when the
  // connection must be closed (invariant 1). Never throws. REQUIRES: body holds
  // header.body_len bytes; one call at a time per link. `owner`, if not null, is the
  // buffer that holds body: the handler may take it over (swapping in another buffer)
  // instead of copying the body.
  virtual bool HandleFrame(const std::shared_ptr<ServerLink>& link,
                           const protocol::wire::FrameHeader& header, const uint8_t* body,
                           size_t body_len, RecvBuffer* owner = nullptr) = 0;
  // The connection behind `link` is gone (invariant 2).
  virtual void LinkClosed(ServerLink* link) = 0;
};

}  // namespace bagpipe::transport
