// The commit path of the coordinator (coordinator.h invariants 1-5): a chunk is checked
// against the session and the step protocol, kept and acknowledged at once; the step is
// applied, in rank and chunk order, once every rank's chunks are in.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>

#include "common/errors.h"
#include "shard/coordinator.h"

namespace bagpipe::shard {

using transport::ServerLink;
using wire::MsgType;
using wire::Status;

namespace {

bool SameBits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

std::string FloatText(float v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.9g", static_cast<double>(v));
  return buf;
}

}  // namespace

void CommitCoordinator::SubmitChunk(const wire::CommitView& chunk,
                                    const std::shared_ptr<ServerLink>& link, uint64_t tag,
                                    uint32_t slot, transport::RecvBuffer* owner) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto& b = chunk.body;
  const std::string what = "commit of step " + std::to_string(b.step) + " rank " +
                           std::to_string(b.rank) + " chunk " + std::to_string(b.chunk_index) +
                           "/" + std::to_string(b.chunk_count);
  ChunkVerdict v = AdmitChunkLocked(b, link.get(), what);
  if (v.kind == ChunkVerdict::kStore) v = SequenceChunkLocked(chunk, what);
  if (v.kind == ChunkVerdict::kStore) {
    std::string bad = CheckKeysLocked(chunk.keys, b.nrows);
    if (bad.empty()) bad = CheckKeysLocked(chunk.evict, b.nevict);
    if (!bad.empty()) v = ChunkVerdict::Refuse(Status::kInvalidArgument, what + ": " + bad);
  }
  switch (v.kind) {
    case ChunkVerdict::kRefuse:
      link->SendError(tag, slot, v.status, b.session, v.text);
      return;
    case ChunkVerdict::kAck:
      AckChunkLocked(b, *link, tag, slot, v.disposition);
      return;
    case ChunkVerdict::kStore:
      break;
  }
  StoreChunkLocked(chunk, owner);
  AckChunkLocked(b, *link, tag, slot, wire::Disposition::kStored);  // before any update work
  if (ranks_complete_ == params_.world_size) ApplyLocked();
}

// The session's checks: the shard is serving, `link` opened the table as the chunk's rank,
// and the chunk's session, world size, dim and lr are the session's.
CommitCoordinator::ChunkVerdict CommitCoordinator::AdmitChunkLocked(const wire::CommitBody& b,
                                                                    const ServerLink* link,
                                                                    const std::string& what) {
  using V = ChunkVerdict;
  if (failed_) return V::Refuse(Status::kSessionFailed, failure_);
  if (shutting_down_) return V::Refuse(Status::kShuttingDown, shutdown_why_);
  if (!has_session_ || b.rank >= attached_.size() || attached_[b.rank].get() != link) {
    return V::Refuse(Status::kNotOpen, what + ": this connection has not opened table '" +
                                           table_ + "' as rank " + std::to_string(b.rank));
  }
  if (b.session != params_.session) {
    return V::Refuse(Status::kInvalidArgument,
                     what + ": session " + std::to_string(b.session) +
                         " differs from the open session " + std::to_string(params_.session));
  }
  if (b.world_size != params_.world_size) {
    return V::Refuse(Status::kInvalidArgument,
                     what + ": world_size " + std::to_string(b.world_size) +
                         " differs from the session's " + std::to_string(params_.world_size));
  }
  if (b.dim != schema_.dim) {
    return V::Refuse(Status::kInvalidArgument, what + ": dim " + std::to_string(b.dim) +
                                                   " differs from the table's " +
                                                   std::to_string(schema_.dim));
  }
  if (!std::isfinite(b.lr) || b.lr < 0.0f) {
    return V::Refuse(Status::kInvalidArgument,
                     what + ": lr " + FloatText(b.lr) + " must be finite and >= 0");
  }
  return V::Store();
}

// The step protocol's checks (invariants 1-3): a committed step's chunk is acknowledged
// again, a later step than the next one, a conflicting lr or a conflicting retry fails the
// session, a byte-identical retry is acknowledged as a duplicate.
CommitCoordinator::ChunkVerdict CommitCoordinator::SequenceChunkLocked(
    const wire::CommitView& chunk, const std::string& what) {
  using V = ChunkVerdict;
  const auto& b = chunk.body;
  if (b.step <= committed_) {
    ++stats_.committed_retries;
    return V::Ack(wire::Disposition::kAlreadyCommitted);
  }
  if (b.step != committed_ + 1) {
    FailLocked("out-of-order step: " + what + " arrived while the shard's committed step is " +
               std::to_string(committed_) + " (it expects step " + std::to_string(committed_ + 1) +
               ")");
    return V::Refuse(Status::kSessionFailed, failure_);
  }
  if (pending_has_lr_ && !SameBits(b.lr, pending_lr_)) {
    FailLocked("conflicting lr: " + what + " carries lr " + FloatText(b.lr) +
               " but the step's chunks received first carry " + FloatText(pending_lr_) +
               " (every rank must commit a step with the same learning rate)");
    return V::Refuse(Status::kSessionFailed, failure_);
  }
  const RankPending& rp = pending_[b.rank];
  if (rp.chunk_count != 0 && rp.chunk_count != b.chunk_count) {
    FailLocked("conflicting retry: " + what + " announces chunk_count " +
               std::to_string(b.chunk_count) + " but this rank's earlier chunks of the step said " +
               std::to_string(rp.chunk_count));
    return V::Refuse(Status::kSessionFailed, failure_);
  }
  if (rp.chunk_count != 0 && rp.chunks[b.chunk_index].present) {
    const Chunk& c = rp.chunks[b.chunk_index];
    if (c.nrows == b.nrows && c.nevict == b.nevict && c.len == chunk.payload_len &&
        (chunk.payload_len == 0 ||
         std::memcmp(c.payload(), chunk.payload, chunk.payload_len) == 0)) {
      ++stats_.duplicate_chunks;
      return V::Ack(wire::Disposition::kDuplicate);
    }
    FailLocked("conflicting retry: " + what +
               " carries a different payload than the copy received first");
    return V::Refuse(Status::kSessionFailed, failure_);
  }
  return V::Store();
}

// Keeps the chunk for the pending step: takes over `owner` (the receive buffer) when it holds
// the payload aligned, else copies it; counts the rank complete once all its chunks are in.
void CommitCoordinator::StoreChunkLocked(const wire::CommitView& chunk,
                                         transport::RecvBuffer* owner) {
  const auto& b = chunk.body;
  RankPending& rp = pending_[b.rank];
  if (rp.chunk_count == 0) {
    rp.chunk_count = b.chunk_count;
    rp.received = 0;
    rp.chunks.resize(b.chunk_count);
    for (auto& c : rp.chunks) c.present = false;
  }
  Chunk& c = rp.chunks[b.chunk_index];
  if (owner != nullptr && owner->Holds(chunk.payload, chunk.payload_len) &&
      reinterpret_cast<uintptr_t>(chunk.payload) % alignof(int64_t) == 0) {
    // Take the receive buffer; the reader gets this slot's previous one back.
    c.offset = static_cast<size_t>(chunk.payload - owner->data.get());
    std::swap(c.buf, *owner);
  } else {
    c.buf.Reserve(chunk.payload_len);
    if (chunk.payload_len > 0) std::memcpy(c.buf.data.get(), chunk.payload, chunk.payload_len);
    c.offset = 0;
  }
  c.len = chunk.payload_len;
  c.nrows = b.nrows;
  c.nevict = b.nevict;
  c.present = true;
  pending_has_lr_ = true;
  pending_lr_ = b.lr;
  ++rp.received;
  ++stats_.chunks_received;
  if (rp.received == rp.chunk_count) ++ranks_complete_;
}

void CommitCoordinator::AckChunkLocked(const wire::CommitBody& b, ServerLink& link, uint64_t tag,
                                       uint32_t slot, wire::Disposition d) {
  wire::AckBody a{};
  a.step = b.step;
  a.committed_step = committed_;
  a.rank = b.rank;
  a.chunk_index = b.chunk_index;
  a.disposition = static_cast<uint32_t>(d);
  link.Send(MsgType::kAck, Status::kOk, tag, slot, &a, sizeof(a), 0, nullptr);
}

void CommitCoordinator::ApplyLocked() {
  const int64_t step = committed_ + 1;
  size_t total = 0;
  apply_segments_.clear();
  for (const auto& rp : pending_) {  // rank order, then chunk order
    for (uint32_t i = 0; i < rp.chunk_count; ++i) {
      const Chunk& c = rp.chunks[i];
      if (c.nrows == 0) continue;
      const uint8_t* p = c.payload();
      apply_segments_.push_back({reinterpret_cast<const int64_t*>(p),
                                 reinterpret_cast<const float*>(p + size_t{c.nrows} * 8), c.nrows});
      total += c.nrows;
    }
  }
  const int divisor = params_.grad_division ? static_cast<int>(params_.world_size) : 1;
  if (total > 0) {
    try {
      // The segments are read in place: no concatenation of the step's gradients.
      backend_->ApplyGradientsSegments(apply_segments_.data(), apply_segments_.size(),
                                     pending_lr_, divisor);
    } catch (const std::exception& e) {
      // The backend changed nothing (its invariant 3): the table stays at the committed step.
      FailLocked("applying step " + std::to_string(step) + " failed: " + e.what());
      return;
    }
  }
  // Virtual tables: the keys evicted at this step's boundary go, with their optimizer state,
  // before any read of this step is served (a later touch recreates them as new).
  evict_scratch_.clear();
  for (const auto& rp : pending_) {
    for (uint32_t i = 0; i < rp.chunk_count; ++i) {
      const Chunk& c = rp.chunks[i];
      if (c.nevict == 0) continue;
      const size_t at = evict_scratch_.size();
      evict_scratch_.resize(at + c.nevict);
      std::memcpy(evict_scratch_.data() + at,
                  c.payload() + size_t{c.nrows} * 8 + size_t{c.nrows} * schema_.dim * 4,
                  size_t{c.nevict} * 8);  // (may be unaligned in the payload)
    }
  }
  if (!evict_scratch_.empty()) {
    try {
      backend_->Erase(evict_scratch_.data(), evict_scratch_.size());
    } catch (const std::exception& e) {
      FailLocked("evicting rows at step " + std::to_string(step) + " failed: " + e.what());
      return;
    }
  }
  committed_ = step;
  ++stats_.steps_applied;
  stats_.rows_applied += static_cast<int64_t>(total);
  stats_.committed_step = committed_;
  for (auto& rp : pending_) {
    rp.chunk_count = 0;
    rp.received = 0;
  }
  ranks_complete_ = 0;
  pending_has_lr_ = false;
  committed_cv_.notify_all();
  ServeReadyWaitersLocked();
  wire::StepBody body{params_.session, committed_};
  for (const auto& l : attached_) {
    if (l) l->Send(MsgType::kNotifyCommitted, Status::kOk, 0, wire::kNoSlot, &body, sizeof(body), 0, nullptr);
  }
  if (options_.checkpoint_every > 0 && !options_.checkpoint_dir.empty() &&
      (committed_ + 1) % options_.checkpoint_every == 0) {
    PeriodicCheckpointLocked();
  }
}

}  // namespace bagpipe::shard
