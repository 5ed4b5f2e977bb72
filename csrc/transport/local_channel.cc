#include "transport/local_channel.h"

#include <vector>

#include "common/errors.h"

namespace bagpipe::transport {

using protocol::wire::FrameHeader;
using protocol::wire::MsgType;
using protocol::wire::Status;

class LocalChannel::Link : public ServerLink {
 public:
  explicit Link(LocalChannel* channel) : channel_(channel) {
    authenticated = true;  // in-process: the trainer and the shard are one job
  }

  bool Send(MsgType type, Status status, uint64_t tag, uint32_t slot, const void* fixed,
            size_t fixed_len, size_t payload_len, const PayloadFill& fill) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (channel_ == nullptr) return false;
    return channel_->Receive(type, status, tag, slot, fixed, fixed_len, payload_len, fill);
  }

  std::string Describe() const override { return "local"; }

  void Detach() {
    std::lock_guard<std::mutex> lock(mu_);
    channel_ = nullptr;
  }

 private:
  std::mutex mu_;  // serializes deliveries with Detach
  LocalChannel* channel_;  // null after Detach
};

LocalChannel::LocalChannel(std::shared_ptr<FrameHandler> shard, const ChannelOptions& options)
    : Channel("local shard " + std::to_string(shard ? shard->identity().shard_id : 0), options),
      shard_(std::move(shard)),
      link_(std::make_shared<Link>(this)) {
  if (!shard_) throw ValueError("LocalChannel needs a shard");
  const auto id = shard_->identity();
  SetRemote(id.shard_id, id.num_shards, id.max_frame_bytes);
}

LocalChannel::~LocalChannel() { Close(); }

void LocalChannel::DoPost(uint32_t slot, const uint8_t* frame, size_t frame_len) {
  (void)slot;
  const FrameHeader h = protocol::wire::LoadHeader(frame);
  link_->job_digest = h.job;
  if (!shard_->HandleFrame(link_, h, frame + protocol::wire::kHeaderBytes,
                           frame_len - protocol::wire::kHeaderBytes)) {
    throw TransportError("local shard " + std::to_string(shard_->identity().shard_id) +
                         " refused a frame and closed the link");
  }
}

void LocalChannel::DoClose() {
  link_->Detach();
  shard_->LinkClosed(link_.get());
}

bool LocalChannel::Receive(MsgType type, Status status, uint64_t tag, uint32_t slot,
                           const void* fixed, size_t fixed_len, size_t payload_len,
                           const PayloadFill& fill) {
  Reply r;
  r.header = protocol::wire::MakeHeader(type, job_digest(), fixed_len + payload_len, status, tag, slot);
  r.fixed = static_cast<const uint8_t*>(fixed);
  r.fixed_len = fixed_len;
  CountReceived(protocol::wire::kHeaderBytes + fixed_len + payload_len);
  if (slot == protocol::wire::kNoSlot) {
    std::vector<uint8_t> text(payload_len);
    if (payload_len) fill(text.data());
    r.payload = text.data();
    r.payload_len = payload_len;
    DeliverNotification(r);
    return true;
  }
  auto request = Expect(r.header);
  if (!request) return false;
  uint8_t* sink = payload_len ? request->ReplySink(r, payload_len) : nullptr;
  if (sink == nullptr && payload_len) sink = ReplyBuffer(slot, payload_len);
  if (payload_len) fill(sink);  // may throw: the request stays in flight, an error follows
  r.payload = sink;
  r.payload_len = payload_len;
  Complete(request, r);
  return true;
}

}  // namespace bagpipe::transport
