// The frame path of a UCX endpoint (ucx_endpoint.h "Frame modes"): the client's one-sided
// writes, flushes and doorbells (kPut) or frames carried by their doorbells (kMessage), the
// shard's doorbell checks and ring-frame dispatch, and every message's landing in order.
#include <algorithm>
#include <cstring>

#include "transport/ucx_endpoint.h"
#include "transport/ucx_endpoint_internal.h"

namespace bagpipe::transport::ucx {
namespace {

constexpr size_t kMaxDoorbellEntries = 256;  // per doorbell (fits UCX's AM header limit)

}  // namespace

void Endpoint::SendDoorbells() {
  while (!flushes_.empty() && flushes_.front()->done) {
    Op* f = flushes_.front();
    flushes_.pop_front();
    if (f->status == UCS_OK && !failed_flag_.load(std::memory_order_acquire)) {
      // The flush completed: every write it covers is visible in the ring. Name them.
      for (size_t i = 0; i < f->entries.size(); i += kMaxDoorbellEntries) {
        const size_t n = std::min(kMaxDoorbellEntries, f->entries.size() - i);
        DoSend(wire::kAmDoorbell, f->entries.data() + i, n * sizeof(wire::DoorbellEntry), nullptr,
               0, nullptr, nullptr);
      }
    }
    DeleteOp(f);
  }
}

void Endpoint::DoPut(uint32_t slot, size_t len, uint64_t tag) {
  if (failed_flag_.load(std::memory_order_acquire) || ep_ == nullptr) return;
  const wire::DoorbellEntry entry{slot, 0, len, tag};
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.frames;
    if (frame_mode_ == FrameMode::kPut) {
      ++stats_.puts;
      stats_.put_bytes += len;
    }
  }
  if (frame_mode_ == FrameMode::kMessage) {
    // The frame is the doorbell's payload, sent zero-copy from the registered source slot.
    DoSend(wire::kAmDoorbell, &entry, sizeof(entry), source_ptrs_[slot], len,
           sources_[slot]->memh(), nullptr);
    return;
  }
  ucp_request_param_t prm{};
  prm.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH;
  prm.memh = sources_[slot]->memh();
  const uint64_t remote = remote_ring_addr_ + wire::kRingHeaderBytes + uint64_t{slot} * slot_stride_;
  ucs_status_ptr_t st = ucp_put_nbx(ep_, source_ptrs_[slot], len, remote, rkey_->handle(), &prm);
  if (UCS_PTR_IS_ERR(st)) {
    Fail(StatusText("one-sided write into PS shard " + peer_ + "'s slot " + std::to_string(slot),
                    UCS_PTR_STATUS(st)));
    return;
  }
  // The write's completion is observed through the flush that covers it.
  if (st != nullptr) ucp_request_free(st);
  unrung_.push_back(entry);
}

void Endpoint::DoFlush() {
  if (failed_flag_.load(std::memory_order_acquire) || ep_ == nullptr || unrung_.empty()) return;
  Op* op = NewOp(static_cast<int>(Op::Kind::kFlush));
  op->entries.swap(unrung_);
  ucp_request_param_t prm{};
  prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  prm.cb.send = &Endpoint::OnSendDone;
  prm.user_data = op;
  flushes_.push_back(op);
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.flushes;
  }
  Track(op, ucp_ep_flush_nbx(ep_, &prm));
}

void Endpoint::DoSend(unsigned am_id, const void* head, size_t head_len, const void* payload,
                      size_t payload_len, ucp_mem_h memh, std::function<void(bool)> on_sent) {
  if (failed_flag_.load(std::memory_order_acquire) || ep_ == nullptr) {
    if (on_sent) on_sent(false);
    return;
  }
  Op* op = NewOp(static_cast<int>(Op::Kind::kSend));
  const wire::MessagePrefix prefix{next_send_seq_++, wire_id_};
  op->header.resize(sizeof(prefix) + head_len);
  std::memcpy(op->header.data(), &prefix, sizeof(prefix));
  if (head_len > 0) std::memcpy(op->header.data() + sizeof(prefix), head, head_len);
  op->on_sent = std::move(on_sent);
  ucp_request_param_t prm{};
  prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  prm.cb.send = &Endpoint::OnSendDone;
  prm.user_data = op;
  if (memh != nullptr) {
    prm.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    prm.memh = memh;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (am_id == wire::kAmFrame) {
      ++stats_.messages_sent;
      stats_.message_bytes_sent += head_len + payload_len;
    } else {
      ++stats_.doorbells;
    }
  }
  Track(op, ucp_am_send_nbx(ep_, am_id, op->header.data(), op->header.size(), payload,
                            payload_len, &prm));
}

void Endpoint::Land(Incoming& in, uint8_t* dst, std::function<void(bool)> done,
                    std::shared_ptr<void> keepalive) {
  const uint64_t id = next_delivery_id_++;
  deliveries_.push_back(Delivery{id, false, false, std::move(done)});
  Delivery& d = deliveries_.back();
  const uint8_t* bytes = in.held ? static_cast<const uint8_t*>(in.data) : in.copy.data();
  if (in.length == 0) {
    d.landed = true;
    d.ok = true;
  } else if (dst == nullptr || failed_flag_.load(std::memory_order_acquire)) {
    if (in.held) ucp_am_data_release(worker_, in.data);
    d.landed = true;
    d.ok = false;
  } else if (!in.rndv) {
    std::memcpy(dst, bytes, in.length);
    if (in.held) ucp_am_data_release(worker_, in.data);
    d.landed = true;
    d.ok = true;
  } else {
    Op* op = NewOp(static_cast<int>(Op::Kind::kRecv));
    op->delivery = id;
    op->keepalive = std::move(keepalive);
    ucp_request_param_t prm{};
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    prm.cb.recv_am = &Endpoint::OnRecvDone;
    prm.user_data = op;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.rendezvous_receives;
    }
    Track(op, ucp_am_recv_data_nbx(worker_, in.data, dst, in.length, &prm));
  }
  in.held = false;
  FinishDeliveries();
}

void Endpoint::DispatchRingFrames(const std::vector<wire::DoorbellEntry>& entries) {
  for (const auto& e : entries) {
    if (failed_flag_.load(std::memory_order_acquire)) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.ring_frames;
    }
    if (Handlers().on_ring_frame) {
      RingFrame f;
      f.slot = e.slot;
      f.data = ring_->data() + wire::kRingHeaderBytes + uint64_t{e.slot} * slot_stride_;
      f.len = e.len;
      f.tag = e.tag;
      Handlers().on_ring_frame(f);
    }
  }
}

void Endpoint::HandleDoorbell(Incoming& in) {
  const size_t n = in.head.size() / sizeof(wire::DoorbellEntry);
  std::vector<wire::DoorbellEntry> entries(n);
  bool ok = in.head.size() % sizeof(wire::DoorbellEntry) == 0 && n > 0 && n <= kMaxDoorbellEntries;
  if (ok) std::memcpy(entries.data(), in.head.data(), in.head.size());
  std::string why;
  for (size_t i = 0; ok && i < n; ++i) {
    const auto& e = entries[i];
    if (e.slot >= num_slots_ || e.len == 0 || e.len > slot_bytes_) {
      ok = false;
      why = "names slot " + std::to_string(e.slot) + " with " + std::to_string(e.len) +
            " bytes, outside the ring (" + std::to_string(num_slots_) + " slots of " +
            std::to_string(slot_bytes_) + " bytes)";
    }
  }
  // A doorbell with a payload carries exactly one frame (kMessage mode).
  if (ok && in.length > 0 && (n != 1 || in.length != entries[0].len)) {
    ok = false;
    why = "carries " + std::to_string(in.length) + " payload bytes for " + std::to_string(n) +
          " frames";
  }
  if (!ok) {
    if (in.held) ucp_am_data_release(worker_, in.data);
    in.held = false;
    Fail("malformed doorbell from " + peer_ + (why.empty() ? std::string() : ": " + why));
    return;
  }
  uint8_t* dst = in.length > 0 ? ring_->data() + wire::kRingHeaderBytes +
                                     uint64_t{entries[0].slot} * slot_stride_
                               : nullptr;
  Land(in, dst,
       [this, entries = std::move(entries)](bool landed) {
         if (landed) DispatchRingFrames(entries);
       },
       nullptr);
}

void Endpoint::HandleFrameMessage(Incoming& in) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.messages_received;
    stats_.message_bytes_received += in.head.size() + in.length;
  }
  Landing landing;
  if (Handlers().on_message) {
    landing = Handlers().on_message(in.head.data(), in.head.size(), in.length);
  } else {
    Fail("unexpected UCX message from " + peer_);
  }
  Land(in, landing.dst, std::move(landing.done), std::move(landing.keepalive));
}

}  // namespace bagpipe::transport::ucx
