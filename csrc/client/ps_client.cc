#include "client/ps_client.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "client/ps_client_internal.h"
#include "common/errors.h"

namespace bagpipe::client {

using transport::Channel;
using transport::Error;
using transport::ErrorKind;
using transport::Reply;
using wire::kHeaderBytes;
using wire::MsgType;
using wire::Status;

size_t SlotBytesFor(const ClientOptions& o) {
  const size_t rows = std::max<uint32_t>(o.max_packet_rows, 1);
  const size_t width = size_t{o.dim} + store::StateDim(o.optimizer.kind, static_cast<int>(o.dim));
  size_t bytes = std::max(wire::CommitFrameBytes(rows, o.dim), wire::AssignFrameBytes(rows, width));
  bytes = std::max(bytes, wire::GetFrameBytes(rows));
  bytes = std::max(bytes, kHeaderBytes + sizeof(wire::OpenBody) +
                             o.init.bound_starts.size() * 12 + wire::kMaxTableName);
  return bytes;
}

transport::ChannelOptions ChannelOptionsFor(const ClientOptions& o) {
  transport::ChannelOptions c;
  c.num_slots = o.inflight_packets;
  c.slot_bytes = SlotBytesFor(o);
  c.io_timeout = o.timeout;
  return c;
}

// ---- ClientOp -------------------------------------------------------------------------------

bool ClientOp::Done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

void ClientOp::Wait(Deadline deadline) const {
  std::unique_lock<std::mutex> lock(mu_);
  while (!done_) {
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && !done_) {
      std::string what = OpName(kind_);
      if (kind_ == OpKind::kCommit) what += " of step " + std::to_string(step_);
      if (kind_ == OpKind::kGet) what += " at step " + std::to_string(step_);
      throw TimeoutError(what + " did not complete within the timeout");
    }
  }
  if (error_) transport::ThrowError(*error_);
}

void ClientOp::Finish(const std::optional<Error>& error) {
  std::lock_guard<std::mutex> lock(mu_);
  if (done_) return;
  done_ = true;
  error_ = error;
  cv_.notify_all();
}

// ---- submission -----------------------------------------------------------------------------

void PSClient::CheckKeys(const int64_t* keys, size_t n, const char* what) const {
  if (options_.key_bound < 0) return;
  for (size_t i = 0; i < n; ++i) {
    if (keys[i] < 0 || keys[i] >= options_.key_bound) {
      throw ValueError(std::string(what) + ": key " + std::to_string(keys[i]) + " at position " +
                       std::to_string(i) + " is outside [0, " + std::to_string(options_.key_bound) +
                       ") of table '" + options_.table + "'");
    }
  }
}

std::shared_ptr<ClientOp> PSClient::Enqueue(std::shared_ptr<ClientOp> op) {
  std::lock_guard<std::mutex> lock(mu_);
  if (closing_) {
    op->Finish(Error{ErrorKind::kSession, "PSClient of table '" + options_.table + "' is closed"});
    return op;
  }
  if (failed_) {
    op->Finish(*failed_);
    return op;
  }
  op->deadline_ = DeadlineAfter(options_.timeout);
  queue_.push_back(op);
  work_cv_.notify_all();
  return op;
}

std::shared_ptr<ClientOp> PSClient::CommitAsync(int64_t step, const int64_t* keys, size_t n,
                                                const float* grads, std::function<void()> ready,
                                                std::optional<float> lr, const int64_t* evict,
                                                size_t nevict) {
  if (step < 0) throw ValueError("step must be >= 0, got " + std::to_string(step));
  const float step_lr = lr.value_or(options_.lr);
  if (!std::isfinite(step_lr) || step_lr < 0.0f) {
    throw ValueError("lr must be finite and >= 0, got " + std::to_string(step_lr));
  }
  CheckKeys(keys, n, "keys");
  std::shared_ptr<ClientOp> op(new ClientOp(OpKind::kCommit, step));
  op->keys_ = keys;
  op->n_ = n;
  op->rows_ = grads;
  op->ready_ = std::move(ready);
  op->lr_ = step_lr;
  if (nevict > 0) {
    CheckKeys(evict, nevict, "evict");
    op->evict_ = evict;
    op->nevict_ = nevict;
  }
  return Enqueue(std::move(op));
}

std::shared_ptr<ClientOp> PSClient::GetAsync(const int64_t* keys, size_t n, int64_t at_step,
                                             float* out, bool with_state) {
  if (at_step < -1) throw ValueError("at_step must be >= -1, got " + std::to_string(at_step));
  CheckKeys(keys, n, "keys");
  std::shared_ptr<ClientOp> op(new ClientOp(OpKind::kGet, at_step));
  op->keys_ = keys;
  op->n_ = n;
  op->out_ = out;
  op->state_dim_ = with_state ? state_dim_ : 0;
  return Enqueue(std::move(op));
}

std::shared_ptr<ClientOp> PSClient::AssignAsync(const int64_t* keys, size_t n, const float* rows,
                                                bool with_state) {
  CheckKeys(keys, n, "keys");
  std::shared_ptr<ClientOp> op(new ClientOp(OpKind::kAssign, -1));
  op->keys_ = keys;
  op->n_ = n;
  op->rows_ = rows;
  op->state_dim_ = with_state ? state_dim_ : 0;
  return Enqueue(std::move(op));
}

std::shared_ptr<ClientOp> PSClient::CheckpointAsync(const std::string& label) {
  if (!label.empty() && !wire::ValidTableName(label)) {
    throw ValueError("checkpoint label '" + label +
                     "' must be 1-128 characters of [A-Za-z0-9_.:-], not . or ..");
  }
  std::shared_ptr<ClientOp> op(new ClientOp(OpKind::kCheckpoint, -1));
  op->label_ = label;
  op->shard_steps_.assign(channels_.size(), -1);
  return Enqueue(std::move(op));
}

// ---- queries and shutdown ------------------------------------------------------------------------

int64_t PSClient::CommittedStep() {
  std::lock_guard<std::mutex> lock(mu_);
  return MinCommittedLocked();
}

std::vector<int64_t> PSClient::ShardCommittedSteps() {
  std::lock_guard<std::mutex> lock(mu_);
  return committed_;
}

CheckpointReport PSClient::checkpoint_report() {
  std::lock_guard<std::mutex> lock(mu_);
  CheckpointReport r;
  r.succeeded = checkpoints_.succeeded;
  r.failed = checkpoints_.failed;
  for (uint32_t c : checkpoints_.consecutive_failures) r.consecutive_failures = std::max(r.consecutive_failures, c);
  r.last_step = checkpoints_.last_step;
  r.last_error = checkpoints_.last_error;
  return r;
}

std::optional<Error> PSClient::failure() {
  std::lock_guard<std::mutex> lock(mu_);
  return failed_;
}

ClientStats PSClient::stats() {
  ClientStats s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    s = stats_;
  }
  for (const auto& ch : channels_) {
    const auto cs = ch->stats();
    s.packets += cs.frames_sent;
    s.bytes_sent += cs.bytes_sent;
    s.bytes_received += cs.bytes_received;
    s.slot_waits += cs.slot_waits;
  }
  return s;
}

std::vector<transport::ChannelStats> PSClient::channel_stats() {
  std::vector<transport::ChannelStats> out;
  for (const auto& ch : channels_) out.push_back(ch->stats());
  return out;
}

std::vector<std::string> PSClient::shard_peers() const {
  std::vector<std::string> out;
  for (const auto& ch : channels_) out.push_back(ch->peer());
  return out;
}

}  // namespace bagpipe::client
