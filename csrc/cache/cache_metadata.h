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
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "cache/flat_map.h"

namespace bagpipe::cache {

inline constexpr int64_t kRowsPerUnit = 64;
inline constexpr int64_t kNever = INT64_MAX;  // next use: absent from the known window

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

struct MetadataStats {
  int64_t capacity_rows = 0;
  int64_t resident = 0;
  int64_t pinned = 0;
  int64_t admitted = 0;   // cumulative placements by Admit
  int64_t bypassed = 0;   // candidates that got no slot
  int64_t evictions = 0;
  int64_t invalidations = 0;
  int64_t stale = 0;
  int64_t memory_bytes = 0;  // slot table + key map
};

class CacheMetadata {
 public:
  // REQUIRES: capacity_units >= 1 (ValueError otherwise).
  CacheMetadata(int64_t capacity_units, EvictionPolicy policy);

  int64_t capacity_rows() const { return capacity_rows_; }
  EvictionPolicy policy() const { return policy_; }
  int64_t current_step() const { return step_; }
  int64_t size() const { return static_cast<int64_t>(map_.size()); }

  // Moves to `step`: pins with pin_step < step expire and finite next uses <= step become
  // kNever.  REQUIRES: step >= current_step().
  void Advance(int64_t step);

  // Classifies n unique keys.  A slot whose version differs from versions[i] is stale: it is
  // freed and the key reported as a miss.  Hits are touched: their next use becomes
  // next_uses[i] (< 0 means kNever) and they become most recent.
  // REQUIRES: keys unique and >= 0 (ValueError otherwise).
  QueryResult Query(const int64_t* keys, const int64_t* versions, const int64_t* next_uses,
                    size_t n);

  // Gives ready slots, pinned through the current step, to keys in input order, evicting per
  // policy; candidates that find no slot are bypassed (not in the result).
  // REQUIRES: keys unique, >= 0 and not resident (ValueError otherwise).
  PlaceResult Admit(const int64_t* keys, const int64_t* versions, const int64_t* next_uses,
                    size_t n);

  // For each key: its slot, or -1.
  void Lookup(const int64_t* keys, size_t n, int64_t* out_slots) const;

  // For each key: its slot if resident at versions[i], else -1 (no touch, no state change).
  void Resident(const int64_t* keys, const int64_t* versions, size_t n,
                int64_t* out_slots) const;

  // Sets the version of resident slots (after a local SGD update).  REQUIRES: each resident.
  void SetVersion(const int64_t* slots, size_t n, int64_t version);

  // Extends the pin of resident slots through `pin_step`.  REQUIRES: each resident.
  void Pin(const int64_t* slots, size_t n, int64_t pin_step);

  // Oracle bookkeeping when a step enters the window: a resident key whose next use is later
  // than `step` (or kNever) gets next use `step`.  No-op under lru.
  void NoteUses(const int64_t* keys, size_t n, int64_t step);

  // Frees the slots of the given keys; returns them (absent keys are ignored).
  std::vector<int64_t> Invalidate(const int64_t* keys, size_t n);

  // Frees every slot.
  void Clear();

  MetadataStats Stats() const;

  struct SlotView {
    int64_t key;
    SlotState state;
    int64_t version;
    int64_t next_use;
    int64_t pin_step;
  };
  SlotView Slot(int64_t slot) const;

  // Unpinned resident slots in victim order (first = next victim).  For tests and debugging.
  std::vector<int64_t> VictimOrder() const;

 private:
  struct SlotRec {
    int64_t key = kEmptyKey;
    int64_t version = -1;
    int64_t next_use = kNever;
    int64_t pin_step = -1;  // pinned while pin_step >= step_
    int64_t bucket = 0;     // key of the eviction bucket while queued
    uint64_t pin_seq = 0;   // matches the live entry of pinned_
    int32_t prev = -1;
    int32_t next = -1;
    SlotState state = SlotState::kFree;
    bool queued = false;    // in an eviction bucket (resident and unpinned)
    bool pinned = false;
  };
  struct List {
    int32_t head = -1;
    int32_t tail = -1;
  };

  bool IsPinned(const SlotRec& s) const { return s.pinned && s.pin_step >= step_; }
  int64_t BucketOf(int64_t next_use) const;
  void Enqueue(int32_t slot);
  void Dequeue(int32_t slot);
  void PinSlot(int32_t slot, int64_t pin_step);
  void FreeSlot(int32_t slot);
  // Victim slot for a candidate with `next_use`, or -1 (bypass).
  int32_t PickSlot(int64_t next_use);
  void Place(int32_t slot, int64_t key, int64_t version, int64_t next_use, int64_t pin_step,
             SlotState state);
  void CheckUniqueKeys(const int64_t* keys, size_t n, const char* what);

  const int64_t capacity_rows_;
  const EvictionPolicy policy_;
  int64_t step_ = -1;

  // Owned by this object; mutated only under the owner's serialization.
  std::vector<SlotRec> slots_;
  FlatMap<int32_t> map_;               // key -> slot
  std::vector<int32_t> free_;          // stack of free slots (top = back)
  std::map<int64_t, List> buckets_;    // eviction queues by next use (lru: one bucket)
  std::vector<std::pair<int32_t, uint64_t>> pinned_;  // (slot, pin_seq), lazily pruned
  uint64_t pin_seq_ = 0;
  StampedMap<uint8_t> seen_;           // scratch for uniqueness checks
  MetadataStats stats_;
};

}  // namespace bagpipe::cache
