// The end of a UCX endpoint: failure handling (ucx_endpoint.h invariant 4) and the
// teardown of its worker (invariant 5), each with bounded waits for what UCX still holds.
#include <sys/socket.h>

#include "transport/ucx_endpoint.h"
#include "transport/ucx_endpoint_internal.h"

namespace bagpipe::transport::ucx {

void Endpoint::CloseEndpoint(bool force) {
  if (ep_ == nullptr) return;
  rkey_.reset();
  ucp_request_param_t prm{};
  prm.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  prm.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ucs_status_ptr_t req = ucp_ep_close_nbx(ep_, &prm);
  ep_ = nullptr;
  if (req == nullptr || UCS_PTR_IS_ERR(req)) return;
  const Deadline deadline = DeadlineAfter(kCloseTimeout);
  while (ucp_request_check_status(req) == UCS_INPROGRESS && Clock::now() < deadline) {
    ucp_worker_progress(worker_);
    ProcessCompleted();
  }
  ucp_request_free(req);
}

void Endpoint::WaitOutstanding(Deadline deadline) {
  while (outstanding_ > 0 && Clock::now() < deadline) {
    ucp_worker_progress(worker_);
    ProcessCompleted();
  }
  ProcessCompleted();
}

void Endpoint::HandleFailure() {
  failure_handled_ = true;
  // Tell the peer first: it sees the tear on its control connection now, not after the
  // bounded waits below (up to 2 x kCloseTimeout) and this endpoint's owner closing it.
  ShutdownControl();
  CloseEndpoint(/*force=*/true);
  WaitOutstanding(DeadlineAfter(kCloseTimeout));
  for (auto& [seq, in] : incoming_) {
    if (in.held) ucp_am_data_release(worker_, in.data);
  }
  incoming_.clear();
  unrung_.clear();
  // Flushes that never completed name frames the shard will never see.
  while (!flushes_.empty() && flushes_.front()->done) SendDoorbells();
  // Sends UCX never completed keep their buffers (on_sent is not called: the buffer may
  // still be read); their callers learn of the failure from on_failure.
  for (auto& d : deliveries_) {
    if (!d.landed) {
      d.landed = true;
      d.ok = false;
    }
  }
  FinishDeliveries();
  Failure failure;
  {
    std::lock_guard<std::mutex> lock(mu_);
    failure = failure_;
    failure_done_ = true;
    cv_.notify_all();
  }
  if (Handlers().on_failure) Handlers().on_failure(failure);
}

void Endpoint::Teardown() {
  bool graceful;
  {
    std::lock_guard<std::mutex> lock(mu_);
    graceful = graceful_stop_ && !failed_;
  }
  if (graceful && ep_ != nullptr) WaitOutstanding(DeadlineAfter(kCloseTimeout));
  // Goodbye first: the peer then reads our endpoint closing as the graceful close it is.
  if (graceful && monitoring_.load() && control_.valid()) {
    const uint8_t bye = wire::kByeByte;
    [[maybe_unused]] ssize_t n = ::send(control_.fd(), &bye, 1, MSG_NOSIGNAL | MSG_DONTWAIT);
  }
  monitoring_.store(false);
  // A forced close tells the peer first (see HandleFailure); a graceful one said Bye.
  if (!graceful) ShutdownControl();
  CloseEndpoint(/*force=*/!graceful);
  WaitOutstanding(DeadlineAfter(kCloseTimeout));
  for (auto& [seq, in] : incoming_) {
    if (in.held) ucp_am_data_release(worker_, in.data);
  }
  incoming_.clear();
  flushes_.clear();   // their ops are in live_ops_
  deliveries_.clear();
  completed_.clear();
  rkey_.reset();
  // No message reaches this endpoint from now on (ucx_progress.h invariant 5).
  if (group_ != nullptr) group_->Unregister(wire_id_);
  if (shared_worker_) {
    // The worker lives on with the group: a request UCX never completed goes to the group
    // with its buffers (ucx_progress.h invariant 4).
    for (Op* op : live_ops_) {
      if (op->in_flight) {
        op->ep = nullptr;
        op->orphan_of = group_.get();
        group_->Orphan(op);
      } else {
        delete op;
      }
    }
  } else {
    ucp_worker_destroy(worker_);
    // No callback can run after the worker is gone: free what UCX never completed.
    for (Op* op : live_ops_) delete op;
  }
  worker_ = nullptr;
  live_ops_.clear();
  outstanding_ = 0;
  std::lock_guard<std::mutex> lock(mu_);
  failure_done_ = true;
  cv_.notify_all();
}

}  // namespace bagpipe::transport::ucx
