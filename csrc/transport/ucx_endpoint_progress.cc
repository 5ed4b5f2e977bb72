// The progress loop of a UCX endpoint: set-up on its thread, one Step per iteration
// (commands, worker progress, completions, incoming messages in sequence order, failure
// handling), sleeping on the worker's event fd, the wake fd and the control connection.
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/errors.h"
#include "transport/ucx_endpoint.h"
#include "transport/ucx_endpoint_internal.h"

namespace bagpipe::transport::ucx {
namespace {

constexpr int kIdlePollMillis = 100;    // safety net: the loop re-checks at least this often
// The control connection (liveness) is looked at least this often, also while the worker
// keeps the loop busy (completions, incoming messages, ucp_worker_arm answering BUSY).
constexpr auto kLivenessCheck = std::chrono::milliseconds(10);
constexpr auto kSpin = std::chrono::microseconds(50);  // busy-poll while requests are in flight
constexpr unsigned kProgressBurst = 64;
constexpr size_t kMaxHeldMessages = 1 << 16;

}  // namespace

// ---- progress thread -------------------------------------------------------------------------------

void Endpoint::Setup() {
  if (group_ != nullptr) {
    worker_ = group_->SharedWorker(context_, &efd_);
    if (worker_ != nullptr) {
      shared_worker_ = true;
      return;
    }
  }
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  ucs_status_t st = ucp_worker_create(context_->handle(), &wp, &worker_);
  if (st != UCS_OK) ThrowStatus("ucp_worker_create (" + context_->config().Describe() + ")", st);
  for (unsigned id : {wire::kAmDoorbell, wire::kAmFrame}) {
    ucp_am_handler_param_t ap{};
    ap.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                    UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    ap.id = id;
    ap.flags = UCP_AM_FLAG_WHOLE_MSG | UCP_AM_FLAG_PERSISTENT_DATA;
    ap.cb = id == wire::kAmDoorbell ? &Endpoint::OnDoorbellAm : &Endpoint::OnFrameAm;
    ap.arg = this;
    st = ucp_worker_set_am_recv_handler(worker_, &ap);
    if (st != UCS_OK) ThrowStatus("ucp_worker_set_am_recv_handler", st);
  }
  if (ucp_worker_get_efd(worker_, &efd_) != UCS_OK) efd_ = -1;
}

bool Endpoint::SetUpOnGroup() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) {
      dropped_ = true;
      cv_.notify_all();
      return false;
    }
  }
  return SetupOnThisThread();
}

bool Endpoint::SetupOnThisThread() {
  try {
    Setup();
  } catch (const std::exception& e) {
    if (worker_ != nullptr && !shared_worker_) ucp_worker_destroy(worker_);
    worker_ = nullptr;
    shared_worker_ = false;
    std::lock_guard<std::mutex> lock(mu_);
    setup_error_ = e.what();
    cv_.notify_all();
    return false;
  }
  std::lock_guard<std::mutex> lock(mu_);
  thread_id_ = std::this_thread::get_id();
  started_ = true;
  cv_.notify_all();
  return true;
}

Endpoint::StepResult Endpoint::Step(bool control_ready) {
  if (monitoring_.load(std::memory_order_acquire) && control_.valid()) {
    // A busy worker must not hide a torn connection: the wait that watches the control
    // connection is skipped for as long as the loop finds work.
    const auto now = Clock::now();
    if (control_ready || now >= next_liveness_check_) {
      next_liveness_check_ = now + kLivenessCheck;
      pollfd c{control_.fd(), POLLIN, 0};
      if (::poll(&c, 1, 0) > 0 && c.revents != 0) CheckControl(c.revents);
    }
  }
  bool busy = RunCommands();
  for (unsigned i = 0; i < kProgressBurst && ucp_worker_progress(worker_) != 0; ++i) busy = true;
  ProcessCompleted();
  ProcessIncoming();
  if (failed_flag_.load(std::memory_order_acquire) && !failure_handled_) {
    HandleFailure();
    busy = true;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_requested_ && commands_.empty()) return StepResult::kStop;
  }
  if (busy || !completed_.empty()) {
    spinning_ = false;
    return StepResult::kBusy;
  }
  if (outstanding_ > 0) {
    // Completions of requests in flight come within microseconds: poll briefly before
    // paying for a sleep and a wake-up.
    const auto now = Clock::now();
    if (!spinning_) {
      spinning_ = true;
      spin_until_ = now + kSpin;
    }
    if (now < spin_until_) return StepResult::kBusy;
  }
  spinning_ = false;
  return StepResult::kIdle;
}

bool Endpoint::ArmForWait() {
  if (efd_ >= 0 && ucp_worker_arm(worker_) == UCS_ERR_BUSY) return false;
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.sleeps;
  return true;
}

void Endpoint::DrainWake() {
  uint64_t v;
  [[maybe_unused]] ssize_t r = ::read(wake_fd_, &v, sizeof(v));
}

int Endpoint::WatchedControlFd() const {
  return monitoring_.load(std::memory_order_acquire) && control_.valid() ? control_.fd() : -1;
}

void Endpoint::FinishOnGroup() {
  Teardown();
  std::lock_guard<std::mutex> lock(mu_);
  torn_down_ = true;
  cv_.notify_all();
}

void Endpoint::Loop() {
  if (!SetupOnThisThread()) return;
  for (;;) {
    const StepResult r = Step(false);
    if (r == StepResult::kStop) break;
    if (r == StepResult::kBusy || !ArmForWait()) continue;
    pollfd fds[3];
    nfds_t n = 0;
    fds[n++] = {wake_fd_, POLLIN, 0};
    if (efd_ >= 0) fds[n++] = {efd_, POLLIN, 0};
    const int control = WatchedControlFd();
    if (control >= 0) fds[n++] = {control, POLLIN, 0};
    const int rc = ::poll(fds, n, efd_ >= 0 ? kIdlePollMillis : 1);
    if (rc > 0) {
      if (fds[0].revents & POLLIN) DrainWake();
      if (control >= 0 && fds[n - 1].revents != 0) CheckControl(fds[n - 1].revents);
    }
  }
  Teardown();
}

bool Endpoint::RunCommands() {
  std::vector<std::function<void()>> cmds;
  {
    std::lock_guard<std::mutex> lock(mu_);
    cmds.swap(commands_);
  }
  // batch_left_: the commands of this batch after the running one (a SendMessage made by a
  // command queues behind them, keeping call order).
  batch_left_ = cmds.size();
  for (auto& c : cmds) {
    --batch_left_;
    c();
  }
  return !cmds.empty();
}

void Endpoint::CheckControl(short revents) {
  if (!(revents & (POLLIN | POLLHUP | POLLERR))) return;
  uint8_t b = 0;
  const ssize_t n = ::recv(control_.fd(), &b, 1, MSG_DONTWAIT);
  const std::string who = role_ == Role::kClient ? "PS shard " + peer_ : peer_;
  if (n == 1 && b == wire::kByeByte) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!failed_) failure_.peer_closed = true;
    }
    Fail(who + " closed the connection");
  } else if (n == 1) {
    Fail(who + " sent an unexpected byte on the control connection");
  } else if (n == 0) {
    Fail("connection to " + who +
         " torn: control connection closed without a goodbye (peer process gone?)");
  } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
    Fail("connection to " + who + " torn: " + std::strerror(errno));
  }
}

Endpoint::Op* Endpoint::NewOp(int kind) {
  Op* op = new Op(static_cast<Op::Kind>(kind));
  op->ep = this;
  live_ops_.push_back(op);
  return op;
}

void Endpoint::DeleteOp(Op* op) {
  auto it = std::find(live_ops_.begin(), live_ops_.end(), op);
  if (it != live_ops_.end()) {
    *it = live_ops_.back();
    live_ops_.pop_back();
  }
  delete op;
}

void Endpoint::Track(Op* op, ucs_status_ptr_t st) {
  if (st == nullptr) {
    op->status = UCS_OK;
    completed_.push_back(op);
  } else if (UCS_PTR_IS_ERR(st)) {
    op->status = UCS_PTR_STATUS(st);
    completed_.push_back(op);
  } else {
    op->in_flight = true;
    ++outstanding_;
  }
}

void Endpoint::OnSendDone(void* request, ucs_status_t status, void* user_data) {
  auto* op = static_cast<Op*>(user_data);
  if (op->ep == nullptr) {  // orphaned: its endpoint is gone (ucx_progress.h invariant 4)
    ucp_request_free(request);
    op->orphan_of->Unorphan(op);
    return;
  }
  if (op->ep->shared_worker_) op->ep->group_->Woke(op->ep);
  op->status = status;
  op->in_flight = false;
  --op->ep->outstanding_;
  op->ep->completed_.push_back(op);
  ucp_request_free(request);
}

void Endpoint::OnRecvDone(void* request, ucs_status_t status, size_t /*length*/, void* user_data) {
  OnSendDone(request, status, user_data);
}

void Endpoint::OnEndpointError(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  auto* self = static_cast<Endpoint*>(arg);
  // A peer that said goodbye and then closed its endpoint is a graceful close, whichever of
  // the two this side notices first.
  if (self->monitoring_.load(std::memory_order_acquire) && self->control_.valid()) {
    uint8_t b = 0;
    if (::recv(self->control_.fd(), &b, 1, MSG_PEEK | MSG_DONTWAIT) == 1 && b == wire::kByeByte) {
      self->CheckControl(POLLIN);
      return;
    }
  }
  const std::string who = self->role_ == Role::kClient ? "PS shard " + self->peer_ : self->peer_;
  self->Fail(StatusText("connection to " + who + " torn: UCX endpoint failed", status));
}

ucs_status_t Endpoint::OnDoorbellAm(void* arg, const void* header, size_t header_len, void* data,
                                    size_t length, const ucp_am_recv_param_t* param) {
  return static_cast<Endpoint*>(arg)->ReceiveAm(wire::kAmDoorbell, header, header_len, data,
                                                length, param);
}

ucs_status_t Endpoint::OnFrameAm(void* arg, const void* header, size_t header_len, void* data,
                                 size_t length, const ucp_am_recv_param_t* param) {
  return static_cast<Endpoint*>(arg)->ReceiveAm(wire::kAmFrame, header, header_len, data, length,
                                                param);
}

ucs_status_t Endpoint::ReceiveAm(unsigned am_id, const void* header, size_t header_len,
                                 void* data, size_t length, const ucp_am_recv_param_t* param) {
  if (failed_flag_.load(std::memory_order_acquire)) return UCS_OK;  // dropped
  // Doorbells only flow to shards, frame messages only to clients.
  const unsigned expected = role_ == Role::kServer ? wire::kAmDoorbell : wire::kAmFrame;
  if (header_len >= sizeof(wire::MessagePrefix)) {
    wire::MessagePrefix p;
    std::memcpy(&p, header, sizeof(p));
    if (p.ring_id != wire_id_) {
      Fail("malformed UCX message from " + peer_ + " (names another connection)");
      return UCS_OK;
    }
  }
  if (am_id != expected) {
    Fail("UCX message of the wrong kind (" + std::to_string(am_id) + ") from " + peer_);
    return UCS_OK;
  }
  if (header_len < sizeof(wire::MessagePrefix)) {
    Fail("malformed UCX message from " + peer_ + " (no sequence prefix)");
    return UCS_OK;
  }
  wire::MessagePrefix prefix;
  std::memcpy(&prefix, header, sizeof(prefix));
  if (prefix.seq < next_recv_seq_ || incoming_.count(prefix.seq) != 0 ||
      incoming_.size() >= kMaxHeldMessages) {
    Fail("UCX message from " + peer_ + " out of sequence (seq " + std::to_string(prefix.seq) +
         ", expected " + std::to_string(next_recv_seq_) + ")");
    return UCS_OK;
  }
  const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  const bool persistent = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_DATA) != 0;
  Incoming in;
  in.am_id = am_id;
  const auto* h = static_cast<const uint8_t*>(header);
  in.head.assign(h + sizeof(prefix), h + header_len);
  in.length = length;
  ucs_status_t ret = UCS_OK;
  if (length > 0) {
    if (rndv || persistent) {
      in.data = data;
      in.rndv = rndv;
      in.held = true;
      ret = UCS_INPROGRESS;
    } else {
      const auto* d = static_cast<const uint8_t*>(data);
      in.copy.assign(d, d + length);
    }
  }
  incoming_.emplace(prefix.seq, std::move(in));
  return ret;
}

void Endpoint::ProcessCompleted() {
  while (!completed_.empty()) {
    std::vector<Op*> ops;
    ops.swap(completed_);
    for (Op* op : ops) {
      const bool ok = op->status == UCS_OK;
      switch (op->kind) {
        case Op::Kind::kFlush:
          op->done = true;  // deleted by SendDoorbells, in flush order
          if (!ok) Fail(StatusText("flushing writes to PS shard " + peer_, op->status));
          break;
        case Op::Kind::kSend:
          if (!ok) Fail(StatusText("sending to " + peer_, op->status));
          if (op->on_sent) op->on_sent(ok);
          DeleteOp(op);
          break;
        case Op::Kind::kRecv:
          if (!ok) Fail(StatusText("receiving a payload from " + peer_, op->status));
          if (!deliveries_.empty() && op->delivery >= deliveries_.front().id &&
              op->delivery - deliveries_.front().id < deliveries_.size()) {
            Delivery& d = deliveries_[op->delivery - deliveries_.front().id];
            d.landed = true;
            d.ok = ok;
          }
          DeleteOp(op);
          break;
        case Op::Kind::kGet:
          if (op->finish) op->finish(op);
          DeleteOp(op);
          break;
      }
    }
    SendDoorbells();
    FinishDeliveries();
  }
}

void Endpoint::ProcessIncoming() {
  while (!incoming_.empty() && incoming_.begin()->first == next_recv_seq_ &&
         !failed_flag_.load(std::memory_order_acquire)) {
    Incoming in = std::move(incoming_.begin()->second);
    incoming_.erase(incoming_.begin());
    ++next_recv_seq_;
    if (in.am_id == wire::kAmDoorbell) {
      HandleDoorbell(in);
    } else {
      HandleFrameMessage(in);
    }
    if (in.held) ucp_am_data_release(worker_, in.data);
  }
}

void Endpoint::FinishDeliveries() {
  while (!deliveries_.empty() && deliveries_.front().landed) {
    Delivery d = std::move(deliveries_.front());
    deliveries_.pop_front();
    if (d.done) d.done(d.ok);
  }
}

}  // namespace bagpipe::transport::ucx
