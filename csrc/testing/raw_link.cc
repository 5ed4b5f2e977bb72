#include "testing/raw_link.h"

#include <cstring>
#include <iterator>

#include "common/errors.h"

namespace bagpipe::testing {

namespace wire = protocol::wire;
using transport::FrameHandler;
using transport::PayloadFill;

RawLink::RawLink(std::shared_ptr<FrameHandler> handler, bool authenticated_at_start)
    : handler_(std::move(handler)) {
  if (!handler_) throw ValueError("RawLink needs a shard");
  authenticated = authenticated_at_start;
}

bool RawLink::Send(wire::MsgType type, wire::Status status, uint64_t tag, uint32_t slot,
                   const void* fixed, size_t fixed_len, size_t payload_len,
                   const PayloadFill& fill) {
  std::string frame(wire::kHeaderBytes + fixed_len + payload_len, '\0');
  auto* p = reinterpret_cast<uint8_t*>(frame.data());
  wire::StoreHeader(p, wire::MakeHeader(type, job_digest, fixed_len + payload_len, status, tag,
                                        slot));
  if (fixed_len) std::memcpy(p + wire::kHeaderBytes, fixed, fixed_len);
  if (payload_len) fill(p + wire::kHeaderBytes + fixed_len);
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) return false;
  frames_.push_back(std::move(frame));
  return true;
}

bool RawLink::Request(const std::string& frame, const std::shared_ptr<RawLink>& self) {
  if (frame.size() < wire::kHeaderBytes) throw ValueError("frame is shorter than the 40-byte header");
  const auto* p = reinterpret_cast<const uint8_t*>(frame.data());
  const auto h = wire::LoadHeader(p);
  if (h.body_len != frame.size() - wire::kHeaderBytes) {
    throw ValueError("frame: body_len does not match the bytes given");
  }
  // The body is copied so that it is 8-byte aligned like a transport's buffer.
  std::vector<uint64_t> body((frame.size() - wire::kHeaderBytes + 7) / 8);
  std::memcpy(body.data(), p + wire::kHeaderBytes, frame.size() - wire::kHeaderBytes);
  return handler_->HandleFrame(self, h, reinterpret_cast<const uint8_t*>(body.data()), h.body_len);
}

std::vector<std::string> RawLink::Take() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> out(std::make_move_iterator(frames_.begin()),
                               std::make_move_iterator(frames_.end()));
  frames_.clear();
  return out;
}

void RawLink::Close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    closed_ = true;
  }
  handler_->LinkClosed(this);
}

}  // namespace bagpipe::testing
