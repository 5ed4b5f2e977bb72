// SpillTier: the DRAM budget of an EmbeddingStore's arena and the disk tier beneath it.
//
// Modes (fixed at construction):
//   unlimited    budget == 0: pages are never spilled, nothing is tracked.
//   memory-only  budget > 0, no spill dir: MakeRoom throws MemoryBudgetError when the new
//                pages would pass the budget (before the caller writes anything).
//   spill        budget > 0 and a spill dir: when resident bytes would pass the high
//                watermark, the coldest pages move to extents of an unlinked file in the
//                spill dir (address-stable remap, PageArena::MoveToFile) until residency is
//                at the low watermark; hot spilled pages move back (MoveToMemory).
//
// Page temperature: every op bumps an epoch; rows accessed in it Touch() their page; after
// the op each page's 8-bit aging register becomes (score >> 1) | (touched ? 0x80 : 0).
// A page's heat is popcount(score) (ops of the last 8 that touched it) then score (recency).
// Eviction takes the coldest pages first. After an op, at most two spilled pages come back:
// into free room under the high watermark when touched in >= 4 of the last 8 ops, or in
// exchange for a resident page touched in <= 2 when touched in >= 6 (no ping-pong between
// pages of similar heat). Spill extents keep their disk blocks for reuse.
//
// Thread safety: every method requires the store's op mutex (exclusive access to the
// arena). Callbacks run on the thread that calls MakeRoom / AfterOp.
//
// Invariants:
//   1. Spill mode: after AfterOp returns, resident bytes <= high watermark <= budget.
//   2. Memory-only mode: resident bytes never exceed the budget.
//   3. The spill callback runs at most once per SpillTier, on the first page spilled.
//   4. Spilling never changes a row's bytes or address (PageArena invariants 1 and 4).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "store/page_arena.h"

namespace bagpipe::store {

// Called once, on the first page that goes to disk (the Python layer raises a warning).
using SpillCallback = std::function<void(const std::string& message)>;

class SpillTier {
 public:
  struct Options {
    int64_t budget_bytes = 0;   // 0: unlimited
    std::string dir;            // empty: memory-only when budget_bytes > 0
    double high_watermark = 0.8;
    double low_watermark = 0.6;
  };

  // REQUIRES: arena outlives this tier; options validated by the store. Creates `dir`
  // (one level) when missing; throws ValueError naming spill_dir if it cannot be used.
  SpillTier(PageArena* arena, const Options& options);
  ~SpillTier();
  SpillTier(const SpillTier&) = delete;
  SpillTier& operator=(const SpillTier&) = delete;

  // A budget is set; pages above it go to disk (a spill directory is set too).
  bool limited() const { return budget_ > 0; }
  bool spilling() const { return budget_ > 0 && !dir_.empty(); }
  // Whether ops must Touch() the pages they access.
  bool tracking() const { return spilling(); }
  int64_t budget_bytes() const { return budget_; }

  // Before `new_pages` pages are allocated. Memory-only: throws MemoryBudgetError when they
  // do not fit. Spill: moves cold pages out so that they fit under the high watermark
  // where possible. Throws IOError when the disk tier fails (no row has changed then).
  void MakeRoom(size_t new_pages);

  // After every op that ran with epoch `epoch`: ages scores, restores invariant 1 and swaps
  // a bounded number of hot spilled pages back in. Costs O(pages) (a few hundred pages per
  // GiB of rows at the automatic 2 MiB page size); eviction passes sort the resident pages.
  void AfterOp(uint32_t epoch);

  // A callback set after the first spill runs at once (the spill happened unobserved).
  void set_callback(SpillCallback cb);

  // Counters since construction: spill passes, pages written out, pages read back.
  int64_t spill_count() const { return spill_count_; }
  int64_t swap_outs() const { return swap_outs_; }
  int64_t swap_ins() const { return swap_ins_; }

 private:
  static int Heat(const PageArena::Page& p);
  void EvictTo(int64_t target_resident_bytes);
  void SwapOut(PageArena::Page* p);
  void SwapIn(PageArena::Page* p);
  void OpenFile();
  int64_t AcquireExtent();
  void ReleaseExtent(int64_t extent);
  int64_t resident_bytes() const;

  PageArena* const arena_;
  const int64_t budget_;
  const std::string dir_;
  const int64_t high_bytes_;
  const int64_t low_bytes_;

  // Spill file: opened on the first spill, unlinked (nothing survives the process).
  int fd_ = -1;
  int64_t next_extent_ = 0;          // extents [0, next_extent_) have been allocated on disk
  std::vector<int64_t> free_extents_;

  SpillCallback callback_;
  std::string first_spill_;  // message of the first spill; empty before it
  bool warned_ = false;      // the callback has run
  int64_t spill_count_ = 0;
  int64_t swap_outs_ = 0;
  int64_t swap_ins_ = 0;
};

}  // namespace bagpipe::store
