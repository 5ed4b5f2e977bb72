// Opening and closing a PSClient's sessions: the constructor (options checked, every shard's
// session opened), Connect, and Close (drain, close the sessions, close the channels).
#include <algorithm>
#include <cmath>
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
    if (options_.start_step < wire::kAnyStartStep) {
      throw ValueError("start_step must be >= -1 (or -2: attach without a check), got " +
                       std::to_string(options_.start_step));
    }
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
    b.start_step = options_.start_step;
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
