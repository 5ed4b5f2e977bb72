// Private declarations shared by the files of PSClient (ps_client.h): the requests whose
// replies drive an operation, and the words of its error messages. PSClient is one idea in
// four files: ps_client.cc (options, handles, submission, queries), ps_client_session.cc
// (opening and closing the sessions), ps_client_staging.cc (the worker: picking, expiring and
// staging operations into packets) and ps_client_replies.cc (replies, notifications and
// failures).
//
// Thread safety: a request's callbacks run on its channel's receive thread and take the
// client's mutex (PSClient::On*); a SyncRequest is read by the thread that posted it, after
// the channel went idle.
// Invariants:
//   1. A request holds its operation (shared_ptr) until its reply or failure was handled.
//   2. A GetRequest's positions point into its operation's order_, which lives as long.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "client/ps_client.h"

namespace bagpipe::client {

using transport::Error;
using transport::ErrorKind;
using transport::Reply;
using wire::kHeaderBytes;
using wire::MsgType;
using wire::Status;

// "[s0, s1, ...]": the shards' committed steps in a message.
inline std::string StepsText(const std::vector<int64_t>& steps) {
  std::string s = "[";
  for (size_t i = 0; i < steps.size(); ++i) s += (i ? ", " : "") + std::to_string(steps[i]);
  return s + "]";
}

// The operation's name in a message ("commit", "get", ...).
inline const char* OpName(OpKind k) {
  switch (k) {
    case OpKind::kCommit: return "commit";
    case OpKind::kGet: return "get";
    case OpKind::kAssign: return "assign";
    case OpKind::kCheckpoint: return "checkpoint";
  }
  return "operation";
}

// ---- requests ---------------------------------------------------------------------------------

// A packet whose reply is a plain acknowledgement (Ack, AssignOk, CheckpointOk).
class PSClient::AckRequest : public transport::PendingRequest {
 public:
  // One packet of `op` to shard `shard`. REQUIRES: client outlives the request.
  AckRequest(PSClient* client, std::shared_ptr<ClientOp> op, uint32_t shard)
      : client_(client), op_(std::move(op)), shard_(shard) {}
  // The reply or the failure goes to the client; a failure fails the client (fatal).
  void OnReply(const Reply& r) override { client_->OnAckReply(op_, shard_, r); }
  void OnFailure(const Error& e) override { client_->OnRequestFailure(op_, shard_, e, true); }

 private:
  PSClient* const client_;
  const std::shared_ptr<ClientOp> op_;
  const uint32_t shard_;
};

// A GET packet: its rows land straight in the output when the chunk's positions are
// contiguous, else in the slot's reply buffer and are scattered from there.
class PSClient::GetRequest : public transport::PendingRequest {
 public:
  // `count` rows for op's output positions[0..count); `direct`: the positions are
  // consecutive. REQUIRES: client outlives the request; positions point into op->order_.
  GetRequest(PSClient* client, std::shared_ptr<ClientOp> op, uint32_t shard,
             const int64_t* positions, size_t count, bool direct)
      : client_(client), op_(std::move(op)), shard_(shard), positions_(positions), count_(count),
        direct_(direct) {}

  // Where a well-formed direct reply's rows go: op's output itself; nullptr otherwise.
  uint8_t* ReplySink(const Reply& head, size_t payload_len) override {
    const size_t width = client_->options_.dim + op_->state_dim_;
    if (!direct_ || head.type() != MsgType::kGetOk || head.status() != Status::kOk ||
        head.fixed_len != sizeof(wire::GetOkBody) || payload_len != count_ * width * 4) {
      return nullptr;
    }
    const auto body = wire::Load<wire::GetOkBody>(head.fixed);
    if (body.nrows != count_ || body.dim != client_->options_.dim ||
        body.state_dim != op_->state_dim_) {
      return nullptr;
    }
    return reinterpret_cast<uint8_t*>(op_->out_ + positions_[0] * static_cast<int64_t>(width));
  }
  // The reply or the failure goes to the client; a failure fails only this get.
  void OnReply(const Reply& r) override {
    client_->OnGetReply(op_, shard_, r, positions_, count_, direct_);
  }
  void OnFailure(const Error& e) override { client_->OnRequestFailure(op_, shard_, e, false); }

 private:
  PSClient* const client_;
  const std::shared_ptr<ClientOp> op_;
  const uint32_t shard_;
  const int64_t* const positions_;  // into op_->order_
  const size_t count_;
  const bool direct_;
};

// A request answered while the caller waits synchronously (Open, Close).
class PSClient::SyncRequest : public transport::ReplyCapture {
 public:
  // The outcome as an error, or nullopt if the reply is `want` with status ok.
  std::optional<Error> Check(MsgType want, const std::string& peer) {
    std::lock_guard<std::mutex> lock(mu);
    if (!done) return Error{ErrorKind::kTimeout, "no reply from PS shard " + peer + " within the timeout"};
    if (failure) return failure;
    if (status != Status::kOk) return Error{transport::KindOfStatus(status), text};
    if (type != want || fixed.size() != wire::FixedBodyBytes(want)) {
      return Error{ErrorKind::kTransport, "PS shard " + peer + " answered with a " +
                                              wire::MsgTypeName(static_cast<uint16_t>(type))};
    }
    return std::nullopt;
  }
};

}  // namespace bagpipe::client
