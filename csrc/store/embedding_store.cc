#include "store/embedding_store.h"

#include <algorithm>
#include <cstdio>
#include <cmath>
#include <cstring>
#include <mutex>
#include <optional>
#include <type_traits>
#include <vector>

#include "common/errors.h"
#include "common/thread_pool.h"
#include "store/checkpoint.h"
#include "store/splitmix64.h"
#include "store/key_map.h"
#include "common/os_memory.h"
#include "store/optimizer_kernels.h"
#include "store/page_arena.h"

namespace bagpipe::store {

namespace {

constexpr size_t kRowAlign = 64;                 // rows start on cache lines
constexpr size_t kTargetPageBytes = size_t{2} << 20;
constexpr size_t kPrefetchDistance = 16;        // keys between probe and prefetch (writes)
constexpr int kPoolSpinMicros = 100;             // back-to-back ops skip futex wake-ups
constexpr size_t kReadGroup = 16;                // keys per stage of the read pipeline
constexpr size_t kMinKeysPerTask = 512;          // read tasks stay long enough to pipeline
constexpr size_t kTasksPerThread = 4;            // dynamic claiming balances uneven threads
constexpr size_t kMaxKeysPerCall = 0xFFFFFFFFu;  // batch indices are uint32

size_t RowStride(int dim) { return RoundUp(static_cast<size_t>(dim) * sizeof(float), kRowAlign); }

// Bytes between the optimizer states of consecutive rows in a page's state block: a state
// of at most half a cache line is packed at a power-of-two stride (never straddling a line),
// a larger one starts on a cache line like the weight rows.
size_t StateStride(int state_dim) {
  const size_t bytes = static_cast<size_t>(state_dim) * sizeof(float);
  if (bytes == 0) return 0;
  if (bytes > kRowAlign / 2) return RoundUp(bytes, kRowAlign);
  size_t p = sizeof(float);
  while (p < bytes) p *= 2;
  return p;
}

// The width of the row-sum tree (optimizer_kernels.h): the smallest power of two >= dim.
int PaddedDim(int dim) {
  int p = 1;
  while (p < dim) p *= 2;
  return p;
}

bool IsPowerOfTwo(uint64_t v) { return v != 0 && (v & (v - 1)) == 0; }

int Log2(uint64_t v) { return 63 - __builtin_clzll(v); }

size_t SlotBytes(int dim, int state_dim) { return RowStride(dim) + StateStride(state_dim); }

StoreOptions Resolve(StoreOptions o) {
  if (o.dim <= 0 || o.dim > (1 << 20)) {
    throw ValueError("dim must be in [1, 1048576], got " + std::to_string(o.dim));
  }
  if (o.num_shards < 1 || o.num_shards > 4096 || !IsPowerOfTwo(o.num_shards)) {
    throw ValueError("num_shards must be a power of two in [1, 4096], got " +
                     std::to_string(o.num_shards));
  }
  if (o.num_threads < 1 || o.num_threads > 1024) {
    throw ValueError("num_threads must be in [1, 1024], got " + std::to_string(o.num_threads));
  }
  if (o.page_rows > (1u << 24)) {
    throw ValueError("page_rows must be in [1, 16777216] (0: automatic), got " +
                     std::to_string(o.page_rows));
  }
  if (o.memory_budget < -1) {
    throw ValueError("memory_budget must be >= 0 bytes, or -1 for automatic");
  }
  if (!(o.low_watermark > 0.0 && o.low_watermark <= o.high_watermark &&
        o.high_watermark <= 1.0)) {
    throw ValueError("watermarks must satisfy 0 < low_watermark <= high_watermark <= 1, got " +
                     std::to_string(o.low_watermark) + " and " +
                     std::to_string(o.high_watermark));
  }
  ValidateInitSpec(o.init);
  ValidateOptimizerSpec(o.optimizer);
  if (o.page_rows == 0) {
    const int state_dim = StateDim(o.optimizer.kind, o.dim);
    if (state_dim == 0) {
      // About 2 MiB of rows, a power of two (one huge page when the stride is one too).
      const size_t rows = std::max<size_t>(1, kTargetPageBytes / RowStride(o.dim));
      o.page_rows = uint32_t{1} << Log2(rows);
    } else {
      // As many rows as fit, weights and state, in 2 MiB: one huge page holds both (a
      // power of two would leave the state block of a row-wise store on 4 KiB pages).
      const size_t rows = kTargetPageBytes / SlotBytes(o.dim, state_dim);
      o.page_rows = static_cast<uint32_t>(std::max<size_t>(1, rows));
    }
  }
  if (o.memory_budget == -1) o.memory_budget = static_cast<int64_t>(DetectMemoryLimit() / 2);
  return o;
}

// One hash shard: its key map and the per-op scratch of the thread that runs it.
// Owner: the thread that runs the shard's task of the current batch op.
struct Shard {
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
};

}  // namespace

class EmbeddingStore::Impl {
 public:
  explicit Impl(const StoreOptions& options)
      : opt_(Resolve(options)),
        dim_(opt_.dim),
        row_bytes_(static_cast<size_t>(opt_.dim) * sizeof(float)),
        stride_(RowStride(opt_.dim)),
        state_dim_(StateDim(opt_.optimizer.kind, opt_.dim)),
        state_bytes_(static_cast<size_t>(state_dim_) * sizeof(float)),
        state_stride_(StateStride(state_dim_)),
        state_offset_(stride_ * opt_.page_rows),
        initial_state_(ConstantsOf(opt_.optimizer).initial_state),
        index_(opt_.page_rows),
        num_shards_(static_cast<uint32_t>(opt_.num_shards)),
        arena_(stride_ + state_stride_, opt_.page_rows),
        spill_(&arena_, SpillTier::Options{opt_.memory_budget, opt_.spill_dir,
                                           opt_.high_watermark, opt_.low_watermark}),
        pool_(opt_.num_threads, kPoolSpinMicros) {
    const int shard_bits = Log2(num_shards_);
    for (uint32_t s = 0; s < num_shards_; ++s) {
      shards_.push_back(std::make_unique<Shard>(shard_bits));
    }
  }

  const StoreOptions& options() const { return opt_; }
  int state_dim() const { return state_dim_; }

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
  void FillInitialState(float* state) const { std::fill(state, state + state_dim_, initial_state_); }
  void Touch(uint32_t slot, uint32_t epoch) const { pages_[index_.Page(slot)]->Touch(epoch); }
  void CheckKeys(const int64_t* keys, size_t n) const;
  void Route(const int64_t* keys, size_t n);
  void RunShards(const std::function<void(Shard&, uint32_t begin, uint32_t end)>& fn);
  void GroupShard(Shard& sh, const int64_t* keys, uint32_t begin, uint32_t end);
  void Materialize(const int64_t* keys);
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

void EmbeddingStore::Impl::CheckKeys(const int64_t* keys, size_t n) const {
  if (n > kMaxKeysPerCall) {
    throw ValueError("keys: at most " + std::to_string(kMaxKeysPerCall) + " keys per call, got " +
                     std::to_string(n));
  }
  if (opt_.key_bound < 0) return;
  const uint64_t bound = static_cast<uint64_t>(opt_.key_bound);
  bool bad = false;
  for (size_t i = 0; i < n; ++i) bad |= static_cast<uint64_t>(keys[i]) >= bound;
  if (!bad) return;
  for (size_t i = 0; i < n; ++i) {
    if (static_cast<uint64_t>(keys[i]) >= bound) {
      throw ValueError("keys: key " + std::to_string(keys[i]) + " at index " + std::to_string(i) +
                       " is outside [0, key_bound=" + std::to_string(opt_.key_bound) + ")");
    }
  }
}

void EmbeddingStore::Impl::Route(const int64_t* keys, size_t n) {
  hashes_.resize(n);
  order_.resize(n);
  shard_begin_.assign(num_shards_ + 1, 0);
  route_shard_.resize(n);
  uint32_t* begin = shard_begin_.data();
  uint16_t* shard_of = route_shard_.data();
  for (size_t i = 0; i < n; ++i) {
    const uint64_t h = KeyHash(keys[i]);
    hashes_[i] = h;
    const uint32_t s = ShardOf(h);
    shard_of[i] = static_cast<uint16_t>(s);
    ++begin[s + 1];
  }
  for (uint32_t s = 0; s < num_shards_; ++s) begin[s + 1] += begin[s];
  // Stable counting sort: within a shard, keys keep their input order.
  std::vector<uint32_t>& pos = route_pos_;
  pos.assign(shard_begin_.begin(), shard_begin_.end() - 1);
  uint32_t* cursor = pos.data();
  uint32_t* order = order_.data();
  for (size_t i = 0; i < n; ++i) order[cursor[shard_of[i]]++] = static_cast<uint32_t>(i);
}

// About kTasksPerThread tasks per thread, each over a contiguous range of shards, claimed
// dynamically: a thread that is descheduled (shared machines) leaves its share to the others.
void EmbeddingStore::Impl::RunShards(
    const std::function<void(Shard&, uint32_t, uint32_t)>& fn) {
  const size_t threads = static_cast<size_t>(pool_.num_threads());
  const size_t tasks = threads == 1 ? 1 : std::min<size_t>(threads * kTasksPerThread, num_shards_);
  pool_.Run(tasks, [&](size_t t) {
    const size_t first = num_shards_ * t / tasks, last = num_shards_ * (t + 1) / tasks;
    for (size_t s = first; s < last; ++s) {
      const uint32_t b = shard_begin_[s], e = shard_begin_[s + 1];
      if (b != e) fn(*shards_[s], b, e);
    }
  });
}

// Deduplicates the shard's routed items into groups (first-occurrence order), links each
// item to the next occurrence of its key, and prefetches each new key's home bucket for the
// probe pass that follows.
void EmbeddingStore::Impl::GroupShard(Shard& sh, const int64_t* keys, uint32_t b, uint32_t e) {
  const uint32_t m = e - b;
  size_t table_size = 16;
  while (table_size < 2 * static_cast<size_t>(m)) table_size <<= 1;
  const uint64_t mask = table_size - 1;
  constexpr uint32_t kFree = 0xFFFFFFFFu;
  sh.dedupe.assign(table_size, kFree);
  sh.groups.clear();
  sh.groups.reserve(m);
  sh.item_group.resize(m);
  sh.next_item.resize(m);
  sh.deferred.reserve(m);
  // Size the update scratch now, while a failure can still be rolled back: nothing in the
  // write phase allocates.
  if (sh.acc.size() < static_cast<size_t>(dim_)) sh.acc.resize(dim_);
  // Room to align the kernels' scratch (UpdateShard) to kScratchAlign bytes.
  const size_t scratch = KernelScratchFloats(dim_, PaddedDim(dim_)) + kScratchAlign / sizeof(float);
  if (sh.scratch.size() < scratch) sh.scratch.resize(scratch);
  const KeyMap::View v = sh.map.view();
  uint32_t* table = sh.dedupe.data();
  uint32_t* next_item = sh.next_item.data();
  for (uint32_t k = 0; k < m; ++k) {
    const uint32_t i = order_[b + k];
    const int64_t key = keys[i];
    const uint64_t h = hashes_[i];
    next_item[k] = Shard::kNoItem;
    for (uint64_t t = h & mask;; t = (t + 1) & mask) {
      const uint32_t g = table[t];
      if (g == kFree) {
        const uint32_t ng = static_cast<uint32_t>(sh.groups.size());
        table[t] = ng;
        sh.item_group[k] = ng;
        sh.groups.push_back({key, h, KeyMap::kPendingSlot, 1, k, k});
        __builtin_prefetch(v.bucket(v.Home(h)));
        break;
      }
      Shard::Group& grp = sh.groups[g];
      if (grp.key == key) {
        ++grp.count;
        next_item[grp.last] = k;
        grp.last = k;
        sh.item_group[k] = g;
        break;
      }
    }
  }
}

// Groups every shard's routed keys and finds or inserts each distinct key: fills the
// groups' slots, gives new keys slots and secures their pages. New keys stay pending in the
// maps until Publish. On any exception the maps and allocators are as before the call.
void EmbeddingStore::Impl::Materialize(const int64_t* keys) {
  for (auto& sh : shards_) {
    sh->fresh.clear();
    sh->groups.clear();
  }
  const size_t free_before = free_slots_.size();
  const uint32_t next_before = next_slot_;
  try {
    RunShards([&](Shard& sh, uint32_t b, uint32_t e) {
      GroupShard(sh, keys, b, e);
      // Probe every group read-only (home buckets were prefetched by GroupShard; a key past
      // its home bucket is deferred behind a prefetch of the next one), start each found
      // row's miss for the write phase, then insert the absent keys in group order.
      const KeyMap::View v = sh.map.view();
      const size_t ng = sh.groups.size();
      Shard::Group* groups = sh.groups.data();
      sh.deferred.clear();
      auto found = [&](Shard::Group& grp, uint32_t slot) {
        grp.slot = slot;
        if (slot == KeyMap::kNotFound) return;
        const char* r = Row(slot);
        __builtin_prefetch(r, 1);
        if (stride_ > 64) __builtin_prefetch(r + 64, 1);
        if (state_stride_ != 0) __builtin_prefetch(State(slot), 1);
      };
      for (size_t g = 0; g < ng; ++g) {
        Shard::Group& grp = groups[g];
        const size_t home = v.Home(grp.hash);
        const KeyMap::Entry* bucket = v.bucket(home);
        const KeyMap::Match mt = KeyMap::MatchBucket(bucket, grp.key);
        if (mt.hit != 0) {
          found(grp, bucket[KeyMap::EntryOf(__builtin_ctz(mt.hit))].tag - 1);
        } else if (mt.empty != 0) {
          grp.slot = KeyMap::kNotFound;
        } else {
          sh.deferred.push_back(static_cast<uint32_t>(g));  // reserved by GroupShard
          __builtin_prefetch(v.bucket(v.Next(home)));
        }
      }
      for (const uint32_t g : sh.deferred) {
        Shard::Group& grp = groups[g];
        found(grp, v.FindFrom(v.Next(v.Home(grp.hash)), grp.key));
      }
      for (size_t g = 0; g < ng; ++g) {
        Shard::Group& grp = sh.groups[g];
        if (grp.slot != KeyMap::kNotFound) continue;
        if (sh.fresh.size() == sh.fresh.capacity()) {  // so push_back below cannot throw
          sh.fresh.reserve(std::max<size_t>(16, 2 * sh.fresh.capacity()));
        }
        // Strong guarantee on bad_alloc; the entry stays valid until the next growth.
        const size_t entry = sh.map.Insert(grp.key, grp.hash, KeyMap::kPendingSlot);
        sh.fresh.push_back({static_cast<uint32_t>(g), entry, sh.map.capacity()});
        grp.slot = KeyMap::kPendingSlot;
      }
    });
    // Slots for new keys in shard order, then first-occurrence order: deterministic.
    size_t fresh = 0;
    for (auto& sh : shards_) fresh += sh->fresh.size();
    if (fresh == 0) return;
    const size_t reused = std::min(fresh, free_before);
    if (static_cast<uint64_t>(next_slot_) + (fresh - reused) > uint64_t{KeyMap::kMaxSlot} + 1) {
      throw ValueError("keys: the store would pass its maximum of 2^32-3 rows");
    }
    size_t taken = 0;  // the free list shrinks only once everything is secured (below)
    for (auto& sh : shards_) {
      for (const auto& f : sh->fresh) {
        sh->groups[f.group].slot =
            taken < reused ? free_slots_[free_before - 1 - taken++] : next_slot_++;
      }
    }
    const size_t want = index_.PagesFor(next_slot_);
    if (want > page_addr_.size()) {
      spill_.MakeRoom(want - page_addr_.size());
      page_addr_.reserve(want);
      pages_.reserve(want);
      while (page_addr_.size() < want) {
        PageArena::Page* page = arena_.Allocate(epoch_);
        page_addr_.push_back(page->addr);
        pages_.push_back(page);
      }
    }
    free_slots_.resize(free_before - reused);
  } catch (...) {
    // Undo in reverse: pending keys leave the maps, slots return to the allocator. Pages
    // mapped already stay (empty pages are harmless and will be used).
    for (auto& sh : shards_) {
      for (auto it = sh->fresh.rbegin(); it != sh->fresh.rend(); ++it) {
        const Shard::Group& grp = sh->groups[it->group];
        sh->map.Erase(grp.key, grp.hash);
      }
      sh->fresh.clear();
    }
    next_slot_ = next_before;
    throw;
  }
  ++mutations_;
}

// Publishes the slots of this op's new keys in the map and writes their initial rows (when
// `init_rows`) and initial optimizer state (when `init_state`). Cannot fail: the pages were
// secured by Materialize.
void EmbeddingStore::Impl::Publish(Shard& sh, bool init_rows, bool init_state, uint32_t epoch) {
  const bool track = spill_.tracking();
  init_state = init_state && state_dim_ > 0;
  for (const auto& f : sh.fresh) {
    const Shard::Group& grp = sh.groups[f.group];
    if (sh.map.capacity() == f.capacity) {
      sh.map.SetSlotAt(f.bucket, grp.slot);
    } else {
      sh.map.SetSlot(grp.key, grp.hash, grp.slot);
    }
    if (init_rows) {
      InitRow(opt_.init, dim_, grp.key, grp.hash, reinterpret_cast<float*>(Row(grp.slot)));
    }
    if (init_state) FillInitialState(reinterpret_cast<float*>(State(grp.slot)));
    if (track) Touch(grp.slot, epoch);
  }
}

namespace {
// Fixed-size row copies compile to a few vector moves; other sizes call memcpy.
template <size_t kBytes>
inline void CopyRow(float* dst, const char* src, size_t bytes) {
  if constexpr (kBytes == 0) {
    std::memcpy(dst, src, bytes);
  } else {
    std::memcpy(dst, src, kBytes);
  }
}
}  // namespace

// Reads keys[begin, end) through a four-stage software pipeline over groups of kReadGroup
// keys. Iteration g runs: (A) group g+2: hash, shard and home bucket, prefetch the bucket
// line; (B) group g+1: match each key in its home bucket -- a hit prefetches the row, an
// empty entry means absent, a full bucket without the key (about 9% of keys at load 0.7)
// defers the key and prefetches the next bucket; (C) group g: finish the deferred keys and
// prefetch their rows; (D) group g-1: copy the rows out. Every line a stage touches was
// prefetched at least one stage earlier, so the misses of a few dozen keys overlap. kState:
// the rows' optimizer state goes to state_out alongside (prefetched with the row).
template <bool kTrack, size_t kRowBytes, bool kState>
void EmbeddingStore::Impl::ReadGroups(const int64_t* keys, size_t begin, size_t end, float* out,
                                      float* state_out, bool record_misses,
                                      std::vector<uint32_t>* misses) {
  constexpr size_t G = kReadGroup;
  struct Stage {
    const KeyMap::View* view[G];    // the key's shard
    const KeyMap::Entry* bucket[G]; // home bucket (A), then the next one for deferred keys (B)
    const char* row[G];             // nullptr: absent
    const char* state[G];           // kState: the row's optimizer state
    uint8_t deferred[G];            // indices in the group of keys B could not resolve
    uint32_t num_deferred;
  };
  Stage stages[4];
  const KeyMap::View* views = views_.data();
  char* const* page_addr = page_addr_.data();
  const PageIndex index = index_;
  constexpr size_t kStride = RoundUp(kRowBytes, kRowAlign);
  const size_t stride = kRowBytes > 0 ? kStride : stride_;
  const size_t row_bytes = row_bytes_;
  const size_t dim = static_cast<size_t>(dim_);
  const uint64_t num_shards = num_shards_;
  const uint32_t epoch = epoch_;
  const size_t lines = std::min<size_t>(stride / 64, 4);
  const size_t n = end - begin;
  const size_t groups = (n + G - 1) / G;
  const size_t state_dim = static_cast<size_t>(state_dim_);
  keys += begin;
  out += begin * dim;
  if constexpr (kState) state_out += begin * state_dim;
  auto locate = [&](Stage& st, size_t j, uint32_t slot) {
    const uint32_t page = index.Page(slot);
    const char* r = page_addr[page] + static_cast<size_t>(index.RowIn(slot, page)) * stride;
    __builtin_prefetch(r);
    if (kStride > 64 || (kRowBytes == 0 && lines > 1)) {
      for (size_t l = 1; l < lines; ++l) __builtin_prefetch(r + 64 * l);
    }
    st.row[j] = r;
    if constexpr (kState) {
      const char* sp = State(slot);
      __builtin_prefetch(sp);
      st.state[j] = sp;
    }
    if constexpr (kTrack) pages_[page]->Touch(epoch);
  };
  auto hash_stage = [&](size_t g) {
    if (g >= groups) return;
    Stage& st = stages[g & 3];
    const int64_t* k = keys + g * G;
    const size_t m = std::min(G, n - g * G);
    for (size_t j = 0; j < m; ++j) {
      const uint64_t x = KeyHash(k[j]);
      const KeyMap::View* v = views + (((x >> 32) * num_shards) >> 32);
      const KeyMap::Entry* e = v->bucket(v->Home(x));
      st.view[j] = v;
      st.bucket[j] = e;
      __builtin_prefetch(e);
    }
  };
  auto match_stage = [&](size_t g) {
    if (g >= groups) return;
    Stage& st = stages[g & 3];
    const int64_t* k = keys + g * G;
    const size_t m = std::min(G, n - g * G);
    uint32_t deferred = 0;
    for (size_t j = 0; j < m; ++j) {
      const KeyMap::Entry* e = st.bucket[j];
      const KeyMap::Match mt = KeyMap::MatchBucket(e, k[j]);
      if (mt.hit != 0) {
        locate(st, j, e[KeyMap::EntryOf(__builtin_ctz(mt.hit))].tag - 1);
      } else if (mt.empty != 0) {
        st.row[j] = nullptr;
      } else {
        const KeyMap::View* v = st.view[j];
        const KeyMap::Entry* next = v->bucket(v->Next(v->BucketOf(e)));
        st.bucket[j] = next;
        st.deferred[deferred++] = static_cast<uint8_t>(j);
        __builtin_prefetch(next);
      }
    }
    st.num_deferred = deferred;
  };
  auto finish_stage = [&](size_t g) {
    if (g >= groups) return;
    Stage& st = stages[g & 3];
    const int64_t* k = keys + g * G;
    for (uint32_t q = 0; q < st.num_deferred; ++q) {
      const size_t j = st.deferred[q];
      const KeyMap::View* v = st.view[j];
      const uint32_t slot = v->FindFrom(v->BucketOf(st.bucket[j]), k[j]);
      if (slot != KeyMap::kNotFound) {
        locate(st, j, slot);
      } else {
        st.row[j] = nullptr;
      }
    }
  };
  auto copy_stage = [&](size_t g) {
    const Stage& st = stages[g & 3];
    const size_t m = std::min(G, n - g * G);
    for (size_t j = 0; j < m; ++j) {
      const size_t i = g * G + j;
      float* dst = out + i * dim;
      if (st.row[j] != nullptr) {
        CopyRow<kRowBytes>(dst, st.row[j], row_bytes);
        if constexpr (kState) std::memcpy(state_out + i * state_dim, st.state[j], state_bytes_);
      } else if (record_misses) {
        misses->push_back(static_cast<uint32_t>(begin + i));
      } else {
        InitRow(opt_.init, dim_, keys[i], KeyHash(keys[i]), dst);
        if constexpr (kState) FillInitialState(state_out + i * state_dim);
      }
    }
  };
  hash_stage(0);
  hash_stage(1);
  match_stage(0);
  for (size_t g = 0; g <= groups; ++g) {
    hash_stage(g + 2);
    match_stage(g + 1);
    finish_stage(g);
    if (g > 0) copy_stage(g - 1);
  }
}

template <bool kTrack, bool kState>
void EmbeddingStore::Impl::ReadAny(const int64_t* keys, size_t begin, size_t end, float* out,
                                   float* state_out, bool record_misses,
                                   std::vector<uint32_t>* misses) {
  auto read = [&](auto row_bytes) {
    ReadGroups<kTrack, decltype(row_bytes)::value, kState>(keys, begin, end, out, state_out,
                                                          record_misses, misses);
  };
  switch (row_bytes_) {
    case 64: return read(std::integral_constant<size_t, 64>{});
    case 128: return read(std::integral_constant<size_t, 128>{});
    case 256: return read(std::integral_constant<size_t, 256>{});
    case 512: return read(std::integral_constant<size_t, 512>{});
    default: return read(std::integral_constant<size_t, 0>{});
  }
}

void EmbeddingStore::Impl::Lookup(const int64_t* keys, size_t n, float* out, float* state_out,
                                  bool insert_missing) {
  if (state_dim_ == 0) state_out = nullptr;  // nothing to copy
  std::lock_guard<std::mutex> lock(mu_);
  CheckKeys(keys, n);
  if (n == 0) return;
  ++epoch_;
  const size_t threads = static_cast<size_t>(pool_.num_threads());
  const size_t tasks =
      threads == 1 ? 1 : std::max<size_t>(1, std::min(threads * kTasksPerThread, n / kMinKeysPerTask));
  if (task_misses_.size() < tasks) task_misses_.resize(tasks);
  for (size_t t = 0; t < tasks; ++t) task_misses_[t].clear();
  const bool track = spill_.tracking();
  views_.resize(num_shards_);
  for (uint32_t s = 0; s < num_shards_; ++s) views_[s] = shards_[s]->map.view();
  pool_.Run(tasks, [&](size_t t) {
    const size_t b = n * t / tasks, e = n * (t + 1) / tasks;
    std::vector<uint32_t>* misses = &task_misses_[t];
    if (state_out != nullptr) {
      if (track) {
        ReadAny<true, true>(keys, b, e, out, state_out, insert_missing, misses);
      } else {
        ReadAny<false, true>(keys, b, e, out, state_out, insert_missing, misses);
      }
    } else if (track) {
      ReadAny<true, false>(keys, b, e, out, nullptr, insert_missing, misses);
    } else {
      ReadAny<false, false>(keys, b, e, out, nullptr, insert_missing, misses);
    }
  });
  if (insert_missing) {
    miss_keys_.clear();
    std::vector<uint32_t>& miss_rows = miss_rows_;
    miss_rows.clear();
    for (size_t t = 0; t < tasks; ++t) {
      for (uint32_t i : task_misses_[t]) {
        miss_rows.push_back(i);
        miss_keys_.push_back(keys[i]);
      }
    }
    if (!miss_keys_.empty()) {
      Route(miss_keys_.data(), miss_keys_.size());
      Materialize(miss_keys_.data());
      const uint32_t epoch = epoch_;
      RunShards([&](Shard& sh, uint32_t b, uint32_t e) {
        Publish(sh, /*init_rows=*/true, /*init_state=*/true, epoch);
        for (uint32_t k = 0; k < e - b; ++k) {
          const uint32_t slot = sh.groups[sh.item_group[k]].slot;
          const size_t i = miss_rows[order_[b + k]];
          std::memcpy(out + i * dim_, Row(slot), row_bytes_);
          if (state_out != nullptr) {
            std::memcpy(state_out + i * state_dim_, State(slot), state_bytes_);
          }
        }
      });
    }
  }
  lookups_ += static_cast<int64_t>(n);
  Finish();
}

void EmbeddingStore::Impl::Assign(const int64_t* keys, size_t n, const float* rows,
                                  const float* state) {
  if (state_dim_ == 0) state = nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  CheckKeys(keys, n);
  if (n == 0) return;
  ++epoch_;
  Route(keys, n);
  Materialize(keys);
  ++mutations_;
  const bool track = spill_.tracking();
  const uint32_t epoch = epoch_;
  RunShards([&](Shard& sh, uint32_t b, uint32_t) {
    // New rows are fully overwritten: no initialisation of their weights; their state
    // starts from the initial state unless it is assigned too. Each distinct key takes the
    // row (and state) of its last occurrence.
    Publish(sh, /*init_rows=*/false, /*init_state=*/state == nullptr, epoch);
    for (const Shard::Group& grp : sh.groups) {
      const size_t last = order_[b + grp.last];
      std::memcpy(Row(grp.slot), rows + last * dim_, row_bytes_);
      if (state != nullptr) std::memcpy(State(grp.slot), state + last * state_dim_, state_bytes_);
      if (track) Touch(grp.slot, epoch);
    }
  });
  for (auto& sh : shards_) updates_ += static_cast<int64_t>(sh->groups.size());
  Finish();
}

namespace {
template <int kDim>
inline void AddRow(float* __restrict a, const float* __restrict g, int runtime_dim) {
  const int dim = kDim > 0 ? kDim : runtime_dim;
  for (int c = 0; c < dim; ++c) a[c] = a[c] + g[c];
}
}  // namespace

// One update per group, in group order: the gradient rows of a key's occurrences are summed
// in input order (the first copied, the rest added), then applied once by the optimizer's
// row kernel. Rows (and states) were prefetched for writing by Materialize.
template <int kDim, bool kRowTable, OptimizerKind kKind>
void EmbeddingStore::Impl::UpdateShard(Shard& sh, uint32_t b, const float* grads,
                                       const float* const* grad_rows, const StepArgs& args) {
  const size_t ng = sh.groups.size();
  const bool track = spill_.tracking();
  const uint32_t epoch = epoch_;
  const size_t dim = static_cast<size_t>(kDim > 0 ? kDim : dim_);
  const uint32_t* order = order_.data() + b;
  const uint32_t* next_item = sh.next_item.data();
  float* acc = sh.acc.data();          // sized by GroupShard
  // Sized by GroupShard, with room for the alignment the kernels require.
  float* scratch = reinterpret_cast<float*>(
      RoundUp(reinterpret_cast<uintptr_t>(sh.scratch.data()), kScratchAlign));
  auto row = [&](uint32_t i) -> const float* {
    if constexpr (kRowTable) {
      return grad_rows[i];
    } else {
      return grads + static_cast<size_t>(i) * dim;
    }
  };
  for (size_t g = 0; g < ng; ++g) {
    const Shard::Group& grp = sh.groups[g];
    float* w = reinterpret_cast<float*>(Row(grp.slot));
    float* state = nullptr;
    if constexpr (kKind != OptimizerKind::kSgd) state = reinterpret_cast<float*>(State(grp.slot));
    const float* grad = row(order[grp.first]);
    if (grp.count > 1) {
      std::memcpy(acc, grad, dim * sizeof(float));
      for (uint32_t k = next_item[grp.first]; k != Shard::kNoItem; k = next_item[k]) {
        AddRow<kDim>(acc, row(order[k]), dim_);
      }
      grad = acc;
    }
    kernels::UpdateRow<kDim, kKind>(w, state, grad, args, scratch);
    if (track) Touch(grp.slot, epoch);
  }
}

void EmbeddingStore::Impl::RequireSgd(const char* method) const {
  if (opt_.optimizer.kind != OptimizerKind::kSgd) {
    throw ValueError(std::string("optimizer: ") + method + " needs an SGD store, this one runs '" +
                     OptimizerKindName(opt_.optimizer.kind) + "' (use ApplyGradients)");
  }
}

namespace {
void CheckStep(float lr, int divisor) {
  if (divisor < 1) throw ValueError("grad_divisor must be >= 1, got " + std::to_string(divisor));
  if (!std::isfinite(lr)) throw ValueError("lr must be finite");
}
}  // namespace

void EmbeddingStore::Impl::ApplyGradients(const int64_t* keys, size_t n, const float* grads,
                                          float lr, int divisor) {
  CheckStep(lr, divisor);
  std::lock_guard<std::mutex> lock(mu_);
  CheckKeys(keys, n);
  if (n == 0) return;
  ApplyLocked(keys, n, grads, nullptr, lr, divisor);
}

// The segments' keys are gathered (routing wants one key array, 8 bytes a row); their
// gradient rows stay where they are and are reached through a per-row pointer table, so the
// update reads every gradient byte once, as ApplyGradients on the concatenation would.
void EmbeddingStore::Impl::ApplyGradientsSegments(const GradSegment* segs, size_t count,
                                                  float lr, int divisor) {
  CheckStep(lr, divisor);
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  size_t nonempty = 0;
  const GradSegment* only = nullptr;
  for (size_t s = 0; s < count; ++s) {
    if (segs[s].n == 0) continue;
    if (segs[s].n > kMaxKeysPerCall - n) {
      throw ValueError("keys: at most " + std::to_string(kMaxKeysPerCall) +
                       " keys per call over all segments");
    }
    n += segs[s].n;
    ++nonempty;
    only = &segs[s];
  }
  if (n == 0) return;
  if (nonempty == 1) {
    CheckKeys(only->keys, n);
    ApplyLocked(only->keys, n, only->grads, nullptr, lr, divisor);
    return;
  }
  segment_keys_.resize(n);
  segment_rows_.resize(n);
  const size_t dim = static_cast<size_t>(dim_);
  size_t at = 0;
  for (size_t s = 0; s < count; ++s) {
    const GradSegment& seg = segs[s];
    if (seg.n == 0) continue;
    std::memcpy(segment_keys_.data() + at, seg.keys, seg.n * sizeof(int64_t));
    const float** rows = segment_rows_.data() + at;
    for (size_t i = 0; i < seg.n; ++i) rows[i] = seg.grads + i * dim;
    at += seg.n;
  }
  CheckKeys(segment_keys_.data(), n);
  ApplyLocked(segment_keys_.data(), n, nullptr, segment_rows_.data(), lr, divisor);
}

void EmbeddingStore::Impl::ApplyLocked(const int64_t* keys, size_t n, const float* grads,
                                       const float* const* grad_rows, float lr, int divisor) {
  ++epoch_;
  Route(keys, n);
  Materialize(keys);
  ++mutations_;
  const uint32_t epoch = epoch_;
  const OptimizerConstants k = ConstantsOf(opt_.optimizer);
  StepArgs args;
  args.lr = lr;
  args.div = static_cast<float>(divisor);
  args.divide = divisor != 1;
  args.wd = k.weight_decay;
  args.decay = k.weight_decay != 0.0f;
  args.eps = k.eps;
  args.c1 = k.c1;
  args.c2 = k.c2;
  args.fdim = static_cast<float>(dim_);
  args.dim = dim_;
  args.padded = PaddedDim(dim_);
  // Template dispatch: the gradient addressing, the optimizer, then the dimension.
  auto by_dim = [&](auto row_table, auto kind, Shard& sh, uint32_t b) {
    constexpr bool kTable = decltype(row_table)::value;
    constexpr OptimizerKind kKind = decltype(kind)::value;
    switch (dim_) {
      case 16: return UpdateShard<16, kTable, kKind>(sh, b, grads, grad_rows, args);
      case 32: return UpdateShard<32, kTable, kKind>(sh, b, grads, grad_rows, args);
      case 64: return UpdateShard<64, kTable, kKind>(sh, b, grads, grad_rows, args);
      case 128: return UpdateShard<128, kTable, kKind>(sh, b, grads, grad_rows, args);
      default: return UpdateShard<0, kTable, kKind>(sh, b, grads, grad_rows, args);
    }
  };
  auto by_kind = [&](auto row_table, Shard& sh, uint32_t b) {
    using K = OptimizerKind;
    switch (opt_.optimizer.kind) {
      case K::kSgd:
        return by_dim(row_table, std::integral_constant<K, K::kSgd>{}, sh, b);
      case K::kAdagrad:
        return by_dim(row_table, std::integral_constant<K, K::kAdagrad>{}, sh, b);
      case K::kRowWiseAdagrad:
        return by_dim(row_table, std::integral_constant<K, K::kRowWiseAdagrad>{}, sh, b);
      case K::kAdam:
        return by_dim(row_table, std::integral_constant<K, K::kAdam>{}, sh, b);
    }
  };
  RunShards([&](Shard& sh, uint32_t b, uint32_t) {
    Publish(sh, /*init_rows=*/true, /*init_state=*/true, epoch);
    if (grad_rows != nullptr) {
      by_kind(std::true_type{}, sh, b);
    } else {
      by_kind(std::false_type{}, sh, b);
    }
  });
  for (auto& sh : shards_) updates_ += static_cast<int64_t>(sh->groups.size());
  Finish();
}

void EmbeddingStore::Impl::Contains(const int64_t* keys, size_t n, uint8_t* present) {
  std::lock_guard<std::mutex> lock(mu_);
  CheckKeys(keys, n);
  const size_t threads = static_cast<size_t>(pool_.num_threads());
  const size_t tasks = std::max<size_t>(1, std::min(threads, n / kMinKeysPerTask));
  pool_.Run(tasks, [&](size_t t) {
    const size_t b = n * t / tasks, e = n * (t + 1) / tasks;
    for (size_t i = b; i < e; ++i) {
      if (i + kPrefetchDistance < e) {
        const uint64_t h2 = KeyHash(keys[i + kPrefetchDistance]);
        const KeyMap& m2 = shards_[ShardOf(h2)]->map;
        if (m2.capacity() != 0) __builtin_prefetch(m2.bucket(m2.Home(h2)));
      }
      const uint64_t h = KeyHash(keys[i]);
      present[i] = shards_[ShardOf(h)]->map.Find(keys[i], h) != KeyMap::kNotFound ? 1 : 0;
    }
  });
}

size_t EmbeddingStore::Impl::Erase(const int64_t* keys, size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  CheckKeys(keys, n);
  if (n == 0) return 0;
  Route(keys, n);
  // Capacity first, so nothing below can fail halfway.
  free_slots_.reserve(free_slots_.size() + n);
  for (uint32_t s = 0; s < num_shards_; ++s) {
    shards_[s]->freed.clear();
    shards_[s]->freed.reserve(shard_begin_[s + 1] - shard_begin_[s]);
  }
  RunShards([&](Shard& sh, uint32_t b, uint32_t e) {
    for (uint32_t p = b; p < e; ++p) {
      const uint32_t i = order_[p];
      const uint32_t slot = sh.map.Erase(keys[i], hashes_[i]);
      if (slot != KeyMap::kNotFound) sh.freed.push_back(slot);
    }
  });
  size_t erased = 0;
  for (auto& sh : shards_) {  // shard order: the free list is deterministic
    erased += sh->freed.size();
    free_slots_.insert(free_slots_.end(), sh->freed.begin(), sh->freed.end());
  }
  if (erased > 0) ++mutations_;
  return erased;
}

void EmbeddingStore::Impl::Reserve(size_t total_rows) {
  std::lock_guard<std::mutex> lock(mu_);
  // Keys spread binomially over shards: leave four standard deviations of headroom.
  const double per = static_cast<double>(total_rows) / num_shards_;
  const size_t want = static_cast<size_t>(per + 4.0 * std::sqrt(per) + 16.0);
  const size_t want_pages = index_.PagesFor(total_rows);
  page_addr_.reserve(want_pages);
  pages_.reserve(want_pages);
  pool_.Run(num_shards_, [&](size_t s) { shards_[s]->map.Reserve(want); });
  ++mutations_;
}

size_t EmbeddingStore::Impl::Size() {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (auto& sh : shards_) n += sh->map.size();
  return n;
}

size_t EmbeddingStore::Impl::Export(int64_t* cursor, size_t max_rows, int64_t* keys, float* rows,
                                    float* state) {
  if (state_dim_ == 0) state = nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  constexpr int kPosBits = 40;
  if (*cursor < 0) throw ValueError("export: cursor is exhausted (-1)");
  if (max_rows == 0) throw ValueError("chunk_rows must be >= 1");
  if (*cursor == 0) {
    export_mutations_ = mutations_;
  } else if (export_mutations_ != mutations_) {
    throw ValueError("export: the store changed since this export started; restart it");
  }
  uint64_t s = static_cast<uint64_t>(*cursor) >> kPosBits;
  uint64_t pos = static_cast<uint64_t>(*cursor) & ((uint64_t{1} << kPosBits) - 1);
  size_t written = 0;
  while (s < num_shards_ && written < max_rows) {
    const Shard& sh = *shards_[s];
    const KeyMap::Entry* entries = sh.map.entries();
    const size_t cap = sh.map.capacity();
    while (pos < cap && written < max_rows) {
      const KeyMap::Entry& e = entries[pos++];
      if (e.tag == 0) continue;
      keys[written] = e.key;
      std::memcpy(rows + written * static_cast<size_t>(dim_), Row(e.tag - 1), row_bytes_);
      if (state != nullptr) {
        std::memcpy(state + written * static_cast<size_t>(state_dim_), State(e.tag - 1),
                    state_bytes_);
      }
      ++written;
    }
    if (pos >= cap) {
      ++s;
      pos = 0;
    }
  }
  // Never 0 here: at least one row was written or one shard was passed.
  *cursor = s >= num_shards_ ? -1 : static_cast<int64_t>((s << kPosBits) | pos);
  return written;
}

StoreStats EmbeddingStore::Impl::Stats() {
  std::lock_guard<std::mutex> lock(mu_);
  StoreStats st;
  for (auto& sh : shards_) {
    st.rows += static_cast<int64_t>(sh->map.size());
    st.bytes_maps += static_cast<int64_t>(sh->map.bytes());
  }
  const int64_t pb = static_cast<int64_t>(arena_.page_bytes());
  st.page_bytes = pb;
  st.pages = static_cast<int64_t>(arena_.num_pages());
  st.pages_spilled = static_cast<int64_t>(arena_.spilled_pages());
  st.bytes_spilled = st.pages_spilled * pb;
  st.bytes_resident = static_cast<int64_t>(arena_.resident_pages()) * pb + st.bytes_maps;
  st.spill_count = spill_.spill_count();
  st.swap_outs = spill_.swap_outs();
  st.swap_ins = spill_.swap_ins();
  st.lookups = lookups_;
  st.updates = updates_;
  st.memory_budget = spill_.budget_bytes();
  st.state_dim = state_dim_;
  st.slot_bytes = static_cast<int64_t>(stride_ + state_stride_);
  return st;
}

void EmbeddingStore::Impl::Save(const std::string& dir,
                               const std::map<std::string, std::string>& meta,
                               bool weights_only) {
  std::lock_guard<std::mutex> lock(mu_);
  CheckpointWriter writer(dir);
  Manifest m;
  m.weights_only = weights_only;
  m.dim = dim_;
  m.init = opt_.init;
  m.key_bound = opt_.key_bound;
  m.num_shards = opt_.num_shards;
  m.page_rows = opt_.page_rows;
  m.optimizer = opt_.optimizer;
  m.state_dim = state_dim_;
  m.meta = meta;
  const bool with_state = state_dim_ > 0 && !weights_only;
  m.segments.resize(num_shards_);
  pool_.Run(num_shards_, [&](size_t s) {
    char name[32];
    std::snprintf(name, sizeof(name), "keys-%04zu.bin", s);
    CheckpointWriter::File keys = writer.Create(name);
    std::snprintf(name, sizeof(name), "rows-%04zu.bin", s);
    CheckpointWriter::File rows = writer.Create(name);
    std::optional<CheckpointWriter::File> state;
    if (with_state) {
      std::snprintf(name, sizeof(name), "state-%04zu.bin", s);
      state.emplace(writer.Create(name));
    }
    // Stage rows in chunks so each file write is large.
    constexpr size_t kChunk = 4096;
    std::vector<int64_t> kbuf;
    std::vector<float> rbuf;
    std::vector<float> sbuf;
    kbuf.reserve(kChunk);
    rbuf.reserve(kChunk * static_cast<size_t>(dim_));
    if (with_state) sbuf.reserve(kChunk * static_cast<size_t>(state_dim_));
    auto flush = [&] {
      keys.Write(kbuf.data(), kbuf.size() * sizeof(int64_t));
      rows.Write(rbuf.data(), rbuf.size() * sizeof(float));
      if (state) state->Write(sbuf.data(), sbuf.size() * sizeof(float));
      kbuf.clear();
      rbuf.clear();
      sbuf.clear();
    };
    const KeyMap& map = shards_[s]->map;
    uint64_t count = 0;
    for (size_t b = 0; b < map.capacity(); ++b) {
      const KeyMap::Entry& e = map.entries()[b];
      if (e.tag == 0) continue;
      kbuf.push_back(e.key);
      const float* r = reinterpret_cast<const float*>(Row(e.tag - 1));
      rbuf.insert(rbuf.end(), r, r + dim_);
      if (with_state) {
        const float* st = reinterpret_cast<const float*>(State(e.tag - 1));
        sbuf.insert(sbuf.end(), st, st + state_dim_);
      }
      ++count;
      if (kbuf.size() == kChunk) flush();
    }
    flush();
    SegmentEntry& seg = m.segments[s];
    seg.count = count;
    seg.keys = keys.Finish();
    seg.rows = rows.Finish();
    if (state) {
      seg.has_state = true;
      seg.state = state->Finish();
    }
  });
  for (const auto& seg : m.segments) m.rows += seg.count;
  writer.Commit(m);
}

// ---- public face ------------------------------------------------------------------------

EmbeddingStore::EmbeddingStore(const StoreOptions& options) : impl_(std::make_unique<Impl>(options)) {}
EmbeddingStore::~EmbeddingStore() = default;
const StoreOptions& EmbeddingStore::options() const { return impl_->options(); }
int EmbeddingStore::dim() const { return impl_->options().dim; }
int EmbeddingStore::state_dim() const { return impl_->state_dim(); }
void EmbeddingStore::Lookup(const int64_t* keys, size_t n, float* out, bool insert_missing) {
  impl_->Lookup(keys, n, out, nullptr, insert_missing);
}
void EmbeddingStore::Lookup(const int64_t* keys, size_t n, float* out, float* state_out,
                            bool insert_missing) {
  impl_->Lookup(keys, n, out, state_out, insert_missing);
}
void EmbeddingStore::Assign(const int64_t* keys, size_t n, const float* rows) {
  impl_->Assign(keys, n, rows, nullptr);
}
void EmbeddingStore::Assign(const int64_t* keys, size_t n, const float* rows, const float* state) {
  impl_->Assign(keys, n, rows, state);
}
void EmbeddingStore::ApplyGradients(const int64_t* keys, size_t n, const float* grads, float lr,
                                    int grad_divisor) {
  impl_->ApplyGradients(keys, n, grads, lr, grad_divisor);
}
void EmbeddingStore::ApplyGradientsSegments(const GradSegment* segs, size_t count, float lr,
                                            int grad_divisor) {
  impl_->ApplyGradientsSegments(segs, count, lr, grad_divisor);
}
void EmbeddingStore::ApplySgd(const int64_t* keys, size_t n, const float* grads, float lr,
                              int grad_divisor) {
  impl_->RequireSgd("ApplySgd");
  impl_->ApplyGradients(keys, n, grads, lr, grad_divisor);
}
void EmbeddingStore::ApplySgdSegments(const GradSegment* segs, size_t count, float lr,
                                      int grad_divisor) {
  impl_->RequireSgd("ApplySgdSegments");
  impl_->ApplyGradientsSegments(segs, count, lr, grad_divisor);
}
void EmbeddingStore::Contains(const int64_t* keys, size_t n, uint8_t* present) {
  impl_->Contains(keys, n, present);
}
size_t EmbeddingStore::Erase(const int64_t* keys, size_t n) { return impl_->Erase(keys, n); }
void EmbeddingStore::Reserve(size_t total_rows) { impl_->Reserve(total_rows); }
size_t EmbeddingStore::Size() { return impl_->Size(); }
size_t EmbeddingStore::Export(int64_t* cursor, size_t max_rows, int64_t* keys, float* rows,
                              float* state) {
  return impl_->Export(cursor, max_rows, keys, rows, state);
}
StoreStats EmbeddingStore::Stats() { return impl_->Stats(); }
void EmbeddingStore::SetSpillCallback(SpillCallback cb) { impl_->SetSpillCallback(std::move(cb)); }

void EmbeddingStore::Save(const std::string& dir, const std::map<std::string, std::string>& meta,
                          bool weights_only) {
  impl_->Save(dir, meta, weights_only);
}

void EmbeddingStore::InitialRows(const InitSpec& init, int dim, const int64_t* keys, size_t n,
                                 float* out) {
  ValidateInitSpec(init);
  if (dim <= 0) throw ValueError("dim must be > 0, got " + std::to_string(dim));
  for (size_t i = 0; i < n; ++i) {
    InitRow(init, dim, keys[i], KeyHash(keys[i]), out + i * static_cast<size_t>(dim));
  }
}

void EmbeddingStore::InitialRows(const InitSpec& init, int dim, const OptimizerSpec& optimizer,
                                 const int64_t* keys, size_t n, float* out, float* state_out) {
  ValidateOptimizerSpec(optimizer);
  InitialRows(init, dim, keys, n, out);
  if (state_out == nullptr) return;
  const size_t state_dim = static_cast<size_t>(StateDim(optimizer.kind, dim));
  for (size_t i = 0; i < n; ++i) InitialState(optimizer, dim, state_out + i * state_dim);
}

}  // namespace bagpipe::store
