// The PSClient worker: it picks the next operation that may start (commit order, reads after
// their step, barriers), expires operations past their deadline, and stages each into packets
// over the shards' channels.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>

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
                          bool marker, PostChunk&& post_chunk,
                          const std::vector<size_t>* extra) {
  const size_t maxr = options_.max_packet_rows;
  const uint32_t S = num_shards();
  std::vector<uint32_t> chunks(S), row_chunks(S);
  uint32_t total = 0, max_chunks = 0;
  for (uint32_t j = 0; j < S; ++j) {
    uint32_t c = static_cast<uint32_t>((off[j + 1] - off[j] + maxr - 1) / maxr);
    row_chunks[j] = c;
    if (extra != nullptr) {
      c += static_cast<uint32_t>(((*extra)[j + 1] - (*extra)[j] + maxr - 1) / maxr);
    }
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
      const size_t begin = k < row_chunks[j] ? off[j] + k * maxr : 0;
      const size_t count = k < row_chunks[j] ? std::min(maxr, off[j + 1] - begin) : 0;
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
  const bool evicts = is_commit && op->nevict_ > 0;
  if (evicts) {
    partitioner_.Split(op->evict_, op->nevict_, &evict_shards_, &evict_order_, &evict_offsets_);
  }
  const size_t maxr = options_.max_packet_rows;
  // The fixed part of chunk k of this commit (a row chunk, or one of evicted keys: nrows 0).
  auto commit_body = [&](uint32_t k, uint32_t chunk_count, size_t nrows) {
    wire::CommitBody b{};
    b.session = options_.session;
    b.step = op->step_;
    b.rank = options_.rank;
    b.world_size = options_.world_size;
    b.chunk_index = k;
    b.chunk_count = chunk_count;
    b.dim = options_.dim;
    b.lr = op->lr_;
    b.nrows = static_cast<uint32_t>(nrows);
    return b;
  };
  SendChunks(op, scratch_offsets_, /*marker=*/is_commit,
             [&](Channel& ch, uint32_t shard, uint32_t slot, uint32_t k, uint32_t chunk_count,
                 size_t begin, size_t count) {
    uint8_t* f = ch.SlotBuffer(slot);
    size_t len, fixed;
    // A commit's chunks after the shard's row chunks carry its evicted keys (<= maxr each).
    const size_t row_chunks = (scratch_offsets_[shard + 1] - scratch_offsets_[shard] + maxr - 1) / maxr;
    if (evicts && k >= row_chunks && evict_offsets_[shard + 1] > evict_offsets_[shard]) {
      const size_t eb = evict_offsets_[shard] + (k - row_chunks) * maxr;
      const size_t ec = std::min(maxr, evict_offsets_[shard + 1] - eb);
      wire::CommitBody b = commit_body(k, chunk_count, 0);
      b.nevict = static_cast<uint32_t>(ec);
      std::memcpy(f + kHeaderBytes, &b, sizeof(b));
      len = wire::CommitFrameBytes(0, dim, ec);
      WriteHeader(f, MsgType::kCommit, len);
      auto* keys = reinterpret_cast<int64_t*>(f + kHeaderBytes + sizeof(b));
      for (size_t i = 0; i < ec; ++i) keys[i] = op->evict_[evict_order_[eb + i]];
      ch.Post(slot, len, std::make_shared<AckRequest>(this, op, shard));
      return;
    }
    if (is_commit) {
      const wire::CommitBody b = commit_body(k, chunk_count, count);
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
    auto request = std::make_shared<AckRequest>(this, op, shard);
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
  }, evicts ? &evict_offsets_ : nullptr);
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
    ch.Post(slot, len, std::make_shared<AckRequest>(this, op, j));
    ch.Flush();
  }
}

}  // namespace bagpipe::client
