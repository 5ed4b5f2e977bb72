// CacheMetadata's eviction queues and pin list (cache_metadata.h invariants 4 and 5): joining
// and leaving them, compaction of their stale entries, Advance (expiring pins and passed next
// uses), and the stream of victims Admit consumes.
#include <algorithm>
#include <string>

#include "cache/cache_metadata.h"
#include "cache/cache_metadata_checks.h"
#include "cache/cache_metadata_probe.h"
#include "common/errors.h"

namespace bagpipe::cache {

using namespace metadata_detail;

void CacheMetadata::FinishCall() {
  if (purge_pending_) CompactQueues();
}

void CacheMetadata::CompactQueues() {
  const QueuedLive live = queued_live();
  buckets_.ForEachMutable([&](int32_t, LazyQueue& q) { q.Compact(live); });
  pushes_ = 0;
  if (purge_pending_) {
    purge_pending_ = false;
    const PinnedLive plive = pinned_live();
    size_t keep = 0;
    for (const QueueEntry& e : pinned_) {
      if (plive(e)) pinned_[keep++] = e;
    }
    pinned_.resize(keep);
  }
}

void CacheMetadata::Enqueue(int32_t slot) {
  SlotRec& s = slots_[slot];
  s.queued = true;
  ++queued_;
  ++pushes_;
  buckets_.Get(BucketOf(s.next_use)).Push(QueueEntry{slot, Bump(s)});
}

void CacheMetadata::SetNextUse(int32_t slot, int32_t next_use) {
  SlotRec& s = slots_[slot];
  if (!s.queued) {
    s.next_use = next_use;
    return;
  }
  Unqueue(s);
  s.next_use = next_use;
  Enqueue(slot);
}

void CacheMetadata::PinSlot(int32_t slot, int32_t pin_step) {
  SlotRec& s = slots_[slot];
  if (s.queued) Unqueue(s);
  s.pin_step = IsPinned(s) ? std::max(s.pin_step, pin_step) : pin_step;
  s.pinned = true;
  pinned_.push_back(QueueEntry{slot, Bump(s)});
}

void CacheMetadata::FreeSlot(int32_t slot) {
  SlotRec& s = slots_[slot];
  if (s.queued) Unqueue(s);
  WithIndex([&](auto& index) { index.Erase(HashKey(s.key), slot); });
  s.key = kEmptyKey;
  s.version = -1;
  s.next_use = kNever32;
  s.pin_step = -1;
  s.state = SlotState::kFree;
  s.pinned = false;  // its queue and pin-list entries are stale from here on
  free_.push_back(slot);
}

void CacheMetadata::StartVictims() {
  victims_.clear();
  gather_queue_ = buckets_.Highest(&gather_bucket_);  // lru: the one bucket
  gather_pos_ = gather_queue_ != nullptr ? gather_queue_->head() : 0;
}

void CacheMetadata::GatherVictims(size_t want) {
  const QueuedLive live = queued_live();
  while (victims_.size() < want && gather_queue_ != nullptr) {
    const LazyQueue& q = *gather_queue_;
    const size_t end = q.end();
    for (; gather_pos_ < end && victims_.size() < want; ++gather_pos_) {
      if (gather_pos_ + kApplyAhead < end) live.Prefetch(q.at(gather_pos_ + kApplyAhead));
      const QueueEntry e = q.at(gather_pos_);
      if (!live(e)) continue;
      const SlotRec& s = slots_[e.slot];
      victims_.push_back(
          Victim{e.slot, s.next_use, HashKey(s.key), gather_queue_, gather_pos_});
    }
    if (gather_pos_ >= end) {
      gather_queue_ = buckets_.Below(gather_bucket_, &gather_bucket_);
      gather_pos_ = gather_queue_ != nullptr ? gather_queue_->head() : 0;
    }
  }
}

void CacheMetadata::FinishVictims(size_t consumed) {
  if (consumed > 0) {
    // Victims were consumed in order: every bucket above the last one's is used up.
    const Victim& last = victims_[consumed - 1];
    last.queue->DropBefore(last.pos + 1);
    int32_t key = 0;
    const LazyQueue* top = buckets_.Highest(&key);
    while (top != nullptr && top != last.queue) {
      buckets_.Erase(key);
      top = buckets_.Highest(&key);
    }
  }
  victims_.clear();
  gather_queue_ = nullptr;
}

// ---- moving to a step ---------------------------------------------------------------------

void CacheMetadata::Advance(int64_t step) {
  if (step < step_) {
    throw ValueError("Advance: step " + std::to_string(step) + " is before the current step " +
                     std::to_string(step_));
  }
  metadata_checks::CheckStep32(step, "Advance", "step");
  step_ = step;
  step32_ = static_cast<int32_t>(step);
  // Expired pins join the queues in pin order.
  const PinnedLive plive = pinned_live();
  size_t keep = 0;
  for (size_t i = 0; i < pinned_.size(); ++i) {
    if (i + kApplyAhead < pinned_.size()) plive.Prefetch(pinned_[i + kApplyAhead]);
    const QueueEntry e = pinned_[i];
    if (!plive(e)) continue;  // superseded entry
    SlotRec& s = slots_[e.slot];
    if (s.pin_step >= step32_) {
      pinned_[keep++] = e;
      continue;
    }
    s.pinned = false;
    if (s.next_use <= step32_) s.next_use = kNever32;
    Enqueue(e.slot);
  }
  pinned_.resize(keep);
  if (policy_ == EvictionPolicy::kOracle) {
    // Next uses that passed without a read become kNever, oldest bucket first.
    LazyQueue& never = buckets_.Get(kNever32);
    const QueuedLive live = queued_live();
    int32_t bucket = 0;
    while (LazyQueue* q = buckets_.Lowest(&bucket)) {
      if (bucket > step32_) break;
      q->ForEachLive(live, [&](QueueEntry e) {
        SlotRec& s = slots_[e.slot];
        s.next_use = kNever32;
        ++pushes_;
        never.Push(QueueEntry{e.slot, Bump(s)});  // still queued: queued_ unchanged
      });
      buckets_.Erase(bucket);
    }
  }
  // Step-boundary housekeeping: stale queue entries go once they outnumber the live ones.
  if (purge_pending_ || pushes_ > queued_ + kCompactSlack) CompactQueues();
}

}  // namespace bagpipe::cache
