#include "client/ps_client.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "common/errors.h"

namespace bagpipe::client {

using transport::Channel;
using transport::Error;
using transport::ErrorKind;
using transport::Reply;
using wire::kHeaderBytes;
using wire::MsgType;
using wire::Status;

namespace {

std::string StepsText(const std::vector<int64_t>& steps) {
  std::string s = "[";
  for (size_t i = 0; i < steps.size(); ++i) s += (i ? ", " : "") + std::to_string(steps[i]);
  return s + "]";
}

const char* OpName(OpKind k) {
  switch (k) {
    case OpKind::kCommit: return "commit";
    case OpKind::kGet: return "get";
    case OpKind::kAssign: return "assign";
    case OpKind::kCheckpoint: return "checkpoint";
  }
  return "operation";
}

}  // namespace

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

// ---- requests ---------------------------------------------------------------------------------

// A packet whose reply is a plain acknowledgement (Ack, AssignOk, CheckpointOk).
class PSClient::ChunkRequest : public transport::PendingRequest {
 public:
  ChunkRequest(PSClient* client, std::shared_ptr<ClientOp> op, uint32_t shard)
      : client_(client), op_(std::move(op)), shard_(shard) {}
  void OnReply(const Reply& r) override { client_->OnChunkReply(op_, shard_, r); }
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
  GetRequest(PSClient* client, std::shared_ptr<ClientOp> op, uint32_t shard,
             const int64_t* positions, size_t count, bool direct)
      : client_(client), op_(std::move(op)), shard_(shard), positions_(positions), count_(count),
        direct_(direct) {}

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

// ---- construction -------------------------------------------------------------------------

PSClient::PSClient(const ClientOptions& options, std::vector<std::unique_ptr<Channel>> channels)
    : options_(options),
      state_dim_(static_cast<uint32_t>(
          store::StateDim(options.optimizer.kind, static_cast<int>(options.dim)))),
      partitioner_(options.partition, static_cast<uint32_t>(std::max<size_t>(channels.size(), 1))),
      channels_(std::move(channels)) {
  auto close_all = [&] {
    {
      std::lock_guard<std::mutex> lock(mu_);
      closing_ = true;
      quiet_ = true;
      closed_ = true;
    }
    for (auto& ch : channels_) {
      if (ch) ch->Close();
    }
  };
  try {
    if (channels_.empty()) throw ValueError("a PSClient needs at least one shard endpoint");
    if (!wire::ValidTableName(options_.table)) {
      throw ValueError("table name '" + options_.table +
                       "' must be 1-128 characters of [A-Za-z0-9_.:-]");
    }
    if (options_.dim == 0 || options_.dim > wire::kMaxDim) {
      throw ValueError("dim must be in [1, " + std::to_string(wire::kMaxDim) + "]");
    }
    if (options_.world_size == 0 || options_.world_size > wire::kMaxWorldSize) {
      throw ValueError("world_size must be in [1, " + std::to_string(wire::kMaxWorldSize) + "]");
    }
    if (options_.rank >= options_.world_size) {
      throw ValueError("rank " + std::to_string(options_.rank) + " must be below world_size " +
                       std::to_string(options_.world_size));
    }
    if (options_.max_packet_rows == 0) throw ValueError("max_packet_rows must be >= 1");
    // The configured lr (a commit that names none uses it) must be > 0; a step's own lr
    // under a schedule may be 0 (CommitAsync).
    if (!(options_.lr > 0) || !std::isfinite(options_.lr)) {
      throw ValueError("lr must be finite and > 0, got " + std::to_string(options_.lr));
    }
    if (!(options_.timeout > 0)) throw ValueError("timeout must be > 0 seconds");
    store::ValidateOptimizerSpec(options_.optimizer);
    if (options_.init.bound_starts.size() != options_.init.bound_values.size() ||
        options_.init.bound_starts.size() > wire::kMaxBoundRanges) {
      throw ValueError("init bound ranges: starts and bounds must pair up (at most 65536)");
    }
    for (size_t j = 0; j < channels_.size(); ++j) {
      if (!channels_[j]) throw ValueError("shard endpoint " + std::to_string(j) + " is missing");
      if (channels_[j]->slot_bytes() < SlotBytesFor(options_)) {
        throw ValueError("channel " + std::to_string(j) + " slots are smaller than the packets");
      }
    }
    committed_.assign(channels_.size(), -1);
    checkpoints_.consecutive_failures.assign(channels_.size(), 0);
    checkpoints_.last_step.assign(channels_.size(), -1);
    for (uint32_t j = 0; j < channels_.size(); ++j) {
      channels_[j]->SetHandlers([this, j](const Reply& r) { OnNotify(j, r); },
                                [this, j](const Error& e) { OnChannelFailure(j, e); });
    }
    OpenSessions();
  } catch (...) {
    close_all();
    throw;
  }
  worker_ = std::thread([this] { WorkerLoop(); });
}

std::unique_ptr<PSClient> PSClient::Connect(const ClientOptions& options,
                                            const std::vector<transport::ShardEndpoint>& endpoints,
                                            const transport::ConnectOptions& connect) {
  const transport::ChannelOptions co = ChannelOptionsFor(options);
  std::vector<std::unique_ptr<Channel>> channels;
  channels.reserve(endpoints.size());
  for (const auto& e : endpoints) channels.push_back(transport::ConnectChannel(e, co, connect));
  return std::make_unique<PSClient>(options, std::move(channels));
}

PSClient::~PSClient() {
  try {
    Close(options_.timeout);
  } catch (...) {
    // Destructors do not throw; Close() reports errors to callers who ask.
  }
}

void PSClient::WriteHeader(uint8_t* frame, MsgType type, size_t frame_len) const {
  wire::StoreHeader(frame, wire::MakeHeader(type, 0, frame_len - kHeaderBytes));
}

void PSClient::OpenSessions() {
  const Deadline deadline = DeadlineAfter(options_.timeout);
  const uint32_t S = num_shards();
  for (uint32_t j = 0; j < S; ++j) {
    Channel& ch = *channels_[j];
    if (ch.remote_num_shards() != 0 &&
        (ch.remote_shard_id() != j || ch.remote_num_shards() != S)) {
      throw ValueError("shard endpoint " + std::to_string(j) + " (" + ch.peer() + ") is shard " +
                       std::to_string(ch.remote_shard_id()) + " of " +
                       std::to_string(ch.remote_num_shards()) + "; endpoints must list the " +
                       std::to_string(S) + " shards in shard order");
    }
  }
  std::vector<std::shared_ptr<SyncRequest>> reqs(S);
  for (uint32_t j = 0; j < S; ++j) {
    Channel& ch = *channels_[j];
    const uint32_t slot = ch.AcquireSlot(deadline);
    uint8_t* f = ch.SlotBuffer(slot);
    wire::OpenBody b{};
    b.session = options_.session;
    b.rank = options_.rank;
    b.world_size = options_.world_size;
    b.dim = options_.dim;
    b.optimizer = static_cast<uint8_t>(options_.optimizer.kind);
    b.eps = options_.optimizer.eps;
    b.beta1 = options_.optimizer.beta1;
    b.beta2 = options_.optimizer.beta2;
    b.weight_decay = options_.optimizer.weight_decay;
    b.initial_accumulator_value = options_.optimizer.initial_accumulator_value;
    b.grad_division = options_.grad_division ? 1 : 0;
    b.init_kind = static_cast<uint8_t>(options_.init.kind);
    b.name_len = static_cast<uint16_t>(options_.table.size());
    b.init_bound = options_.init.bound;
    b.init_value = options_.init.value;
    b.init_seed = options_.init.seed;
    b.key_bound = options_.key_bound;
    const size_t r = options_.init.bound_starts.size();
    b.num_bound_ranges = static_cast<uint32_t>(r);
    const size_t len = kHeaderBytes + sizeof(b) + r * 12 + options_.table.size();
    WriteHeader(f, MsgType::kOpen, len);
    uint8_t* p = f + kHeaderBytes;
    std::memcpy(p, &b, sizeof(b));
    p += sizeof(b);
    if (r) {
      std::memcpy(p, options_.init.bound_starts.data(), r * 8);
      std::memcpy(p + r * 8, options_.init.bound_values.data(), r * 4);
    }
    p += r * 12;
    std::memcpy(p, options_.table.data(), options_.table.size());
    reqs[j] = std::make_shared<SyncRequest>();
    ch.Post(slot, len, reqs[j]);
    ch.Flush();
  }
  for (uint32_t j = 0; j < S; ++j) {
    try {
      channels_[j]->WaitIdle(deadline);
    } catch (const TimeoutError&) {
      // Reported below through Check().
    }
    if (auto err = reqs[j]->Check(MsgType::kOpenOk, channels_[j]->peer())) {
      err->message = "opening table '" + options_.table + "' on PS shard " + std::to_string(j) +
                     " (" + channels_[j]->peer() + ") failed: " + err->message;
      transport::ThrowError(*err);
    }
    const auto ok = wire::Load<wire::OpenOkBody>(reqs[j]->fixed.data());
    if (ok.state_dim != state_dim_) {
      throw ValueError("opening table '" + options_.table + "' on PS shard " + std::to_string(j) +
                       " (" + channels_[j]->peer() + "): the shard's rows carry " +
                       std::to_string(ok.state_dim) + " optimizer state floats, " +
                       store::OptimizerKindName(options_.optimizer.kind) + " keeps " +
                       std::to_string(state_dim_));
    }
    std::lock_guard<std::mutex> lock(mu_);
    committed_[j] = std::max(committed_[j], ok.committed_step);
  }
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
                                                std::optional<float> lr) {
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

// ---- worker -----------------------------------------------------------------------------------

int64_t PSClient::MinCommittedLocked() const {
  int64_t m = std::numeric_limits<int64_t>::max();
  for (int64_t c : committed_) m = std::min(m, c);
  return committed_.empty() ? -1 : m;
}

std::shared_ptr<ClientOp> PSClient::PickReadyLocked() {
  const int64_t readable = std::max(last_staged_commit_, MinCommittedLocked());
  for (auto it = queue_.begin(); it != queue_.end(); ++it) {
    const auto& op = *it;
    switch (op->kind_) {
      case OpKind::kAssign:
      case OpKind::kCheckpoint:
        // A barrier: only from the front with nothing in flight; nothing passes it.
        if (it == queue_.begin() && active_.empty()) return op;
        return nullptr;
      case OpKind::kCommit:
        if (!last_commit_ || last_commit_->finished_) return op;
        break;  // later gets may still go; later commits wait like this one
      case OpKind::kGet:
        if (op->step_ <= readable) return op;
        break;
    }
  }
  return nullptr;
}

void PSClient::ExpireQueuedLocked() {
  const auto now = Clock::now();
  for (auto it = queue_.begin(); it != queue_.end();) {
    auto op = *it;
    if (op->deadline_ > now) {
      ++it;
      continue;
    }
    it = queue_.erase(it);
    std::string why;
    const std::string steps = StepsText(committed_);
    switch (op->kind_) {
      case OpKind::kCommit:
        why = "commit of step " + std::to_string(op->step_) + " could not start within " +
              std::to_string(options_.timeout) + " s: the previous commit (step " +
              std::to_string(last_commit_ ? last_commit_->step_ : -1) +
              ") has not completed on every shard (shards committed " + steps +
              "; a rank may be lost)";
        break;
      case OpKind::kGet:
        why = "get at step " + std::to_string(op->step_) + " could not start within " +
              std::to_string(options_.timeout) + " s: this client has submitted commits up to step " +
              std::to_string(last_staged_commit_) + " and the shards committed " + steps +
              " (a get must follow the commit of its step)";
        break;
      default:
        why = std::string(OpName(op->kind_)) + " waited more than " +
              std::to_string(options_.timeout) + " s for earlier operations to finish";
    }
    op->finished_ = true;
    op->Finish(Error{ErrorKind::kTimeout, why});
    idle_cv_.notify_all();
  }
}

void PSClient::ExpireActiveLocked() {
  if (failed_) return;
  const auto now = Clock::now();
  for (const auto& op : active_) {
    if (op->finished_ || op->deadline_ > now) continue;
    // The operation's one deadline passed with a reply or a commit still missing: a shard
    // hangs or a rank is lost. Its slot cannot be reused, so the client fails (every wait
    // on it, now and later, raises this at once instead of each timing out in turn).
    std::string who;
    if (op->kind_ == OpKind::kCommit && op->staged_) {
      for (uint32_t j = 0; j < committed_.size(); ++j) {
        if (committed_[j] < op->step_) who += (who.empty() ? "" : ", ") + ShardName(j);
      }
      who = who.empty() ? std::string() : "; not committed by " + who;
    } else if (op->outstanding_ > 0) {
      who = "; " + std::to_string(op->outstanding_) + " packet(s) unanswered";
    }
    std::string what = OpName(op->kind_);
    if (op->kind_ == OpKind::kCommit) what += " of step " + std::to_string(op->step_);
    if (op->kind_ == OpKind::kGet) what += " at step " + std::to_string(op->step_);
    FailClientLocked(Error{ErrorKind::kTimeout,
                           what + " did not complete within " + std::to_string(options_.timeout) +
                               " s of its submission" + who + " (shards committed " +
                               StepsText(committed_) + "; a PS shard hangs or a rank is lost)"});
    return;
  }
}

Deadline PSClient::StagingDeadline(const std::shared_ptr<ClientOp>& op) {
  std::lock_guard<std::mutex> lock(mu_);
  Deadline d = op->deadline_;
  for (const auto& a : active_) {
    if (!a->finished_) d = std::min(d, a->deadline_);
  }
  return d;
}

void PSClient::WorkerLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    ExpireQueuedLocked();
    ExpireActiveLocked();
    if (stop_worker_) break;
    auto op = PickReadyLocked();
    if (!op) {
      auto next = Clock::now() + std::chrono::seconds(1);
      for (const auto& q : queue_) next = std::min(next, q->deadline_);
      for (const auto& a : active_) next = std::min(next, a->deadline_);
      work_cv_.wait_until(lock, next);
      continue;
    }
    queue_.erase(std::find(queue_.begin(), queue_.end(), op));
    active_.push_back(op);
    if (op->kind_ == OpKind::kCommit) {
      last_commit_ = op;
      ++stats_.commits;
      stats_.rows_committed += op->n_;
    } else if (op->kind_ == OpKind::kGet) {
      ++stats_.gets;
      stats_.rows_read += op->n_;
    }
    lock.unlock();
    std::optional<Error> err;
    try {
      Stage(op);
    } catch (const TimeoutError& e) {
      err = Error{ErrorKind::kTimeout, e.what()};
    } catch (const ShuttingDownError& e) {
      err = Error{ErrorKind::kShuttingDown, e.what()};
    } catch (const TransportError& e) {
      err = Error{ErrorKind::kTransport, e.what()};
    } catch (const SessionError& e) {
      err = Error{ErrorKind::kSession, e.what()};
    } catch (const ValueError& e) {
      err = Error{ErrorKind::kValue, e.what()};
    } catch (const std::exception& e) {
      err = Error{ErrorKind::kInternal, e.what()};
    }
    lock.lock();
    if (err) {
      // A half-sent operation leaves this rank's protocol state unknown: the client fails
      // (with the reason of an earlier operation that expired meanwhile, if one did).
      ExpireActiveLocked();
      if (!op->finished_) FinishLocked(op, *err);
      FailClientLocked(*err);
    } else {
      op->staged_ = true;
      if (op->kind_ == OpKind::kCommit) {
        last_staged_commit_ = std::max(last_staged_commit_, op->step_);
      }
      MaybeFinishLocked(op);
    }
  }
}

void PSClient::Stage(const std::shared_ptr<ClientOp>& op) {
  if (op->ready_) op->ready_();
  switch (op->kind_) {
    case OpKind::kCommit:
    case OpKind::kAssign:
      StageRows(op);
      return;
    case OpKind::kGet:
      StageGet(op);
      return;
    case OpKind::kCheckpoint:
      StageCheckpoint(op);
      return;
  }
}

template <typename PostChunk>
void PSClient::SendChunks(const std::shared_ptr<ClientOp>& op, const std::vector<size_t>& off,
                          bool marker, PostChunk&& post_chunk) {
  const size_t maxr = options_.max_packet_rows;
  const uint32_t S = num_shards();
  std::vector<uint32_t> chunks(S);
  uint32_t total = 0, max_chunks = 0;
  for (uint32_t j = 0; j < S; ++j) {
    uint32_t c = static_cast<uint32_t>((off[j + 1] - off[j] + maxr - 1) / maxr);
    if (marker && c == 0) c = 1;  // the marker: every shard hears from every rank
    chunks[j] = c;
    total += c;
    max_chunks = std::max(max_chunks, c);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    op->outstanding_ = static_cast<int>(total);
  }
  for (uint32_t k = 0; k < max_chunks; ++k) {
    for (uint32_t j = 0; j < S; ++j) {
      if (k >= chunks[j]) continue;
      if (abort_.load()) throw SessionError("the client failed while sending");
      const size_t begin = off[j] + k * maxr;
      const size_t count = std::min(maxr, off[j + 1] - begin);
      Channel& ch = *channels_[j];
      const uint32_t slot = ch.AcquireSlot(StagingDeadline(op), &abort_);
      post_chunk(ch, j, slot, k, chunks[j], begin, count);
    }
  }
  for (uint32_t j = 0; j < S; ++j) {
    if (chunks[j]) channels_[j]->Flush();
  }
}

void PSClient::StageRows(const std::shared_ptr<ClientOp>& op) {
  const bool is_commit = op->kind_ == OpKind::kCommit;
  const size_t dim = options_.dim + op->state_dim_;  // the width of a row on the wire
  partitioner_.Split(op->keys_, op->n_, &scratch_shards_, &scratch_order_, &scratch_offsets_);
  const int64_t* order = scratch_order_.data();
  const bool identity = num_shards() == 1;
  SendChunks(op, scratch_offsets_, /*marker=*/is_commit,
             [&](Channel& ch, uint32_t shard, uint32_t slot, uint32_t k, uint32_t chunk_count,
                 size_t begin, size_t count) {
    uint8_t* f = ch.SlotBuffer(slot);
    size_t len, fixed;
    if (is_commit) {
      wire::CommitBody b{};
      b.session = options_.session;
      b.step = op->step_;
      b.rank = options_.rank;
      b.world_size = options_.world_size;
      b.chunk_index = k;
      b.chunk_count = chunk_count;
      b.dim = options_.dim;
      b.lr = op->lr_;
      b.nrows = static_cast<uint32_t>(count);
      std::memcpy(f + kHeaderBytes, &b, sizeof(b));
      fixed = sizeof(b);
      len = wire::CommitFrameBytes(count, dim);
    } else {
      wire::AssignBody b{};
      b.session = options_.session;
      b.nrows = static_cast<uint32_t>(count);
      b.dim = options_.dim;
      b.state_dim = op->state_dim_;
      std::memcpy(f + kHeaderBytes, &b, sizeof(b));
      fixed = sizeof(b);
      len = wire::AssignFrameBytes(count, dim);
    }
    WriteHeader(f, is_commit ? MsgType::kCommit : MsgType::kAssign, len);
    auto request = std::make_shared<ChunkRequest>(this, op, shard);
    if (identity) {
      // The chunk's keys and rows are contiguous in the caller's inputs: the channel
      // sends them from there (or copies them into the slot if it cannot gather).
      transport::ConstSpan pieces[2];
      if (count) {
        pieces[0] = {reinterpret_cast<const uint8_t*>(op->keys_ + begin), count * 8};
        pieces[1] = {reinterpret_cast<const uint8_t*>(op->rows_ + begin * dim), count * dim * 4};
      }
      ch.PostGather(slot, kHeaderBytes + fixed, pieces, count ? 2 : 0, std::move(request));
    } else {
      auto* keys = reinterpret_cast<int64_t*>(f + kHeaderBytes + fixed);
      auto* rows = reinterpret_cast<float*>(f + kHeaderBytes + fixed + count * 8);
      for (size_t i = 0; i < count; ++i) {
        const int64_t p = order[begin + i];
        keys[i] = op->keys_[p];
        std::memcpy(rows + i * dim, op->rows_ + p * static_cast<int64_t>(dim), dim * 4);
      }
      ch.Post(slot, len, std::move(request));
    }
  });
}

void PSClient::StageGet(const std::shared_ptr<ClientOp>& op) {
  partitioner_.Split(op->keys_, op->n_, &scratch_shards_, &scratch_order_, &scratch_offsets_);
  op->order_.swap(scratch_order_);  // the replies read positions from it
  const int64_t* order = op->order_.data();
  SendChunks(op, scratch_offsets_, /*marker=*/false,
             [&](Channel& ch, uint32_t shard, uint32_t slot, uint32_t, uint32_t, size_t begin,
                 size_t count) {
    uint8_t* f = ch.SlotBuffer(slot);
    wire::GetBody b{};
    b.session = options_.session;
    b.at_step = op->step_;
    b.nrows = static_cast<uint32_t>(count);
    b.dim = options_.dim;
    b.state_dim = op->state_dim_;
    std::memcpy(f + kHeaderBytes, &b, sizeof(b));
    auto* keys = reinterpret_cast<int64_t*>(f + kHeaderBytes + sizeof(b));
    for (size_t i = 0; i < count; ++i) keys[i] = op->keys_[order[begin + i]];
    const size_t len = wire::GetFrameBytes(count);
    WriteHeader(f, MsgType::kGet, len);
    const bool direct = order[begin + count - 1] - order[begin] == static_cast<int64_t>(count) - 1;
    ch.Post(slot, len, std::make_shared<GetRequest>(this, op, shard, order + begin, count, direct));
  });
}

void PSClient::StageCheckpoint(const std::shared_ptr<ClientOp>& op) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    op->outstanding_ = static_cast<int>(channels_.size());
  }
  for (uint32_t j = 0; j < num_shards(); ++j) {
    Channel& ch = *channels_[j];
    const uint32_t slot = ch.AcquireSlot(StagingDeadline(op), &abort_);
    uint8_t* f = ch.SlotBuffer(slot);
    wire::SessionBody b{options_.session};
    std::memcpy(f + kHeaderBytes, &b, sizeof(b));
    std::memcpy(f + kHeaderBytes + sizeof(b), op->label_.data(), op->label_.size());
    const size_t len = kHeaderBytes + sizeof(b) + op->label_.size();
    WriteHeader(f, MsgType::kCheckpoint, len);
    ch.Post(slot, len, std::make_shared<ChunkRequest>(this, op, j));
    ch.Flush();
  }
}

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

void PSClient::OnChunkReply(const std::shared_ptr<ClientOp>& op, uint32_t shard, const Reply& r) {
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

void PSClient::CloseSessions(Deadline deadline, std::optional<Error>* err) {
  const uint32_t S = num_shards();
  std::vector<std::shared_ptr<SyncRequest>> reqs(S);
  for (uint32_t j = 0; j < S; ++j) {
    Channel& ch = *channels_[j];
    if (ch.failed()) continue;
    try {
      const uint32_t slot = ch.AcquireSlot(deadline);
      uint8_t* f = ch.SlotBuffer(slot);
      wire::CloseBody b{options_.session, options_.rank, 0};
      std::memcpy(f + kHeaderBytes, &b, sizeof(b));
      const size_t len = kHeaderBytes + sizeof(b);
      WriteHeader(f, MsgType::kClose, len);
      reqs[j] = std::make_shared<SyncRequest>();
      ch.Post(slot, len, reqs[j]);
      ch.Flush();
    } catch (const std::exception& e) {
      if (!*err) *err = Error{ErrorKind::kTransport, std::string("closing the session: ") + e.what()};
    }
  }
  for (uint32_t j = 0; j < S; ++j) {
    if (!reqs[j]) continue;
    try {
      channels_[j]->WaitIdle(deadline);
    } catch (const std::exception&) {
      // Reported through Check() below.
    }
    if (auto e = reqs[j]->Check(MsgType::kCloseOk, channels_[j]->peer())) {
      if (!*err) *err = e;
    }
  }
}

void PSClient::Close(double timeout) {
  const Deadline deadline = DeadlineAfter(timeout);
  std::optional<Error> err;
  bool was_failed;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (closing_) {
      idle_cv_.wait_until(lock, deadline, [&] { return closed_; });
      return;
    }
    closing_ = true;  // no new operations
    while (!failed_ && (!queue_.empty() || !active_.empty())) {
      if (idle_cv_.wait_until(lock, deadline) == std::cv_status::timeout && !failed_ &&
          (!queue_.empty() || !active_.empty())) {
        err = Error{ErrorKind::kTimeout,
                    "closing the PSClient of table '" + options_.table + "': " +
                        std::to_string(queue_.size() + active_.size()) +
                        " operations still pending after the timeout (shards committed " +
                        StepsText(committed_) + ")"};
        break;
      }
    }
    stop_worker_ = true;
    was_failed = failed_.has_value();
    work_cv_.notify_all();
    if (err) {
      quiet_ = true;
      abort_.store(true);
    }
  }
  if (err) {
    // The drain timed out (a shard or a rank is stuck): closing the channels first wakes a
    // worker waiting for a slot, so the join below is prompt. No Close can be sent then.
    for (auto& ch : channels_) ch->Close();
    if (worker_.joinable()) worker_.join();
  } else {
    if (worker_.joinable()) worker_.join();
    std::optional<Error> close_err;
    // A failed client closes its sessions on a best-effort basis: a shard that stopped
    // answering must not hold it for the whole timeout.
    CloseSessions(was_failed ? std::min(deadline, DeadlineAfter(1.0)) : deadline, &close_err);
    if (!was_failed) err = close_err;
    {
      std::lock_guard<std::mutex> lock(mu_);
      quiet_ = true;  // the channels' "closed" failures are ours, not errors
    }
    for (auto& ch : channels_) ch->Close();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    const Error e{ErrorKind::kSession,
                  "the PSClient of table '" + options_.table + "' closed before the operation completed"};
    for (auto& op : queue_) {
      op->finished_ = true;
      op->Finish(e);
    }
    queue_.clear();
    auto active = active_;
    for (auto& op : active) {
      if (!op->finished_) FinishLocked(op, e);
    }
    closed_ = true;
    idle_cv_.notify_all();
  }
  if (err) transport::ThrowError(*err);
}

}  // namespace bagpipe::client
