// EmbeddingStore::Impl, the engine behind store/embedding_store.h, shared by its files, one
// per idea: embedding_store.cc (options, construction, routing keys to hash shards, the
// small ops and the public face), embedding_store_insert.cc (grouping each op's keys and
// inserting the absent ones), embedding_store_read.cc (the read pipeline: Lookup, Contains),
// embedding_store_update.cc (Assign and the optimizer updates), embedding_store_save.cc
// (Export and Save), embedding_store_incremental.cc (change tracking's checkpoints: chained
// increments) and embedding_store_load.cc (Load, through the public API).
//
// Thread safety: as EmbeddingStore (embedding_store.h): every batch op holds mu_ for its whole
// run and fans out over the store's thread pool, one task per range of hash shards (or of
// keys, for reads); a task touches only its own shards' Shard scratch and map.
//
// Invariants (besides those of embedding_store.h):
//   1. Slots are global to the store: slot s lives on page index_.Page(s), row
//      index_.RowIn(s, page); page_addr_ and pages_ cover every slot below next_slot_.
//   2. A key in a map with KeyMap::kPendingSlot was inserted by the running op (Materialize)
//      and gets its slot before the op returns (Publish), or leaves the map again on failure.
//   3. Every op that may move map entries bumps mutations_ (an export in progress then fails).
//   4. Change tracking: dirty_[page][row] is 1 for exactly the slots stored or changed since
//      the last committed Checkpoint (MarkDirty in Publish, Assign and the updates; cleared
//      by Erase and by a Checkpoint's commit); Shard::dirty counts those of the shard's keys.
//      Shard::deleted lists keys erased since then, while chain_.open only. While chain_.open,
//      Shard::dirty_list holds (key, slot) for every slot of the shard's keys that turned
//      dirty since then (and stale entries: a key since erased or moved), unless
//      Shard::dirty_list_lost (an append failed: the next increment scans the shard's map).
//   5. Snapshot (copy-on-write, embedding_store_snapshot.cc): while a PendingCheckpoint is
//      alive, snap_mark_[slot] for every slot below its size is 0 (not in the snapshot, or
//      already written), 1 (in it, and the live row still holds the snapshot's bytes) or
//      k + 2 (its snapshot bytes are entry k of the Shard::aside of the shard whose key held
//      it at Begin). Every op calls Preserve before it writes or frees a slot, so a slot
//      marked 1 is never changed; snap_mark_ is empty when no snapshot is open.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <vector>

#include "common/os_memory.h"
#include "common/thread_pool.h"
#include "store/embedding_store.h"
#include "store/key_map.h"
#include "store/manifest.h"
#include "store/optimizer_kernels.h"
#include "store/page_arena.h"
#include "store/spill.h"

namespace bagpipe::store {

class CheckpointWriter;

class EmbeddingStore::Impl {
 public:
  // ---- layout and tuning -----------------------------------------------------------------
  static constexpr size_t kRowAlign = 64;  // rows start on cache lines
  static constexpr size_t kTargetPageBytes = size_t{2} << 20;
  static constexpr size_t kPrefetchDistance = 16;  // keys between probe and prefetch (writes)
  static constexpr int kPoolSpinMicros = 100;  // back-to-back ops skip futex wake-ups
  static constexpr size_t kReadGroup = 16;  // keys per stage of the read pipeline
  static constexpr size_t kMinKeysPerTask = 512;  // read tasks stay long enough to pipeline
  static constexpr size_t kTasksPerThread = 4;  // dynamic claiming balances uneven threads
  static constexpr size_t kMaxKeysPerCall = 0xFFFFFFFFu;  // batch indices are uint32

  // Bytes between weight rows: dim floats rounded up to a cache line.
  static size_t RowStride(int dim) {
    return RoundUp(static_cast<size_t>(dim) * sizeof(float), kRowAlign);
  }
  // Bytes between the optimizer states of consecutive rows in a page's state block: a state
  // of at most half a cache line is packed at a power-of-two stride (never straddling a line),
  // a larger one starts on a cache line like the weight rows.
  static size_t StateStride(int state_dim) {
    const size_t bytes = static_cast<size_t>(state_dim) * sizeof(float);
    if (bytes == 0) return 0;
    if (bytes > kRowAlign / 2) return RoundUp(bytes, kRowAlign);
    size_t p = sizeof(float);
    while (p < bytes) p *= 2;
    return p;
  }
  // The width of the row-sum tree (optimizer_kernels.h): the smallest power of two >= dim.
  static int PaddedDim(int dim) {
    int p = 1;
    while (p < dim) p *= 2;
    return p;
  }
  static bool IsPowerOfTwo(uint64_t v) { return v != 0 && (v & (v - 1)) == 0; }
  // floor(log2(v)). REQUIRES: v > 0.
  static int Log2(uint64_t v) { return 63 - __builtin_clzll(v); }
  // Arena bytes of one row: its weights and its state, with padding.
  static size_t SlotBytes(int dim, int state_dim) {
    return RowStride(dim) + StateStride(state_dim);
  }
  // The options with every field checked (ValueError naming it) and the automatic values
  // resolved: page_rows 0 (about 2 MiB of rows per page), memory_budget -1 (half the memory).
  static StoreOptions Resolve(StoreOptions o);

  // One hash shard: its key map and the per-op scratch of the thread that runs it.
  // Owner: the thread that runs the shard's task of the current batch op.
  struct Shard {
    // An empty key map for a store of 2^shard_bits hash shards.
    explicit Shard(int shard_bits) : map(shard_bits) {}

    KeyMap map;

    // The shard's routed items of the current op (order_[begin, end), input order) are
    // deduplicated into groups, one per distinct key, in first-occurrence order.
    struct Group {
      int64_t key;
      uint64_t hash;
      uint32_t slot;   // set by Materialize
      uint32_t count;  // occurrences of the key in the op
      uint32_t first;  // item (shard-local index) of the first occurrence
      uint32_t last;   // item of the last occurrence
    };
    static constexpr uint32_t kNoItem = 0xFFFFFFFFu;
    std::vector<Group> groups;
    std::vector<uint32_t> item_group;  // shard-local item -> group
    std::vector<uint32_t> next_item;   // item -> next occurrence of its key (kNoItem: none)
    std::vector<uint32_t> dedupe;      // open-addressing table of group ids
    std::vector<uint32_t> deferred;    // groups whose key lies past its home bucket
    // Groups whose key this op inserted (with KeyMap::kPendingSlot), and where.
    struct Fresh {
      uint32_t group;
      size_t bucket;    // valid while the map keeps `capacity`
      size_t capacity;
    };
    std::vector<Fresh> fresh;

    std::vector<float> acc;                       // ApplyGradients: one group's gradient sum
    std::vector<float> scratch;                   // ApplyGradients: the row kernels' scratch
    std::vector<uint32_t> freed;                  // slots the current Erase released
    uint64_t dirty = 0;                           // dirty slots of this shard's keys
    std::vector<int64_t> deleted;                 // keys erased since the last Checkpoint
    // Snapshot rows copied aside (invariant 5): dim + state_dim floats each. Written by
    // the shard's task (Preserve), read and freed by the snapshot writer under mu_.
    std::vector<float> aside;
    // The slots that turned dirty while a chain is open, for the next increment (inv. 4).
    struct DirtyEntry {
      int64_t key;
      uint32_t slot;
    };
    std::vector<DirtyEntry> dirty_list;
    bool dirty_list_lost = false;
  };
  using Snapshot = PendingCheckpoint::State;

  // The chain this store's last committed Checkpoint (or a whole-chain Load) left in dir.
  struct ChainState {
    bool open = false;
    std::string dir;
    uint64_t id = 0;
    uint64_t digest = 0;       // ManifestDigest(dir) right after that commit
    uint32_t increments = 0;
    int64_t step = -1;         // the last link's step
    uint64_t base_bytes = 0;
    uint64_t chain_bytes = 0;  // data bytes of the increments
  };

  // REQUIRES: options valid (Resolve throws ValueError naming the field otherwise).
  explicit Impl(const StoreOptions& options);

  // The resolved options, and the optimizer state floats per row.
  const StoreOptions& options() const { return opt_; }
  int state_dim() const { return state_dim_; }

  // EmbeddingStore's operations (their contracts: embedding_store.h), each under mu_.
  // RequireSgd throws ValueError naming `optimizer` and `method` unless the store runs SGD.
  void Lookup(const int64_t* keys, size_t n, float* out, float* state_out, bool insert_missing);
  void Assign(const int64_t* keys, size_t n, const float* rows, const float* state);
  void ApplyGradients(const int64_t* keys, size_t n, const float* grads, float lr, int divisor);
  void ApplyGradientsSegments(const GradSegment* segs, size_t count, float lr, int divisor);
  void RequireSgd(const char* method) const;
  void Contains(const int64_t* keys, size_t n, uint8_t* present);
  size_t Erase(const int64_t* keys, size_t n);
  void Reserve(size_t total_rows);
  size_t Size();
  size_t Export(int64_t* cursor, size_t max_rows, int64_t* keys, float* rows, float* state);
  StoreStats Stats();
  void Save(const std::string& dir, const std::map<std::string, std::string>& meta,
            bool weights_only);
  CheckpointResult Checkpoint(const std::string& dir, int64_t step,
                              const std::map<std::string, std::string>& meta,
                              const ChainPolicy& policy);
  // The two halves of Checkpoint (embedding_store_incremental.cc, _snapshot.cc): Begin
  // under mu_; WriteSnapshot takes mu_ only to copy a chunk of rows at a time and to
  // finish; CloseSnapshot (under mu_) drops an unwritten or failed one.
  std::unique_ptr<Snapshot> BeginCheckpoint(const std::string& dir, int64_t step,
                                            const std::map<std::string, std::string>& meta,
                                            const ChainPolicy& policy);
  CheckpointResult WriteSnapshot(Snapshot& snap);
  void AbandonSnapshot() {
    std::lock_guard<std::mutex> lock(mu_);
    CloseSnapshot(/*committed=*/false);
  }
  // After a Load of the whole chain in dir (manifest m, MANIFEST checksum digest): nothing
  // is dirty, and the next Checkpoint into dir may extend that chain.
  void AdoptChain(const std::string& dir, const Manifest& m, uint64_t digest);
  void SetSpillCallback(SpillCallback cb) {
    std::lock_guard<std::mutex> lock(mu_);
    spill_.set_callback(std::move(cb));
  }

 private:
  uint32_t ShardOf(uint64_t hash) const {
    return static_cast<uint32_t>(((hash >> 32) * num_shards_) >> 32);
  }
  char* Row(uint32_t slot) const {
    const uint32_t page = index_.Page(slot);
    return page_addr_[page] + static_cast<size_t>(index_.RowIn(slot, page)) * stride_;
  }
  // The optimizer state of a slot (REQUIRES: state_dim_ > 0).
  char* State(uint32_t slot) const {
    const uint32_t page = index_.Page(slot);
    return page_addr_[page] + state_offset_ +
           static_cast<size_t>(index_.RowIn(slot, page)) * state_stride_;
  }
  void FillInitialState(float* state) const {
    std::fill(state, state + state_dim_, initial_state_);
  }
  void Touch(uint32_t slot, uint32_t epoch) const { pages_[index_.Page(slot)]->Touch(epoch); }
  // Change tracking (invariant 4). REQUIRES: slot's page exists; sh is the shard whose key
  // holds the slot (its task runs this).
  void MarkDirty(Shard& sh, uint32_t slot, int64_t key) {
    const uint32_t page = index_.Page(slot);
    uint8_t& d = dirty_[page][index_.RowIn(slot, page)];
    if (d == 0) {
      d = 1;
      ++sh.dirty;
      if (chain_.open && !sh.dirty_list_lost) {
        try {
          sh.dirty_list.push_back(Shard::DirtyEntry{key, slot});
        } catch (const std::bad_alloc&) {
          sh.dirty_list_lost = true;  // invariant 4: the next increment scans this shard
        }
      }
    }
  }
  void ClearDirty(Shard& sh, uint32_t slot) {
    const uint32_t page = index_.Page(slot);
    uint8_t& d = dirty_[page][index_.RowIn(slot, page)];
    if (d != 0) {
      d = 0;
      --sh.dirty;
    }
  }
  // Copy-on-write (invariant 5). REQUIRES: as MarkDirty; called before slot is written or
  // freed by the running op.
  void Preserve(Shard& sh, uint32_t slot) {
    if (slot < snap_mark_.size() && snap_mark_[slot] == 1) CopyAside(sh, slot);
  }
  void CopyAside(Shard& sh, uint32_t slot);
  bool IsDirty(uint32_t slot) const {
    const uint32_t page = index_.Page(slot);
    return dirty_[page][index_.RowIn(slot, page)] != 0;
  }
  // Nothing dirty, no deletions (a commit of every change).
  void ClearTracking();
  // The directory's canonical path when it exists (so "d", "d/" and "./d" are one chain).
  static std::string CanonicalDir(const std::string& dir);
  // The manifest fields that describe this store (format head, layout, optimizer).
  Manifest ManifestHead(bool weights_only) const;
  // Save's segments: one per hash shard, in shard order, files "keys-SSSS.bin" etc., every
  // stored row, with its state when with_state.
  std::vector<SegmentEntry> WriteSegments(CheckpointWriter& writer, bool with_state);
  // The snapshot's write (embedding_store_snapshot.cc): segments of snap.groups ranges of
  // hash shards, one file set per group, groups claimed by up to num_threads threads.
  std::vector<SegmentEntry> WriteSnapshotSegments(Snapshot& snap, const std::string& prefix);
  void WriteSnapshotGroup(Snapshot& snap, size_t g, const std::string& prefix,
                          SegmentEntry& seg);
  // Drops the open snapshot (if any). Not committed: an increment's rows and deletions
  // are tracked again (the next Checkpoint extends the parent chain with them), a base's
  // failure makes the next Checkpoint a full base.
  void CloseSnapshot(bool committed);
  // Room in each shard's aside for every row the running op routed to it, so Preserve
  // never allocates (invariant 3). REQUIRES: after Route, before the op writes a row.
  void ReserveAside();
  void CheckKeys(const int64_t* keys, size_t n) const;
  void Route(const int64_t* keys, size_t n);
  void RunShards(const std::function<void(Shard&, uint32_t begin, uint32_t end)>& fn);
  void GroupShard(Shard& sh, const int64_t* keys, uint32_t begin, uint32_t end);
  void Materialize(const int64_t* keys);
  // Materialize's steps: one shard's probe and insertion, the new keys' slots and pages (all
  // shards; false: no new key), and the roll-back of a failure.
  void FindOrInsertGroups(Shard& sh);
  bool GiveFreshSlots(size_t free_before);
  void ForgetFreshKeys(uint32_t next_before);
  void Publish(Shard& sh, bool init_rows, bool init_state, uint32_t epoch);
  template <bool kTrack, size_t kRowBytes, bool kState>
  void ReadGroups(const int64_t* keys, size_t begin, size_t end, float* out, float* state_out,
                  bool record_misses, std::vector<uint32_t>* misses);
  template <bool kTrack, bool kState>
  void ReadAny(const int64_t* keys, size_t begin, size_t end, float* out, float* state_out,
               bool record_misses, std::vector<uint32_t>* misses);
  // Gradient row i is grads + i * dim, or grad_rows[i] when grad_rows is not null.
  void ApplyLocked(const int64_t* keys, size_t n, const float* grads,
                   const float* const* grad_rows, float lr, int divisor);
  template <int kDim, bool kRowTable, OptimizerKind kKind>
  void UpdateShard(Shard& sh, uint32_t begin, const float* grads, const float* const* grad_rows,
                   const StepArgs& args);
  void Finish() { spill_.AfterOp(epoch_); }

  const StoreOptions opt_;
  const int dim_;
  const size_t row_bytes_;
  const size_t stride_;        // bytes between weight rows
  const int state_dim_;        // optimizer state floats per row
  const size_t state_bytes_;
  const size_t state_stride_;  // bytes between states in a page's state block (0: none)
  const size_t state_offset_;  // the state block's offset in a page
  const float initial_state_;  // every float of a fresh row's state
  const PageIndex index_;      // slot -> page, row in the page
  const uint32_t num_shards_;

  std::mutex mu_;  // serializes batch ops; guards every field below
  std::vector<std::unique_ptr<Shard>> shards_;
  std::vector<KeyMap::View> views_;  // map snapshots for read loops, refreshed per read op
  // Slots are global to the store: slot -> page index_.Page(slot), row index_.RowIn(...).
  std::vector<char*> page_addr_;             // page -> first row address
  std::vector<PageArena::Page*> pages_;      // page -> arena page (for Touch)
  std::vector<std::unique_ptr<uint8_t[]>> dirty_;  // page -> a dirty byte per row (inv. 4)
  ChainState chain_;
  Snapshot* snap_ = nullptr;                 // the open snapshot (invariant 5), if any
  std::vector<uint32_t> snap_mark_;          // slot -> snapshot mark (invariant 5)
  uint32_t next_slot_ = 0;                   // slots [0, next_slot_) have been handed out
  std::vector<uint32_t> free_slots_;         // erased slots, reused last-in first-out
  PageArena arena_;
  SpillTier spill_;
  ThreadPool pool_;
  uint32_t epoch_ = 0;            // bumped by every op; pages Touch() it
  uint64_t mutations_ = 0;        // bumped by every op that may move map entries
  uint64_t export_mutations_ = 0; // mutations_ when the current export started
  int64_t lookups_ = 0;
  int64_t updates_ = 0;

  // Per-op scratch, reused so hot paths do not allocate.
  std::vector<uint64_t> hashes_;               // KeyHash of each routed key
  std::vector<uint32_t> order_;                // routed key indices grouped by shard
  std::vector<uint32_t> shard_begin_;          // shard s owns order_[begin[s], begin[s+1])
  std::vector<std::vector<uint32_t>> task_misses_;
  std::vector<int64_t> miss_keys_;
  std::vector<uint32_t> miss_rows_;
  std::vector<uint32_t> route_pos_;
  std::vector<uint16_t> route_shard_;          // shard of each routed key (< 4096)
  std::vector<int64_t> segment_keys_;          // ApplyGradientsSegments: the segments' keys
  std::vector<const float*> segment_rows_;     // ApplyGradientsSegments: each key's gradient
};

// A chained checkpoint between BeginCheckpoint and its write: what to write, decided and
// captured under mu_. Owner: the PendingCheckpoint holding it (one thread at a time).
struct EmbeddingStore::PendingCheckpoint::State {
  Impl* impl = nullptr;
  std::unique_ptr<CheckpointWriter> writer;  // created (dir validated) at Begin
  std::string dir;
  int64_t step = -1;
  std::map<std::string, std::string> meta;
  bool incremental = false;
  Manifest head;                  // increments: the chain's manifest being extended
  std::vector<int64_t> deleted;   // increments: keys erased since the parent, sorted
  uint64_t total_rows = 0;        // rows stored at Begin
  uint64_t chain_id = 0;          // the chain this link belongs to
  Impl::ChainState parent;        // the store's chain before Begin (restored on failure)
  uint32_t index = 0;             // increments: this link's index (1 = the first)
  size_t groups = 1;              // segments, each a contiguous range of hash shards
  // Per hash shard: the keys to write and the slots they held at Begin (a base: in map
  // order; an increment: in the order they turned dirty).
  std::vector<std::vector<int64_t>> keys;
  std::vector<std::vector<uint32_t>> slots;
};

}  // namespace bagpipe::store
