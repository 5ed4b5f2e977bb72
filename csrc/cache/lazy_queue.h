// LazyQueue: a FIFO of slots with O(1) removal from anywhere, the eviction queue of one next
// use. An entry is {slot, generation}; the slot table gives a slot a new generation each
// time it joins a queue or the pin list and clears its membership flag when it leaves, so an
// entry is live only while both still match. Removal therefore writes nothing here (the entry
// goes stale in place, to be skipped at the head or dropped by Compact), and appending writes
// sequential memory: no neighbouring slot is touched, unlike an intrusive linked list.
//
// Thread safety: none; the owner serializes access.
//
// Invariants:
//   1. Live entries are in FIFO order of their Push.
//   2. Entries keep their positions [head(), end()) until the next Push or Compact.
//   3. The owner bounds the stale entries (it compacts its queues when its pushes since the
//      last compaction outnumber its live entries), so memory stays O(live entries).
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace bagpipe::cache {

struct QueueEntry {
  int32_t slot;
  uint32_t gen;
};

class LazyQueue {
 public:
  LazyQueue() = default;
  // Adopts `storage` (cleared) so that a recycled buffer keeps its capacity.
  explicit LazyQueue(std::vector<QueueEntry>&& storage) : e_(std::move(storage)) { e_.clear(); }

  // Positions [head(), end()) hold the entries not dropped yet (live or stale).
  size_t head() const { return head_; }
  size_t end() const { return e_.size(); }
  // REQUIRES: head() <= pos < end().
  QueueEntry at(size_t pos) const { return e_[pos]; }
  // Bytes of the entry storage allocated.
  size_t memory_bytes() const { return e_.capacity() * sizeof(QueueEntry); }

  // Appends e at end() (entries keep their push order).
  void Push(QueueEntry e) { e_.push_back(e); }

  // Drops the entries before `pos` (the owner knows they are stale). REQUIRES: pos <= end().
  void DropBefore(size_t pos) {
    if (pos > head_) head_ = pos;
  }

  // The first live entry, or nullptr; stale entries before it are dropped.
  // is_live(entry) tells live from stale entries.
  template <typename IsLive>
  const QueueEntry* Front(const IsLive& is_live) {
    for (; head_ < e_.size(); ++head_) {
      if (is_live(e_[head_])) return &e_[head_];
    }
    return nullptr;
  }

  // Calls fn(entry) for every live entry in FIFO order.
  template <typename IsLive, typename Fn>
  void ForEachLive(const IsLive& is_live, Fn&& fn) const {
    for (size_t i = head_; i < e_.size(); ++i) {
      if (is_live(e_[i])) fn(e_[i]);
    }
  }

  // Drops every stale entry (order of the live ones kept); returns the live entries left.
  template <typename IsLive>
  size_t Compact(const IsLive& is_live) {
    constexpr size_t kAhead = 16;
    size_t out = 0;
    for (size_t i = head_; i < e_.size(); ++i) {
      if (i + kAhead < e_.size()) is_live.Prefetch(e_[i + kAhead]);
      if (is_live(e_[i])) e_[out++] = e_[i];
    }
    e_.resize(out);
    head_ = 0;
    return out;
  }

  // Gives up the buffer (for recycling).
  std::vector<QueueEntry> Release() {
    head_ = 0;
    return std::move(e_);
  }

 private:
  std::vector<QueueEntry> e_;
  size_t head_ = 0;
};

}  // namespace bagpipe::cache
