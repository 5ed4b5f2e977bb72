// What comes back to a PSClient: replies to its packets, the shards' notifications, request
// and channel failures, and how each finishes an operation or fails the client.
#include <algorithm>
#include <cstring>

#include "client/ps_client.h"
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

// ---- replies ------------------------------------------------------------------------------------

std::string PSClient::ShardName(uint32_t shard) const {
  return "PS shard " + std::to_string(shard) + " (" + channels_[shard]->peer() + ")";
}

void PSClient::FinishLocked(const std::shared_ptr<ClientOp>& op, const std::optional<Error>& e) {
  op->finished_ = true;
  auto it = std::find(active_.begin(), active_.end(), op);
  if (it != active_.end()) active_.erase(it);
  op->Finish(e);
  work_cv_.notify_all();
  idle_cv_.notify_all();
}

void PSClient::MaybeFinishLocked(const std::shared_ptr<ClientOp>& op) {
  if (op->finished_ || !op->staged_ || op->outstanding_ > 0) return;
  if (op->kind_ == OpKind::kCommit && MinCommittedLocked() < op->step_) return;
  FinishLocked(op, std::nullopt);
}

void PSClient::FailClientLocked(const Error& error) {
  if (!failed_) failed_ = error;
  abort_.store(true);
  const Error e = *failed_;
  for (auto& op : queue_) {
    op->finished_ = true;
    op->Finish(e);
  }
  queue_.clear();
  auto active = active_;
  for (auto& op : active) {
    if (!op->finished_) FinishLocked(op, e);
  }
  work_cv_.notify_all();
  idle_cv_.notify_all();
}

void PSClient::OnAckReply(const std::shared_ptr<ClientOp>& op, uint32_t shard, const Reply& r) {
  std::lock_guard<std::mutex> lock(mu_);
  if (op->finished_) return;
  const std::string who = ShardName(shard);
  if (r.status() != Status::kOk) {
    const Error e{transport::KindOfStatus(r.status()), who + ": " + r.Text()};
    FinishLocked(op, e);
    // A refused commit or assign leaves this rank's protocol state unknown.
    if (op->kind_ != OpKind::kCheckpoint) FailClientLocked(e);
    return;
  }
  const MsgType want = op->kind_ == OpKind::kCommit   ? MsgType::kAck
                       : op->kind_ == OpKind::kAssign ? MsgType::kAssignOk
                                                      : MsgType::kCheckpointOk;
  if (r.type() != want || r.fixed_len != wire::FixedBodyBytes(want)) {
    const Error e{ErrorKind::kTransport, who + " answered a " + OpName(op->kind_) + " with a " +
                                             wire::MsgTypeName(r.header.type)};
    FinishLocked(op, e);
    FailClientLocked(e);
    return;
  }
  if (want == MsgType::kAck) {
    const auto ack = wire::Load<wire::AckBody>(r.fixed);
    committed_[shard] = std::max(committed_[shard], ack.committed_step);
  } else {
    const auto sb = wire::Load<wire::StepBody>(r.fixed);
    if (want == MsgType::kCheckpointOk) op->shard_steps_[shard] = sb.step;
  }
  --op->outstanding_;
  MaybeFinishLocked(op);
}

void PSClient::OnGetReply(const std::shared_ptr<ClientOp>& op, uint32_t shard, const Reply& r,
                          const int64_t* positions, size_t count, bool direct) {
  const size_t dim = options_.dim + op->state_dim_;  // the width of a reply row
  const std::string who = ShardName(shard);
  std::optional<Error> err;
  int64_t served = -1;
  if (r.status() != Status::kOk) {
    err = Error{transport::KindOfStatus(r.status()), who + ": " + r.Text()};
  } else if (r.type() != MsgType::kGetOk || r.fixed_len != sizeof(wire::GetOkBody) ||
             r.payload_len != count * dim * 4) {
    err = Error{ErrorKind::kTransport, who + " answered a get with a malformed " +
                                           wire::MsgTypeName(r.header.type)};
  } else {
    const auto body = wire::Load<wire::GetOkBody>(r.fixed);
    if (body.nrows != count || body.dim != options_.dim || body.state_dim != op->state_dim_) {
      err = Error{ErrorKind::kTransport, who + " answered a get of " + std::to_string(count) +
                                             " rows with " + std::to_string(body.nrows)};
    } else {
      served = body.served_step;
      const auto* src = reinterpret_cast<const float*>(r.payload);
      float* dst0 = op->out_ + positions[0] * static_cast<int64_t>(dim);
      if (!(direct && src == dst0)) {
        // Materialise out of the slot before it is reused.
        for (size_t i = 0; i < count; ++i) {
          std::memcpy(op->out_ + positions[i] * static_cast<int64_t>(dim), src + i * dim, dim * 4);
        }
      }
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (op->finished_) return;
  if (err) {
    FinishLocked(op, err);
    if (err->kind == ErrorKind::kTransport) FailClientLocked(*err);
    return;
  }
  committed_[shard] = std::max(committed_[shard], served);
  --op->outstanding_;
  MaybeFinishLocked(op);
}

void PSClient::OnRequestFailure(const std::shared_ptr<ClientOp>& op, uint32_t shard,
                                const Error& error, bool fatal) {
  const Error e{error.kind, ShardName(shard) + ": " + error.message};
  std::lock_guard<std::mutex> lock(mu_);
  if (!op->finished_) FinishLocked(op, e);
  if (fatal && !quiet_) FailClientLocked(e);
}

void PSClient::OnNotify(uint32_t shard, const Reply& r) {
  std::lock_guard<std::mutex> lock(mu_);
  if (r.type() == MsgType::kNotifyCommitted && r.fixed_len == sizeof(wire::StepBody)) {
    const auto sb = wire::Load<wire::StepBody>(r.fixed);
    if (sb.session != options_.session) return;
    committed_[shard] = std::max(committed_[shard], sb.step);
    auto active = active_;
    for (auto& op : active) {
      if (op->kind_ == OpKind::kCommit) MaybeFinishLocked(op);
    }
    work_cv_.notify_all();
  } else if (r.type() == MsgType::kNotifyFailed) {
    if (quiet_) return;
    FailClientLocked(Error{ErrorKind::kSession, ShardName(shard) + ": " + r.Text()});
  } else if (r.type() == MsgType::kNotifyShutdown) {
    // The shard drains: it refuses new work from now on, so this client cannot go on.
    if (quiet_) return;
    FailClientLocked(Error{ErrorKind::kShuttingDown,
                           ShardName(shard) + ": " + r.Text() +
                               " (it accepts no more commits or reads)"});
  } else if (r.type() == MsgType::kNotifyCheckpoint &&
             r.fixed_len == sizeof(wire::CheckpointNoteBody)) {
    const auto note = wire::Load<wire::CheckpointNoteBody>(r.fixed);
    if (note.session != options_.session) return;
    auto& c = checkpoints_;
    if (r.status() == Status::kOk) {
      ++c.succeeded;
      c.consecutive_failures[shard] = 0;
      c.last_step[shard] = std::max(c.last_step[shard], note.step);
    } else {
      ++c.failed;
      ++c.consecutive_failures[shard];
      c.last_error = ShardName(shard) + ": periodic checkpoint of step " +
                     std::to_string(note.step) + " failed: " + r.Text();
    }
  }
}

void PSClient::OnChannelFailure(uint32_t shard, const Error& error) {
  std::lock_guard<std::mutex> lock(mu_);
  if (quiet_) return;
  FailClientLocked(Error{error.kind, ShardName(shard) + ": " + error.message});
}

}  // namespace bagpipe::client
