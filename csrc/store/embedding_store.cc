#include "store/embedding_store.h"

#include <algorithm>
#include <cmath>
#include <mutex>
#include <vector>

#include "common/errors.h"
#include "common/os_memory.h"
#include "store/embedding_store_impl.h"
#include "store/splitmix64.h"

namespace bagpipe::store {

StoreOptions EmbeddingStore::Impl::Resolve(StoreOptions o) {
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

EmbeddingStore::Impl::Impl(const StoreOptions& options)
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

size_t EmbeddingStore::Impl::Erase(const int64_t* keys, size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  CheckKeys(keys, n);
  if (n == 0) return 0;
  Route(keys, n);
  // Capacity first, so nothing below can fail halfway.
  ReserveAside();
  free_slots_.reserve(free_slots_.size() + n);
  for (uint32_t s = 0; s < num_shards_; ++s) {
    const uint32_t routed = shard_begin_[s + 1] - shard_begin_[s];
    shards_[s]->freed.clear();
    shards_[s]->freed.reserve(routed);
    if (chain_.open) shards_[s]->deleted.reserve(shards_[s]->deleted.size() + routed);
  }
  const bool record = chain_.open;  // deletions matter to an open chain only
  RunShards([&](Shard& sh, uint32_t b, uint32_t e) {
    for (uint32_t p = b; p < e; ++p) {
      const uint32_t i = order_[p];
      const uint32_t slot = sh.map.Erase(keys[i], hashes_[i]);
      if (slot == KeyMap::kNotFound) continue;
      Preserve(sh, slot);  // a freed slot may be reused, by any shard, without a copy
      sh.freed.push_back(slot);
      ClearDirty(sh, slot);
      if (record) sh.deleted.push_back(keys[i]);
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
  dirty_.reserve(want_pages);
  pool_.Run(num_shards_, [&](size_t s) { shards_[s]->map.Reserve(want); });
  ++mutations_;
}

size_t EmbeddingStore::Impl::Size() {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (auto& sh : shards_) n += sh->map.size();
  return n;
}

StoreStats EmbeddingStore::Impl::Stats() {
  std::lock_guard<std::mutex> lock(mu_);
  StoreStats st;
  for (auto& sh : shards_) {
    st.rows += static_cast<int64_t>(sh->map.size());
    st.bytes_maps += static_cast<int64_t>(sh->map.bytes());
    st.dirty_rows += static_cast<int64_t>(sh->dirty);
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

// ---- public face ------------------------------------------------------------------------

EmbeddingStore::EmbeddingStore(const StoreOptions& options)
    : impl_(std::make_unique<Impl>(options)) {}
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

CheckpointResult EmbeddingStore::Checkpoint(const std::string& dir, int64_t step,
                                            const std::map<std::string, std::string>& meta,
                                            const ChainPolicy& policy) {
  return impl_->Checkpoint(dir, step, meta, policy);
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
