// The read path: Lookup through the four-stage prefetching pipeline (ReadGroups), with absent
// keys inserted afterwards when asked to, and Contains.
#include <algorithm>
#include <cstring>
#include <mutex>
#include <type_traits>
#include <vector>

#include "store/embedding_store_impl.h"
#include "store/init.h"
#include "store/splitmix64.h"

namespace bagpipe::store {

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
  const size_t tasks = threads == 1 ? 1
                                     : std::max<size_t>(1, std::min(threads * kTasksPerThread,
                                                                    n / kMinKeysPerTask));
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

}  // namespace bagpipe::store
