// CacheMetadata: which fused rows one rank's device cache holds, in which slot, at which
// version, and which slot to give up next. It owns no row values (the device cache does);
// every answer is a compact list of positions and slots the caller applies with gathers and
// scatters.
//
// Thread safety: none. The owner (one BagPipeController) serializes every call.
//
// Slots: capacity_rows = capacity_units * 64, numbered [0, capacity_rows). A slot is kFree
//   or kReady: its device values are the row after the commit of step `version` (the row's
//   previous-update step; -1: the initial value).
//
// Invariants:
//   1. Capacity: resident slots never exceed capacity_rows.
//   2. One slot per key and one key per slot: the key->slot map and the slot table agree.
//   3. Unique destinations: within one Admit call every returned slot is distinct, and a slot
//      admitted at step t is pinned through t, so no later call of the same step hands it
//      out again (a batch larger than the cache admits only what fits).
//   4. A pinned slot (pin_step >= current step) is never evicted.
//   5. Victim order is a pure function of the call sequence (deterministic):
//        lru:    least recently touched unpinned slot first;
//        oracle: unpinned slot with the furthest next use first (kNever, i.e. no use in the
//                known window, before any finite use), ties least recently (re)queued first.
//      Under oracle a placement evicts only a victim whose next use is strictly later than
//      the candidate's (Belady with bypass), except that a candidate with no known next use
//      replaces a victim with none (LRU among the unknown); a free slot is always taken.
//   6. Every failing call validates before it mutates: a call that throws changed nothing.
//   7. Steps, versions, pin steps and finite next uses are stored in 32 bits: a call that
//      would store a value outside [INT32_MIN, INT32_MAX) throws ValueError (invariant 6).
//
// Layout (what makes a step's metadata cost a few random memory accesses per key): a slot is
// one 32-byte record; the key->slot index is either a direct array indexed by the key
// (direct_index.h: when the keys are known to lie in [0, key_bound) and key_bound is small,
// see UsesDirectIndex) or a map of 8-byte tagged cells (slot_map.h); all live in huge-page
// mappings. Eviction queues are lazy FIFOs (lazy_queue.h): a slot's generation changes
// whenever it joins or leaves a queue or the pin list, so removal never touches a neighbour.
// A batch call first validates its arguments, keys' uniqueness included (a bit per key with
// the direct index, a scratch hash set otherwise), then probes the index in one
// software-pipelined loop (prefetch the index cell, then the slot record, then act) that
// writes into caller-provided output arrays; no call allocates once its scratch has grown.
//
// Files: cache_metadata.cc (construction, slot-level calls, inspection),
// cache_metadata_queues.cc (eviction queues, pins, Advance, victims), cache_metadata_query.cc,
// cache_metadata_admit.cc (the two batch calls of a step), cache_metadata_probe.h (the
// pipelined probe both use), cache_metadata_checks.h (argument validation).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cache/direct_index.h"
#include "cache/eviction_buckets.h"
#include "cache/huge_array.h"
#include "cache/key_set.h"
#include "cache/lazy_queue.h"
#include "cache/slot_map.h"

namespace bagpipe::cache {

inline constexpr int64_t kRowsPerUnit = 64;
inline constexpr int64_t kNever = INT64_MAX;  // next use: absent from the known window
inline constexpr int64_t kUnboundedKeys = -1;  // key_bound: any key >= 0
// The direct index is used when key_bound <= kDirectIndexMaxKeys, or key_bound <=
// kDirectIndexKeysPerSlot * capacity_rows (its 4 bytes per key stay <= 128 per slot).
inline constexpr int64_t kDirectIndexMaxKeys = int64_t{1} << 24;
inline constexpr int64_t kDirectIndexKeysPerSlot = 32;

enum class EvictionPolicy : uint8_t { kLru = 0, kOracle = 1 };

// Parses "lru" / "oracle"; throws ValueError otherwise.
EvictionPolicy ParseEvictionPolicy(const std::string& name);

enum class SlotState : uint8_t { kFree = 0, kReady = 1 };

struct QueryResult {
  std::vector<int64_t> hit_pos;        // positions whose slot is ready at the wanted version
  std::vector<int64_t> hit_slots;
  std::vector<int64_t> miss_pos;       // everything else (absent or stale)
  int64_t stale = 0;                   // ready slots dropped because their version differed
};

struct PlaceResult {
  std::vector<int64_t> pos;            // input positions that got a slot, in input order
  std::vector<int64_t> slots;          // their (distinct) destination slots
  std::vector<int64_t> evicted_keys;   // keys whose slot was taken, in eviction order
  std::vector<int64_t> bypassed;       // input positions that wanted a slot and got none
};

// Output arrays of QueryInto: each has room for n entries.
struct QueryOut {
  int64_t* hit_pos;
  int64_t* hit_slots;
  int64_t* miss_pos;
};
struct QueryCounts {
  int64_t hits = 0;
  int64_t misses = 0;
  int64_t stale = 0;
};

// Output arrays of AdmitInto: each has room for n entries.
struct AdmitOut {
  int64_t* pos;
  int64_t* slots;
  int64_t* evicted_keys;
  int64_t* bypassed;
};
struct AdmitCounts {
  int64_t placed = 0;
  int64_t evicted = 0;
  int64_t bypassed = 0;
};

struct MetadataStats {
  int64_t capacity_rows = 0;
  int64_t resident = 0;
  int64_t pinned = 0;
  int64_t admitted = 0;   // cumulative placements by Admit
  int64_t bypassed = 0;   // candidates that got no slot
  int64_t evictions = 0;
  int64_t invalidations = 0;
  int64_t stale = 0;
  int64_t memory_bytes = 0;  // slot table + key map + queues + scratch
};

class CacheMetadata {
 public:
  // key_bound: every key of every call lies in [0, key_bound) (the table's rows), or
  // kUnboundedKeys. A call with a key outside it throws ValueError naming the key.
  // REQUIRES: 1 <= capacity_units, capacity_rows <= 2^31 - 1; key_bound == kUnboundedKeys or
  // key_bound >= 1 (ValueError otherwise).
  CacheMetadata(int64_t capacity_units, EvictionPolicy policy,
                int64_t key_bound = kUnboundedKeys);

  // Whether a cache of capacity_rows over keys [0, key_bound) indexes keys directly.
  static bool UsesDirectIndex(int64_t capacity_rows, int64_t key_bound);

  // Fixed at construction: capacity_units x 64 rows, and the eviction order.
  int64_t capacity_rows() const { return capacity_rows_; }
  EvictionPolicy policy() const { return policy_; }
  int64_t key_bound() const { return key_bound_; }
  bool direct_index() const { return direct_; }
  // The step of the last Advance (its initial value before any), and the resident keys.
  int64_t current_step() const { return step_; }
  int64_t size() const {
    return static_cast<int64_t>(direct_ ? direct_index_.size() : map_.size());
  }
  // Entries of the pin list: an upper bound on the slots Advance unpins (its cost).
  int64_t pin_entries() const { return static_cast<int64_t>(pinned_.size()); }

  // Moves to `step`: pins with pin_step < step expire and finite next uses <= step become
  // kNever.  REQUIRES: current_step() <= step < 2^31 - 1.
  void Advance(int64_t step);

  // Classifies n unique keys.  A slot whose version differs from versions[i] is stale: it is
  // freed and the key reported as a miss.  Hits are touched: their next use becomes
  // next_uses[i] (< 0 means kNever) and they become most recent.
  // REQUIRES: keys unique and in [0, key_bound), next_uses < 2^31 - 1 (ValueError
  // otherwise).
  QueryResult Query(const int64_t* keys, const int64_t* versions, const int64_t* next_uses,
                    size_t n);
  // Query into caller-provided arrays (each with room for n); returns the counts.
  QueryCounts QueryInto(const int64_t* keys, const int64_t* versions, const int64_t* next_uses,
                        size_t n, const QueryOut& out);

  // Gives ready slots, pinned through the current step, to keys in input order, evicting per
  // policy; candidates that find no slot are bypassed (not in the result).
  // REQUIRES: keys unique, in [0, key_bound) and not resident; versions in
  // [INT32_MIN, INT32_MAX);
  // next_uses < 2^31 - 1 (ValueError otherwise).
  PlaceResult Admit(const int64_t* keys, const int64_t* versions, const int64_t* next_uses,
                    size_t n);
  // Admit into caller-provided arrays (each with room for n); returns the counts.
  AdmitCounts AdmitInto(const int64_t* keys, const int64_t* versions, const int64_t* next_uses,
                        size_t n, const AdmitOut& out);

  // For each key: its slot, or -1.
  // REQUIRES: with a key_bound, keys in [0, key_bound) (ValueError otherwise).
  void Lookup(const int64_t* keys, size_t n, int64_t* out_slots) const;

  // For each key: its slot if resident at versions[i], else -1 (no touch, no state change).
  // REQUIRES: with a key_bound, keys in [0, key_bound) (ValueError otherwise).
  void Resident(const int64_t* keys, const int64_t* versions, size_t n,
                int64_t* out_slots) const;

  // Sets the version of resident slots (after a local SGD update).
  // REQUIRES: each resident; version in [INT32_MIN, INT32_MAX).
  void SetVersion(const int64_t* slots, size_t n, int64_t version);

  // Extends the pin of resident slots through `pin_step`.
  // REQUIRES: each resident; pin_step in [INT32_MIN, INT32_MAX).
  void Pin(const int64_t* slots, size_t n, int64_t pin_step);

  // Oracle bookkeeping when a step enters the window: a resident key whose next use is later
  // than `step` (or kNever) gets next use `step`.  No-op under lru.
  // REQUIRES: step in [INT32_MIN, INT32_MAX); with a key_bound, keys in [0, key_bound)
  // (ValueError otherwise).
  void NoteUses(const int64_t* keys, size_t n, int64_t step);

  // How many of the keys are resident with no known next use (kNever): the rows NoteUses of
  // a step later than every finite next use would change (an adaptive window's probe,
  // runtime/prefetch.py). 0 under lru. No state change.
  // REQUIRES: with a key_bound, keys in [0, key_bound) (ValueError otherwise).
  int64_t CountUnknownNextUses(const int64_t* keys, size_t n) const;

  // Frees the slots of the given keys; returns them (absent keys are ignored).
  // REQUIRES: with a key_bound, keys in [0, key_bound) (ValueError otherwise).
  std::vector<int64_t> Invalidate(const int64_t* keys, size_t n);

  // Frees every slot.
  void Clear();

  // Counters since construction (Clear keeps them); capacity, resident, pinned and memory
  // as of now.
  MetadataStats Stats() const;

  struct SlotView {
    int64_t key;
    SlotState state;
    int64_t version;
    int64_t next_use;
    int64_t pin_step;
  };
  // What slot `slot` holds now (next_use kNever: none).
  // REQUIRES: 0 <= slot < capacity_rows() (ValueError otherwise).
  SlotView Slot(int64_t slot) const;

  // Every resident slot (ascending) and its key: what a write-back of the whole cache reads.
  void ResidentSlots(std::vector<int64_t>* keys, std::vector<int64_t>* slots) const;

  // Unpinned resident slots in victim order (first = next victim).  For tests and debugging.
  std::vector<int64_t> VictimOrder() const;

  // Tests only: stale queue entries are purged whenever a slot's generation crosses a
  // multiple of `period` (default 2^31). REQUIRES: a power of two in [2, 2^31].
  void SetGenerationPeriodForTest(uint32_t period);

 private:
  static constexpr int32_t kNever32 = INT32_MAX;

  // 32 bytes: two records per cache line, one random access per key.
  struct alignas(32) SlotRec {
    int64_t key;        // kEmptyKey when free
    int32_t version;
    int32_t next_use;   // kNever32: no known next use
    int32_t pin_step;   // pinned while pinned && pin_step >= step32_
    uint32_t gen;       // a new value each time the slot joins a queue or the pin list
    uint32_t spare;
    SlotState state;
    bool queued;        // in the eviction bucket of its next use (resident and unpinned)
    bool pinned;
  };
  static_assert(sizeof(SlotRec) == 32);

  // Liveness of queue entries (eviction buckets) and of pin-list entries: the entry's
  // generation is the slot's and the slot is still a member.
  struct QueuedLive {
    const SlotRec* s;
    bool operator()(QueueEntry e) const { return s[e.slot].gen == e.gen && s[e.slot].queued; }
    void Prefetch(QueueEntry e) const { __builtin_prefetch(&s[e.slot]); }
  };
  struct PinnedLive {
    const SlotRec* s;
    bool operator()(QueueEntry e) const { return s[e.slot].gen == e.gen && s[e.slot].pinned; }
    void Prefetch(QueueEntry e) const { __builtin_prefetch(&s[e.slot]); }
  };

  QueuedLive queued_live() const { return QueuedLive{slots_.data()}; }
  PinnedLive pinned_live() const { return PinnedLive{slots_.data()}; }
  bool IsPinned(const SlotRec& s) const { return s.pinned && s.pin_step >= step32_; }
  int32_t BucketOf(int32_t next_use) const {
    return policy_ == EvictionPolicy::kLru ? 0 : next_use;
  }
  // A new generation (for a new queue / pin-list entry). Crossing a period: stale entries
  // of earlier generations are purged at the end of this call, long before the 32-bit
  // generation could come back to their values.
  uint32_t Bump(SlotRec& s) {
    ++s.gen;
    if (__builtin_expect((s.gen & gen_period_mask_) == 0, 0)) purge_pending_ = true;
    return s.gen;
  }
  void FinishCall();          // compaction of the queues, when due
  void CompactQueues();
  void Enqueue(int32_t slot);  // at the tail of the bucket of its next use
  void Unqueue(SlotRec& s) {
    s.queued = false;
    --queued_;
  }
  void SetNextUse(int32_t slot, int32_t next_use);  // a queued slot moves to the tail
  void PinSlot(int32_t slot, int32_t pin_step);
  void FreeSlot(int32_t slot);  // erases its key from the index in use
  // The index's hash of `key` (the key itself for the direct index).
  uint64_t HashKey(int64_t key) const {
    return direct_ ? DirectIndex::HashOf(key) : SlotMap::HashOf(key);
  }
  // fn(index) with the index in use (DirectIndex& or SlotMap&): one template per index.
  template <typename Fn>
  decltype(auto) WithIndex(Fn&& fn) {
    return direct_ ? fn(direct_index_) : fn(map_);
  }
  template <typename Fn>
  decltype(auto) WithIndex(Fn&& fn) const {
    return direct_ ? fn(direct_index_) : fn(map_);
  }
  // Keys in [0, key_bound) (>= 0 without one); throws ValueError naming the first other.
  void CheckKeys(const int64_t* keys, size_t n, const char* what) const;
  // Marks keys[0, n) in the uniqueness scratch of `index` (hash path: hash_ gets each
  // key's hash); returns n, or the earliest repeat (then nothing stays marked).
  size_t MarkUnique(const SlotMap& index, const int64_t* keys, size_t n);
  size_t MarkUnique(const DirectIndex& index, const int64_t* keys, size_t n);
  // Unmarks every key of a call (the hash path's scratch needs no unmarking).
  void UnmarkAll(const SlotMap&, const int64_t*, size_t) {}
  void UnmarkAll(const DirectIndex&, const int64_t* keys, size_t n) { bits_.ClearAll(keys, n); }
  template <typename Index>
  QueryCounts QueryWith(Index& index, const int64_t* keys, const int64_t* versions,
                        const int64_t* next_uses, size_t n, const QueryOut& out);
  // Admit's validation: uniqueness, then no key resident (ValueError naming the first).
  template <typename Index>
  void ValidateAdmitKeys(const Index& index, const int64_t* keys, size_t n);
  // Direct index: claims every key's cell (direct_index.h); false, with nothing claimed,
  // when a key repeats or is resident.
  bool ClaimAdmitKeys(DirectIndex& index, const int64_t* keys, size_t n);
  template <typename Index>
  AdmitCounts AdmitWith(Index& index, const int64_t* keys, const int64_t* versions,
                        const int64_t* next_uses, size_t n, const AdmitOut& out);
  // Admit's victims: the live queue entries in victim order (buckets by descending key,
  // FIFO within), gathered ahead of their use in a streaming pass. Nothing is pushed to a
  // queue during Admit, so this order is fixed for the call; a placement consumes the next
  // victim, a bypass none.
  struct Victim {
    int32_t slot;
    int32_t next_use;
    uint64_t hash;     // of the victim's key (its map cell is erased)
    LazyQueue* queue;  // where the entry sits ...
    size_t pos;        // ... and at which position
  };
  void StartVictims();
  void GatherVictims(size_t want);  // until victims_.size() >= want or none are left
  void FinishVictims(size_t consumed);  // drops the consumed entries from their queues

  // Probes `index` for keys[0, n) in a software-pipelined loop and calls
  // sink(i, slot or -1, hash) in input order; pre(i, hash) runs when a key is hashed, well
  // before its sink call (prefetches of the caller's own tables). The sink may free slots
  // of keys it has seen (later keys' answers stay right: keys are unique) but place none.
  // Defined in cache_metadata_probe.h.
  template <typename Index, typename Sink, typename Pre>
  void Probe(const Index& index, const int64_t* keys, size_t n, Sink&& sink, Pre&& pre) const;
  template <typename Index, typename Sink>
  void Probe(const Index& index, const int64_t* keys, size_t n, Sink&& sink) const {
    Probe(index, keys, n, sink, [](size_t, uint64_t) {});
  }

  const int64_t capacity_rows_;
  const EvictionPolicy policy_;
  const int64_t key_bound_;
  const bool direct_;
  int64_t step_ = -1;
  int32_t step32_ = -1;
  uint32_t gen_period_mask_ = (1u << 31) - 1;

  // Owned by this object; mutated only under the owner's serialization.
  HugeArray<SlotRec> slots_;
  SlotMap map_;                          // key -> slot, unless direct_ ...
  DirectIndex direct_index_;             // ... then this
  std::vector<int32_t> free_;            // stack of free slots (top = back)
  EvictionBuckets buckets_;              // eviction queues by next use (lru: one bucket)
  std::vector<QueueEntry> pinned_;       // pin events, stale ones skipped (PinnedLive)
  int64_t queued_ = 0;                   // live queue entries (queued slots)
  int64_t pushes_ = 0;                   // queue entries pushed since the last compaction
  bool purge_pending_ = false;           // a generation crossed a period: purge at call end
  MetadataStats stats_;

  // Scratch, reused by every call.
  std::vector<Victim> victims_;
  LazyQueue* gather_queue_ = nullptr;    // the bucket GatherVictims scans ...
  int32_t gather_bucket_ = 0;            // ... its key ...
  size_t gather_pos_ = 0;                // ... and the next position to look at
  KeySet seen_;                          // uniqueness of a call's keys (hash path)
  KeyBits bits_;                         // ... (direct path)
  std::vector<int32_t> found_;
  std::vector<uint64_t> hash_;
};

}  // namespace bagpipe::cache
