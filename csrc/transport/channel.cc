#include "transport/channel.h"

#include <algorithm>
#include <cstring>
#include <optional>

#include "common/errors.h"

namespace bagpipe::transport {

using protocol::wire::FrameHeader;
using protocol::wire::kHeaderBytes;
using protocol::wire::Status;

ErrorKind KindOfStatus(Status status) {
  switch (status) {
    case Status::kInvalidArgument: return ErrorKind::kValue;
    case Status::kSessionFailed:
    case Status::kNotOpen:
    case Status::kUnavailable:
      return ErrorKind::kSession;
    case Status::kUnauthorized:
    case Status::kProtocolError:
      return ErrorKind::kTransport;
    case Status::kShuttingDown:
      return ErrorKind::kShuttingDown;
    case Status::kStartStep:
      return ErrorKind::kStartStep;
    case Status::kInternal:
    case Status::kOk:
      return ErrorKind::kInternal;
  }
  return ErrorKind::kInternal;
}

void ThrowError(const Error& error) {
  switch (error.kind) {
    case ErrorKind::kTransport: throw TransportError(error.message);
    case ErrorKind::kSession: throw SessionError(error.message);
    case ErrorKind::kValue: throw ValueError(error.message);
    case ErrorKind::kTimeout: throw TimeoutError(error.message);
    case ErrorKind::kInternal: throw std::runtime_error(error.message);
    case ErrorKind::kShuttingDown: throw ShuttingDownError(error.message);
    case ErrorKind::kStartStep: throw StartStepError(error.message);
  }
  throw std::runtime_error(error.message);
}

void ReplyCapture::OnReply(const Reply& reply) {
  std::lock_guard<std::mutex> lock(mu);
  type = reply.type();
  status = reply.status();
  fixed.assign(reply.fixed, reply.fixed + reply.fixed_len);
  if (reply.type() == protocol::wire::MsgType::kError) text = reply.Text();
  done = true;
  cv.notify_all();
}

void ReplyCapture::OnFailure(const Error& error) {
  std::lock_guard<std::mutex> lock(mu);
  failure = error;
  done = true;
  cv.notify_all();
}

bool ReplyCapture::WaitUntil(Deadline deadline) {
  std::unique_lock<std::mutex> lock(mu);
  return cv.wait_until(lock, deadline, [&] { return done; });
}

std::string Reply::Text() const {
  const size_t n = std::min(payload_len, protocol::wire::kMaxMessageBytes);
  return std::string(reinterpret_cast<const char*>(payload), n);
}

// ---- Channel -------------------------------------------------------------------------------

Channel::Channel(std::string peer, const ChannelOptions& options)
    : peer_(std::move(peer)), slot_bytes_(options.slot_bytes) {
  if (options.num_slots == 0) throw ValueError("inflight_packets (num_slots) must be >= 1");
  if (options.slot_bytes <= kHeaderBytes) throw ValueError("slot_bytes must exceed the frame header");
  slots_.resize(options.num_slots);
  free_.reserve(options.num_slots);
  for (uint32_t i = 0; i < options.num_slots; ++i) {
    slots_[i].frame.reset(new uint8_t[options.slot_bytes]);
    free_.push_back(options.num_slots - 1 - i);  // slot 0 handed out first
  }
}

Channel::~Channel() = default;

void Channel::SetHandlers(std::function<void(const Reply&)> on_notify,
                          std::function<void(const Error&)> on_failure) {
  notify_ = std::move(on_notify);
  on_failure_ = std::move(on_failure);
}

uint32_t Channel::AcquireSlot(Deadline deadline, const std::atomic<bool>* cancel) {
  std::unique_lock<std::mutex> lock(mu_);
  bool waited = false;
  while (!failed_ && free_.empty()) {
    waited = true;
    if (cancel && cancel->load()) {
      throw SessionError("sending to PS shard " + peer_ + " was cancelled (the client failed or "
                         "is closing)");
    }
    const Deadline step = std::min(deadline, Clock::now() + std::chrono::milliseconds(20));
    slot_cv_.wait_until(lock, step);
    if (Clock::now() >= deadline && free_.empty() && !failed_) {
      throw TimeoutError("no reply from PS shard " + peer_ + " within the timeout (" +
                         std::to_string(in_flight_) + " requests in flight, window full)");
    }
  }
  if (failed_) throw TransportError(error_.message);
  if (waited) ++stats_.slot_waits;
  const uint32_t slot = free_.back();
  free_.pop_back();
  slots_[slot].state = Slot::State::kAcquired;
  return slot;
}

void Channel::ReleaseUnposted(uint32_t slot) {
  std::lock_guard<std::mutex> lock(mu_);
  if (slots_[slot].state != Slot::State::kAcquired) return;
  slots_[slot].state = Slot::State::kFree;
  free_.push_back(slot);
  slot_cv_.notify_all();
}

void Channel::FreeSlotLocked(uint32_t slot) {
  Slot& s = slots_[slot];
  if (s.state == Slot::State::kInFlight) --in_flight_;
  s.request.reset();
  s.state = Slot::State::kFree;
  free_.push_back(slot);
  slot_cv_.notify_all();
}

void Channel::Post(uint32_t slot, size_t frame_len, std::shared_ptr<PendingRequest> request) {
  PostFrame(slot, frame_len, frame_len, nullptr, 0, std::move(request));
}

void Channel::PostGather(uint32_t slot, size_t head_len, const ConstSpan* extra, size_t n_extra,
                         std::shared_ptr<PendingRequest> request) {
  size_t frame_len = head_len;
  for (size_t i = 0; i < n_extra; ++i) frame_len += extra[i].len;
  if (n_extra > 8 || head_len < kHeaderBytes || head_len > slot_bytes_) {
    ReleaseUnposted(slot);
    throw ValueError("a gathered frame needs a staged header and at most 8 pieces");
  }
  if (!CanGather() && frame_len <= slot_bytes_) {
    uint8_t* at = slots_[slot].frame.get() + head_len;
    for (size_t i = 0; i < n_extra; ++i) {
      if (extra[i].len) std::memcpy(at, extra[i].data, extra[i].len);
      at += extra[i].len;
    }
    PostFrame(slot, frame_len, frame_len, nullptr, 0, std::move(request));
    return;
  }
  PostFrame(slot, head_len, frame_len, extra, n_extra, std::move(request));
}

void Channel::PostFrame(uint32_t slot, size_t head_len, size_t frame_len, const ConstSpan* extra,
                        size_t n_extra, std::shared_ptr<PendingRequest> request) {
  if (frame_len > slot_bytes_ || frame_len < kHeaderBytes) {
    ReleaseUnposted(slot);
    throw ValueError("frame of " + std::to_string(frame_len) + " bytes does not fit a slot of " +
                     std::to_string(slot_bytes_) + " bytes");
  }
  uint8_t* frame = slots_[slot].frame.get();
  std::optional<Error> err;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Slot& s = slots_[slot];
    if (failed_) {
      s.state = Slot::State::kFree;
      free_.push_back(slot);
      slot_cv_.notify_all();
      err = error_;
    } else {
      s.state = Slot::State::kInFlight;
      s.request = request;
      s.tag = ++next_tag_;
      ++in_flight_;
      ++stats_.frames_sent;
      stats_.bytes_sent += frame_len;
      FrameHeader h = protocol::wire::LoadHeader(frame);
      h.slot = slot;
      h.tag = s.tag;
      h.job = job_digest_;
      h.body_len = frame_len - kHeaderBytes;
      protocol::wire::StoreHeader(frame, h);
    }
  }
  if (err) {
    // The request never went out: it fails like every other request of this channel.
    if (request->Claim()) request->OnFailure(*err);
    throw TransportError(err->message);
  }
  try {
    if (n_extra == 0) {
      DoPost(slot, frame, frame_len);
    } else {
      DoPostGather(slot, frame, head_len, extra, n_extra);
    }
  } catch (const TransportError& e) {
    FailChannel({ErrorKind::kTransport, e.what()});
    throw;
  }
}

void Channel::Flush() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_) throw TransportError(error_.message);
    ++stats_.flushes;
  }
  try {
    DoFlush();
  } catch (const TransportError& e) {
    FailChannel({ErrorKind::kTransport, e.what()});
    throw;
  }
}

void Channel::WaitIdle(Deadline deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  while (in_flight_ > 0 && !failed_) {
    if (slot_cv_.wait_until(lock, deadline) == std::cv_status::timeout && in_flight_ > 0 &&
        !failed_) {
      throw TimeoutError("PS shard " + peer_ + " did not answer " + std::to_string(in_flight_) +
                         " requests within the timeout");
    }
  }
}

uint32_t Channel::in_flight() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_flight_;
}

bool Channel::failed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failed_;
}

Error Channel::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

ChannelStats Channel::stats() const {
  ChannelStats s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    s = stats_;
  }
  BackendStats(&s);
  return s;
}

void Channel::Close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    closed_ = true;
  }
  DoClose();
  FailChannel({ErrorKind::kTransport, "connection to PS shard " + peer_ + " is closed"});
}

std::shared_ptr<PendingRequest> Channel::Expect(const FrameHeader& h) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (h.slot < slots_.size()) {
      Slot& s = slots_[h.slot];
      if (s.state == Slot::State::kInFlight && s.tag == h.tag) return s.request;
    }
  }
  FailChannel({ErrorKind::kTransport, "PS shard " + peer_ + " sent a reply (" +
                                          protocol::wire::MsgTypeName(h.type) + ", slot " +
                                          std::to_string(h.slot) + ", tag " + std::to_string(h.tag) +
                                          ") to no request in flight"});
  return nullptr;
}

uint8_t* Channel::ReplyBuffer(uint32_t slot, size_t bytes) {
  auto& buf = slots_[slot].reply;
  if (buf.size() < bytes) buf.resize(bytes);
  return buf.data();
}

void Channel::Complete(const std::shared_ptr<PendingRequest>& request, const Reply& reply) {
  if (request->Claim()) request->OnReply(reply);
  std::lock_guard<std::mutex> lock(mu_);
  const uint32_t slot = reply.header.slot;
  if (slot < slots_.size() && slots_[slot].request == request) FreeSlotLocked(slot);
}

void Channel::DeliverNotification(const Reply& reply) {
  if (notify_) notify_(reply);
}

void Channel::CountReceived(size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.frames_received;
  stats_.bytes_received += bytes;
}

void Channel::SetRemote(uint32_t shard_id, uint32_t num_shards, uint64_t max_frame) {
  remote_shard_id_ = shard_id;
  remote_num_shards_ = num_shards;
  remote_max_frame_ = max_frame;
}

void Channel::FailChannel(const Error& error) {
  std::vector<std::shared_ptr<PendingRequest>> failed;
  Error err;
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failed_) {
      failed_ = true;
      error_ = error;
      first = true;
    }
    err = error_;
    for (uint32_t i = 0; i < slots_.size(); ++i) {
      if (slots_[i].state == Slot::State::kInFlight) {
        failed.push_back(slots_[i].request);
        FreeSlotLocked(i);
      }
    }
    slot_cv_.notify_all();
  }
  for (auto& r : failed) {
    if (r->Claim()) r->OnFailure(err);
  }
  if (first && on_failure_) on_failure_(err);
}

}  // namespace bagpipe::transport
