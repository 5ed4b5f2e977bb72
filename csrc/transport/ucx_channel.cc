#include "transport/ucx_channel.h"

#include <algorithm>
#include <cstring>
#include <optional>

#include "common/errors.h"

namespace bagpipe::transport {

using protocol::wire::FrameHeader;
using protocol::wire::kHeaderBytes;
using protocol::wire::MsgType;

UcxChannel::UcxChannel(std::string peer, const ChannelOptions& options)
    : Channel(std::move(peer), options), slot_tags_(options.num_slots, 0) {
  ring_every_ = std::max<uint32_t>(1, options.num_slots / 2);
}

UcxChannel::~UcxChannel() { Close(); }

std::unique_ptr<UcxChannel> UcxChannel::Connect(const std::string& host, uint16_t port,
                                                const std::string& job_token,
                                                const ChannelOptions& options,
                                                double connect_timeout,
                                                const ucx::UcxConfig& config) {
  if (job_token.size() > protocol::wire::kMaxTokenBytes) {
    throw ValueError("job_token is longer than " + std::to_string(protocol::wire::kMaxTokenBytes) +
                     " bytes");
  }
  const Deadline deadline = DeadlineAfter(connect_timeout);
  std::unique_ptr<UcxChannel> ch(
      new UcxChannel("ucx " + host + ":" + std::to_string(port), options));
  ucx::ConnectOptions o;
  o.host = host;
  o.port = port;
  o.token = job_token;
  o.config = config;
  o.num_slots = options.num_slots;
  o.slot_bytes = options.slot_bytes;
  for (uint32_t i = 0; i < options.num_slots; ++i) o.source_slots.push_back(ch->SlotBuffer(i));
  ucx::EndpointHandlers h;
  UcxChannel* raw = ch.get();
  h.on_message = [raw](const uint8_t* head, size_t head_len, size_t payload_len) {
    return raw->OnMessage(head, head_len, payload_len);
  };
  h.on_failure = [raw](const ucx::Failure& f) {
    raw->FailChannel({ErrorKind::kTransport, "PS shard connection " + raw->peer() + " failed: " +
                                                 f.message});
  };
  ch->endpoint_ = ucx::Endpoint::Connect(o, std::move(h), deadline);
  ch->Handshake(job_token, deadline);  // on failure ~UcxChannel closes the endpoint
  return ch;
}

void UcxChannel::Handshake(const std::string& token, Deadline deadline) {
  const uint64_t digest = protocol::wire::TokenDigest(token);
  SetJobDigest(digest);
  const size_t len = kHeaderBytes + sizeof(protocol::wire::HelloBody) + token.size();
  if (len > slot_bytes()) {
    throw ValueError("the job token does not fit a packet slot of " + std::to_string(slot_bytes()) +
                     " bytes");
  }
  const uint32_t slot = AcquireSlot(deadline);
  uint8_t* f = SlotBuffer(slot);
  protocol::wire::HelloBody hello{};
  hello.token_len = static_cast<uint32_t>(token.size());
  protocol::wire::StoreHeader(f, protocol::wire::MakeHeader(MsgType::kHello, digest, len - kHeaderBytes));
  std::memcpy(f + kHeaderBytes, &hello, sizeof(hello));
  std::memcpy(f + kHeaderBytes + sizeof(hello), token.data(), token.size());
  auto req = std::make_shared<ReplyCapture>();
  Post(slot, len, req);
  Flush();
  if (!req->WaitUntil(deadline)) {
    throw TimeoutError("PS shard " + peer() + " did not answer the Hello within the timeout");
  }
  if (req->failure) ThrowError(*req->failure);
  if (req->type == MsgType::kError) {
    throw TransportError(peer() + " refused the connection: " + req->text);
  }
  if (req->type != MsgType::kHelloOk || req->fixed.size() != sizeof(protocol::wire::HelloOkBody)) {
    throw TransportError(peer() + " answered the Hello with a " +
                         protocol::wire::MsgTypeName(static_cast<uint16_t>(req->type)));
  }
  const auto ok = protocol::wire::Load<protocol::wire::HelloOkBody>(req->fixed.data());
  if (ok.max_frame_bytes < slot_bytes()) {
    throw ValueError(peer() + " accepts frames of at most " + std::to_string(ok.max_frame_bytes) +
                     " bytes, smaller than this client's packets of " +
                     std::to_string(slot_bytes()) + " bytes: lower max_packet_rows");
  }
  SetRemote(ok.shard_id, ok.num_shards, ok.max_frame_bytes);
  remote_instance_ = ok.instance_id;
}

void UcxChannel::Rethrow(const std::exception& e) {
  // Let the endpoint finish failing (its receives are stopped) before the channel fails
  // its requests: no reply payload may land in a sink the caller already gave up.
  endpoint_->WaitFailureHandled(DeadlineAfter(ucx::Endpoint::kCloseTimeout * 2));
  throw TransportError(std::string("PS shard connection ") + peer() + " failed: " + e.what());
}

void UcxChannel::DoPost(uint32_t slot, const uint8_t* frame, size_t frame_len) {
  const FrameHeader h = protocol::wire::LoadHeader(frame);
  {
    std::lock_guard<std::mutex> lock(tags_mu_);
    slot_tags_[slot] = h.tag;
  }
  try {
    endpoint_->PostPut(slot, frame_len, h.tag);
    if (endpoint_->frame_mode() == ucx::FrameMode::kPut && ++unrung_ >= ring_every_) {
      unrung_ = 0;
      endpoint_->FlushAndRing();
    }
  } catch (const TransportError& e) {
    Rethrow(e);
  }
}

void UcxChannel::DoFlush() {
  if (unrung_ == 0) return;
  unrung_ = 0;
  try {
    endpoint_->FlushAndRing();
  } catch (const TransportError& e) {
    Rethrow(e);
  }
}

void UcxChannel::BackendStats(ChannelStats* stats) const {
  if (!endpoint_) return;
  const auto es = endpoint_->stats();
  stats->one_sided_writes = es.puts;
  stats->doorbells = es.doorbells;
}

void UcxChannel::DoClose() {
  if (endpoint_) endpoint_->Close(/*graceful=*/true);
}

ucx::Landing UcxChannel::OnMessage(const uint8_t* head, size_t head_len, size_t payload_len) {
  auto reject = [&](const std::string& why) {
    endpoint_->Fail("PS shard " + peer() + " sent a malformed reply: " + why);
    return ucx::Landing{};
  };
  if (head_len < kHeaderBytes) return reject("short header");
  const FrameHeader h = protocol::wire::LoadHeader(head);
  std::string why;
  const uint64_t max_body = std::max<uint64_t>(remote_max_frame(), 1 << 16);
  if (!protocol::wire::CheckHeader(h, max_body, &why)) return reject(why);
  if (h.job != job_digest()) return reject("a reply carries another job's token digest");
  const auto type = static_cast<MsgType>(h.type);
  if (protocol::wire::IsRequestType(type)) {
    return reject(std::string("a request frame (") + protocol::wire::MsgTypeName(h.type) + ")");
  }
  const size_t fixed_len = protocol::wire::FixedBodyBytes(type);
  if (head_len != kHeaderBytes + fixed_len || h.body_len != fixed_len + payload_len) {
    return reject("frame lengths do not add up");
  }
  if (h.slot == protocol::wire::kNoSlot) {
    if (payload_len > protocol::wire::kMaxMessageBytes) return reject("oversized notification");
    // Head and text together; done() may run later (messages complete in order).
    auto copy = std::make_shared<std::vector<uint8_t>>(kHeaderBytes + 64 +
                                                       protocol::wire::kMaxMessageBytes);
    std::memcpy(copy->data(), head, head_len);
    ucx::Landing l;
    l.dst = copy->data() + head_len;
    l.done = [this, copy, head_len, payload_len](bool landed) {
      if (!landed) return;
      Reply r;
      r.header = protocol::wire::LoadHeader(copy->data());
      r.fixed = copy->data() + kHeaderBytes;
      r.fixed_len = head_len - kHeaderBytes;
      r.payload = copy->data() + head_len;
      r.payload_len = payload_len;
      CountReceived(head_len + payload_len);
      DeliverNotification(r);
    };
    return l;
  }
  {
    std::lock_guard<std::mutex> lock(tags_mu_);
    if (h.slot >= slot_tags_.size() || slot_tags_[h.slot] != h.tag || h.tag == 0) {
      return reject("a reply (" + std::string(protocol::wire::MsgTypeName(h.type)) + ", slot " +
                    std::to_string(h.slot) + ", tag " + std::to_string(h.tag) +
                    ") to no request in flight");
    }
  }
  auto request = Expect(h);
  if (!request) return reject("a reply to no request in flight");
  // The head is gone once this returns; done() may run later (replies complete in order).
  auto copy = std::make_shared<std::vector<uint8_t>>(head, head + head_len);
  Reply r;
  r.header = h;
  r.fixed = copy->data() + kHeaderBytes;
  r.fixed_len = fixed_len;
  r.payload_len = payload_len;
  uint8_t* sink = payload_len ? request->ReplySink(r, payload_len) : nullptr;
  if (sink == nullptr && payload_len) sink = ReplyBuffer(h.slot, payload_len);
  ucx::Landing l;
  l.dst = sink;
  l.keepalive = request;
  l.done = [this, request, copy, sink, payload_len](bool landed) {
    if (!landed) return;  // the endpoint failed: the channel fails every request
    Reply rr;
    rr.header = protocol::wire::LoadHeader(copy->data());
    rr.fixed = copy->data() + kHeaderBytes;
    rr.fixed_len = copy->size() - kHeaderBytes;
    rr.payload = sink;
    rr.payload_len = payload_len;
    {
      std::lock_guard<std::mutex> lock(tags_mu_);
      slot_tags_[rr.header.slot] = 0;
    }
    CountReceived(copy->size() + payload_len);
    Complete(request, rr);
  };
  return l;
}

}  // namespace bagpipe::transport
