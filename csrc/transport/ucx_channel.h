// The rdma backend, client side: a Channel (channel.h) whose slots are registered memory
// and whose frames reach the shard through a UCX endpoint (ucx_endpoint.h) — written
// one-sided into the shard's registered slot ring, then one flush and one doorbell per batch
// (frame mode kPut: RC verbs on a fabric, shared memory here), or carried by the doorbell
// itself where UCX has no native RMA (kMessage: TCP). Replies come back as active messages;
// a GET reply's rows land straight in the request's sink (the caller's output tensor when
// the chunk is contiguous), fetched by UCX's rendezvous protocol for large replies.
//
// Thread safety: as Channel. DoPost/DoFlush run on the posting thread; replies are handled on
// the endpoint's progress thread.
//
// Invariants:
//   1. Slot i's registered buffer is the source of the write into ring slot i; Channel owns
//      the slot (channel.h invariant 1), so the source stays unchanged until the reply.
//   2. Liveness without an explicit Flush: at most ring_every frames (half the window) are
//      written before a doorbell rings, so a producer blocked in AcquireSlot always waits on
//      frames the shard has been told about.
//   3. A reply is matched against the (slot, tag) this channel posted BEFORE it reaches
//      Channel::Expect; a reply to nothing in flight fails the endpoint first (which stops
//      UCX from writing into any request's sink), then the channel.
//   4. After DoClose returns, UCX writes into no sink and the progress thread is joined.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "transport/channel.h"
#include "transport/ucx_context.h"
#include "transport/ucx_endpoint.h"

namespace bagpipe::transport {

class UcxChannel : public Channel {
 public:
  // Connects to the shard's UCX listener at host:port, authenticates (bootstrap + Hello)
  // within connect_timeout seconds. Throws TimeoutError, TransportError (refused, wrong
  // token, remote-key mismatch, UCX failure), ValueError (frames larger than the shard takes).
  static std::unique_ptr<UcxChannel> Connect(const std::string& host, uint16_t port,
                                             const std::string& job_token,
                                             const ChannelOptions& options,
                                             double connect_timeout,
                                             const ucx::UcxConfig& config = {});
  // Close(); the endpoint closes with it.
  ~UcxChannel() override;

  const char* kind() const override { return "ucx"; }
  // The shard's instance id from its HelloOk (PSShard::instance_id).
  uint64_t remote_instance() const { return remote_instance_; }
  // How frames travel to this shard (ucx_endpoint.h "Frame modes"), fixed at Connect.
  ucx::FrameMode frame_mode() const { return endpoint_->frame_mode(); }
  // Writes, flushes and doorbells of the underlying endpoint.
  ucx::EndpointStats endpoint_stats() const { return endpoint_->stats(); }

 protected:
  void DoPost(uint32_t slot, const uint8_t* frame, size_t frame_len) override;
  void DoFlush() override;
  void DoClose() override;
  void BackendStats(ChannelStats* stats) const override;

 private:
  UcxChannel(std::string peer, const ChannelOptions& options);
  void Handshake(const std::string& token, Deadline deadline);
  ucx::Landing OnMessage(const uint8_t* head, size_t head_len, size_t payload_len);
  void Rethrow(const std::exception& e);

  std::shared_ptr<ucx::Endpoint> endpoint_;  // set by Connect
  uint64_t remote_instance_ = 0;
  uint32_t ring_every_ = 1;                  // invariant 2
  uint32_t unrung_ = 0;                      // posting thread only

  std::mutex tags_mu_;             // guards slot_tags_
  std::vector<uint64_t> slot_tags_;  // tag posted in each slot; 0: nothing in flight
};

}  // namespace bagpipe::transport
