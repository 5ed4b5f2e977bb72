#include "shard/coordinator.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <utility>

#include "common/errors.h"

namespace bagpipe::shard {

using transport::ServerLink;
using wire::MsgType;
using wire::Status;

namespace {

constexpr size_t kMaxWaiters = 1 << 16;

// Why an Open declaring it starts after `start` is refused by a table at `committed`.
std::string StartStepMismatch(int64_t start, int64_t committed) {
  const std::string c = std::to_string(committed);
  if (start == -1) {
    return "a new job (start step -1: its first step is 0) opened it, but the table has "
           "committed steps up to " + c + " (a restored shard, or a server of an earlier job "
           "reached with the same or another token): steps 0.." + c + " would be acknowledged "
           "without being applied. Resume from step " + c + " (ClientSpec.expected_step=" + c +
           ", --resume), or start fresh shards";
  }
  const std::string s = std::to_string(start);
  if (committed == -1) {
    return "the session resumes after step " + s + ", but the table has no committed step "
           "(a fresh shard, not restored from the checkpoint of step " + s + ")";
  }
  return "the session resumes after step " + s + ", but the table's committed step is " + c +
         ": restore every shard from the same checkpoint set as the trainers";
}

}  // namespace

CommitCoordinator::CommitCoordinator(std::string table, std::unique_ptr<TableBackend> backend,
                                     int64_t committed_step, CoordinatorOptions options)
    : table_(std::move(table)),
      backend_(std::move(backend)),
      schema_(backend_->schema()),
      options_(std::move(options)),
      committed_(committed_step) {
  stats_.committed_step = committed_step;
  if (options_.checkpoint_background) writer_ = std::thread([this] { WriterLoop(); });
}

CommitCoordinator::~CommitCoordinator() {
  if (!writer_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(ckpt_mu_);
    ckpt_stop_ = true;
  }
  ckpt_cv_.notify_all();
  writer_.join();  // a checkpoint being written is finished first
}

int CommitCoordinator::AttachedLocked() const {
  int n = 0;
  for (const auto& l : attached_) n += l != nullptr;
  return n;
}

bool CommitCoordinator::PendingHasChunksLocked() const {
  for (const auto& rp : pending_) {
    if (rp.received > 0) return true;
  }
  return false;
}

std::string CommitCoordinator::CheckKeysLocked(const int64_t* keys, size_t n) const {
  if (schema_.key_bound < 0) return {};
  for (size_t i = 0; i < n; ++i) {
    int64_t k;
    std::memcpy(&k, keys + i, sizeof(k));
    if (k < 0 || k >= schema_.key_bound) {
      return "key " + std::to_string(k) + " at position " + std::to_string(i) +
             " is outside [0, " + std::to_string(schema_.key_bound) + ") of table '" + table_ + "'";
    }
  }
  return {};
}

int64_t CommitCoordinator::Open(const SessionParams& params, uint32_t rank,
                                const TableSchema& table_schema,
                                const std::shared_ptr<ServerLink>& link) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string where = "table '" + table_ + "': ";
  if (shutting_down_) throw TransportError(where + shutdown_why_);
  if (params.dim != schema_.dim) {
    throw ValueError(where + "dim " + std::to_string(params.dim) + " differs from the table's dim " +
                     std::to_string(schema_.dim));
  }
  if (const std::string d = SchemaDifference(table_schema, schema_); !d.empty()) {
    throw ValueError(where + d);
  }
  if (params.world_size == 0 || rank >= params.world_size) {
    throw ValueError(where + "rank " + std::to_string(rank) + " is not below world_size " +
                     std::to_string(params.world_size));
  }
  if (params.start_step != wire::kAnyStartStep && params.start_step != committed_) {
    throw StartStepError(where + StartStepMismatch(params.start_step, committed_));
  }
  if (has_session_) {
    if (failed_) throw SessionError(failure_);
    if (params.session != params_.session) {
      throw ValueError(where + "session " + std::to_string(params.session) +
                       " differs from the open session " + std::to_string(params_.session) +
                       " (another job holds this table)");
    }
    if (params.world_size != params_.world_size) {
      throw ValueError(where + "world_size " + std::to_string(params.world_size) +
                       " differs from the session's world_size " +
                       std::to_string(params_.world_size));
    }
    if (params.grad_division != params_.grad_division) {
      throw ValueError(where + "gradient_division " + (params.grad_division ? "on" : "off") +
                       " differs from the session's (" + (params_.grad_division ? "on" : "off") +
                       ")");
    }
    if (attached_[rank] && attached_[rank].get() != link.get()) {
      throw ValueError(where + "rank " + std::to_string(rank) +
                       " already has the session open on another connection (" +
                       attached_[rank]->Describe() + ")");
    }
  } else {
    params_ = params;
    has_session_ = true;
    failed_ = false;
    failure_.clear();
    attached_.assign(params.world_size, nullptr);
    pending_.resize(params.world_size);
    for (auto& rp : pending_) {
      rp.chunk_count = 0;
      rp.received = 0;
    }
    ranks_complete_ = 0;
  }
  attached_[rank] = link;
  if (log_) {
    log_(where + "session " + std::to_string(params.session) + " rank " + std::to_string(rank) +
         "/" + std::to_string(params.world_size) + " opened by " + link->Describe() +
         " at committed step " + std::to_string(committed_));
  }
  return committed_;
}

void CommitCoordinator::LeaveLocked(uint32_t rank, const char* how) {
  attached_[rank] = nullptr;
  const auto& rp = pending_[rank];
  const bool incomplete = rp.chunk_count == 0 || rp.received < rp.chunk_count;
  if (log_) {
    log_("table '" + table_ + "': session " + std::to_string(params_.session) + " rank " +
         std::to_string(rank) + " " + how + " at committed step " + std::to_string(committed_));
  }
  if (!failed_ && incomplete && PendingHasChunksLocked()) {
    FailLocked("rank " + std::to_string(rank) + " " + how + " while step " +
               std::to_string(committed_ + 1) + " was pending without all of its chunks");
  }
}

void CommitCoordinator::ResetIfEmptyLocked() {
  if (!has_session_ || AttachedLocked() > 0) return;
  if (log_) {
    log_("table '" + table_ + "': session " + std::to_string(params_.session) +
         " ended at committed step " + std::to_string(committed_) +
         (failed_ ? " (it had failed: " + failure_ + ")" : std::string()));
  }
  has_session_ = false;
  failed_ = false;
  failure_.clear();
  for (auto& rp : pending_) {
    rp.chunk_count = 0;
    rp.received = 0;
  }
  ranks_complete_ = 0;
  pending_has_lr_ = false;
}

int64_t CommitCoordinator::Close(uint32_t rank, ServerLink* link) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!has_session_ || rank >= attached_.size() || attached_[rank].get() != link) return committed_;
  // Drop this link's deferred reads (its client drains before closing; any left are stale).
  for (auto it = waiters_.begin(); it != waiters_.end();) {
    it = it->link.get() == link ? waiters_.erase(it) : std::next(it);
  }
  LeaveLocked(rank, "closed");
  ResetIfEmptyLocked();
  return committed_;
}

void CommitCoordinator::Detach(ServerLink* link) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = waiters_.begin(); it != waiters_.end();) {
    it = it->link.get() == link ? waiters_.erase(it) : std::next(it);
  }
  if (!has_session_) return;
  for (uint32_t r = 0; r < attached_.size(); ++r) {
    if (attached_[r].get() == link) LeaveLocked(r, "disconnected without closing");
  }
  ResetIfEmptyLocked();
}

void CommitCoordinator::FailLocked(const std::string& why) {
  if (failed_) return;
  failed_ = true;
  failure_ = "table '" + table_ + "' session " + std::to_string(params_.session) +
             " failed: " + why;
  if (log_) log_(failure_);
  for (const auto& w : waiters_) {
    w.link->SendError(w.tag, w.slot, Status::kSessionFailed, params_.session, failure_);
  }
  waiters_.clear();
  wire::MessageBody body{};
  body.session = params_.session;
  const size_t n = std::min(failure_.size(), wire::kMaxMessageBytes);
  body.text_len = static_cast<uint32_t>(n);
  for (const auto& l : attached_) {
    if (!l) continue;
    l->Send(MsgType::kNotifyFailed, Status::kSessionFailed, 0, wire::kNoSlot, &body, sizeof(body),
            n, [&](uint8_t* dst) { std::memcpy(dst, failure_.data(), n); });
  }
  committed_cv_.notify_all();
}

void CommitCoordinator::ServeLocked(const Waiter& w) {
  const size_t n = w.keys.size();
  wire::GetOkBody body{};
  body.served_step = committed_;
  body.nrows = static_cast<uint32_t>(n);
  body.dim = schema_.dim;
  body.state_dim = w.state_dim;
  const bool with_state = w.state_dim != 0;
  try {
    w.link->Send(MsgType::kGetOk, Status::kOk, w.tag, w.slot, &body, sizeof(body),
                 n * (size_t{schema_.dim} + w.state_dim) * sizeof(float), [&](uint8_t* dst) {
                   backend_->Read(w.keys.data(), n, reinterpret_cast<float*>(dst), with_state);
                 });
  } catch (const std::exception& e) {
    w.link->SendError(w.tag, w.slot, Status::kInternal, params_.session,
                      "read of " + std::to_string(n) + " rows from table '" + table_ +
                          "' failed: " + e.what());
    return;
  }
  ++stats_.reads;
  stats_.rows_read += static_cast<int64_t>(n);
}

void CommitCoordinator::ServeReadyWaitersLocked() {
  for (auto it = waiters_.begin(); it != waiters_.end();) {
    if (it->at_step <= committed_) {
      ServeLocked(*it);
      it = waiters_.erase(it);
    } else {
      ++it;
    }
  }
}

void CommitCoordinator::Get(int64_t at_step, const int64_t* keys, size_t n, uint32_t dim,
                            uint32_t state_dim, const std::shared_ptr<ServerLink>& link,
                            uint64_t tag, uint32_t slot) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t session = has_session_ ? params_.session : 0;
  if (failed_) {
    link->SendError(tag, slot, Status::kSessionFailed, session, failure_);
    return;
  }
  if (shutting_down_) {
    link->SendError(tag, slot, Status::kShuttingDown, session, shutdown_why_);
    return;
  }
  if (dim != schema_.dim) {
    link->SendError(tag, slot, Status::kInvalidArgument, session,
                    "get: dim " + std::to_string(dim) + " differs from table '" + table_ +
                        "' dim " + std::to_string(schema_.dim));
    return;
  }
  if (state_dim != 0 && state_dim != schema_.state_dim()) {
    link->SendError(tag, slot, Status::kInvalidArgument, session,
                    "get: state_dim " + std::to_string(state_dim) + " differs from table '" +
                        table_ + "' state_dim " + std::to_string(schema_.state_dim()) + " (" +
                        store::OptimizerKindName(schema_.optimizer.kind) + ")");
    return;
  }
  const std::string bad = CheckKeysLocked(keys, n);
  if (!bad.empty()) {
    link->SendError(tag, slot, Status::kInvalidArgument, session, "get: " + bad);
    return;
  }
  Waiter w{at_step, std::vector<int64_t>(n), state_dim, link, tag, slot};
  if (n > 0) std::memcpy(w.keys.data(), keys, n * sizeof(int64_t));
  if (at_step <= committed_) {
    ServeLocked(w);
    return;
  }
  if (waiters_.size() >= kMaxWaiters) {
    link->SendError(tag, slot, Status::kUnavailable, session,
                    "too many deferred reads on table '" + table_ + "'");
    return;
  }
  ++stats_.deferred_reads;
  waiters_.push_back(std::move(w));
}

void CommitCoordinator::Assign(const int64_t* keys, size_t n, const float* rows,
                               bool with_state) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string bad = CheckKeysLocked(keys, n);
  if (!bad.empty()) throw ValueError("assign: " + bad);
  if (n > 0) backend_->Assign(keys, n, rows, with_state);
}

int64_t CommitCoordinator::Read(const int64_t* keys, size_t n, float* out, bool with_state) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string bad = CheckKeysLocked(keys, n);
  if (!bad.empty()) throw ValueError("keys: " + bad);
  if (n > 0) backend_->Read(keys, n, out, with_state);
  ++stats_.reads;
  stats_.rows_read += static_cast<int64_t>(n);
  return committed_;
}

int64_t CommitCoordinator::ReadAt(int64_t at_step, const int64_t* keys, size_t n, float* out,
                                  Deadline deadline, bool with_state) {
  std::unique_lock<std::mutex> lock(mu_);
  const std::string bad = CheckKeysLocked(keys, n);
  if (!bad.empty()) throw ValueError("keys: " + bad);
  while (committed_ < at_step && !failed_ && !shutting_down_) {
    if (committed_cv_.wait_until(lock, deadline) == std::cv_status::timeout &&
        committed_ < at_step && !failed_ && !shutting_down_) {
      throw TimeoutError("table '" + table_ + "': step " + std::to_string(at_step) +
                         " was not committed within the timeout (committed step " +
                         std::to_string(committed_) + ")");
    }
  }
  if (committed_ < at_step) {
    throw SessionError(failed_ ? failure_ : "table '" + table_ + "': " + shutdown_why_);
  }
  if (n > 0) backend_->Read(keys, n, out, with_state);
  ++stats_.reads;
  stats_.rows_read += static_cast<int64_t>(n);
  return committed_;
}

void CommitCoordinator::Shutdown(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (shutting_down_) return;
  shutting_down_ = true;
  shutdown_why_ = why.empty() ? "the shard is shutting down" : why;
  for (const auto& w : waiters_) {
    w.link->SendError(w.tag, w.slot, Status::kShuttingDown, params_.session, why);
  }
  waiters_.clear();
  // Tell every attached rank at once (not only those waiting): they stop instead of
  // carrying on until their next request is refused.
  wire::MessageBody body{};
  body.session = params_.session;
  const size_t n = std::min(why.size(), wire::kMaxMessageBytes);
  body.text_len = static_cast<uint32_t>(n);
  for (const auto& l : attached_) {
    if (!l) continue;
    l->Send(MsgType::kNotifyShutdown, Status::kShuttingDown, 0, wire::kNoSlot, &body,
            sizeof(body), n, [&](uint8_t* dst) { std::memcpy(dst, why.data(), n); });
  }
  committed_cv_.notify_all();
}

int64_t CommitCoordinator::committed_step() const {
  std::lock_guard<std::mutex> lock(mu_);
  return committed_;
}

bool CommitCoordinator::failed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failed_;
}

std::string CommitCoordinator::failure() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_;
}

int CommitCoordinator::attached_ranks() const {
  std::lock_guard<std::mutex> lock(mu_);
  return AttachedLocked();
}

CoordinatorStats CommitCoordinator::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

std::map<std::string, int64_t> CommitCoordinator::backend_stats() {
  std::lock_guard<std::mutex> lock(mu_);
  return backend_->Stats();
}

}  // namespace bagpipe::shard
