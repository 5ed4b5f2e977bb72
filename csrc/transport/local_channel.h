// The local backend: the shard lives in this process and a Channel reaches it by direct
// calls, no sockets. Posting a frame dispatches it into the shard's FrameHandler on the
// poster's thread;
// replies are delivered synchronously (an ACK, a read that is ready) or later from the
// shard thread that commits the step a deferred read waits for. A GET reply's rows are
// written by the store straight into the request's sink (the caller's output tensor when it
// can be), so a local read copies each row exactly once.
//
// Thread safety: as Channel. The link serializes every delivery into this channel and its
// Close, so nothing is delivered after DoClose returns (channel.h invariant 4).
//
// Invariants:
//   1. The link starts authenticated (the trainer and the shard are one process, one job);
//      each frame's job digest is the one the channel stamped.
//   2. A frame the handler refuses (HandleFrame false) fails the channel with a
//      TransportError, as a closed connection would.
#pragma once

#include <memory>
#include <mutex>

#include "transport/channel.h"
#include "transport/frame_handler.h"

namespace bagpipe::transport {

class LocalChannel : public Channel {
 public:
  // REQUIRES: shard != nullptr (ValueError).
  LocalChannel(std::shared_ptr<FrameHandler> shard, const ChannelOptions& options);
  // Close(): in-flight requests fail, the shard sees LinkClosed.
  ~LocalChannel() override;

  const char* kind() const override { return "local"; }

 protected:
  void DoPost(uint32_t slot, const uint8_t* frame, size_t frame_len) override;
  void DoClose() override;

 private:
  class Link;
  bool Receive(protocol::wire::MsgType type, protocol::wire::Status status, uint64_t tag,
               uint32_t slot, const void* fixed, size_t fixed_len, size_t payload_len,
               const PayloadFill& fill);

  const std::shared_ptr<FrameHandler> shard_;
  const std::shared_ptr<Link> link_;
};

}  // namespace bagpipe::transport
