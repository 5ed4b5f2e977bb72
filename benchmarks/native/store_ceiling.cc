// store_ceiling: the machine's ceiling for the PS store's read and SGD paths, next to the
// engine (bagpipe::store::EmbeddingStore) on the same keys in the same process.
//
// The reference is issue 2's design, reduced to the minimum: one flat open-addressing table
// of 16-byte entries {int64 key, uint32 slot + 1, pad} at load <= 0.7 (SplitMix64 hash,
// multiply-shift home bucket, linear probing), rows in one contiguous huge-page array of
// 64-byte-aligned rows (slot -> address is one multiply), and a lookup that software-
// prefetches over groups of G keys: hash group i+1 and prefetch its buckets, probe group i
// and prefetch its rows, copy group i-1. No shards, no spill tracking, no insertion, no
// error checks: what the hardware gives the simplest table that meets the contract's reads.
// Its SGD is the minimum the contract needs: de-duplicate the batch (first-occurrence order,
// duplicate gradients summed in input order), probe with prefetch, update each row once.
//
// Workload (as benchmarks/ps_store.py): `keys` keys of dim `dim`, every key stored; batches
// of 4096 keys of Zipf(1.05) ranks scattered over the key space by a fixed permutation.
// Two threads split each batch in halves and meet at a spinning barrier (the cheapest
// hand-off there is).
//
// Output: one JSON line per result, medians over repeats; reference and engine passes
// alternate so load changes on a shared machine hit both alike. Engine lines carry the
// reference as "baseline" and engine / reference as "ratio".
//
// Build: cmake --build build/dev --target bagpipe_store_ceiling
// Run:   build/dev/bagpipe_store_ceiling [--keys N] [--dim D] [--batches B] [--repeats R]
//                                        [--group G] [--threads 1,2] [--no-engine]
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "store/embedding_store.h"
#include "store/splitmix64.h"
#include "store/key_map.h"

namespace {

using bagpipe::store::KeyHash;

constexpr size_t kBatch = 4096;
constexpr size_t kTasks = 8;  // two-thread lookups: tasks of 512 keys, claimed dynamically
constexpr double kZipf = 1.05;
constexpr size_t kHuge = size_t{2} << 20;

struct Args {
  size_t keys = 10'000'000;
  int dim = 32;
  size_t batches = 256;
  int repeats = 7;
  size_t group = 32;
  std::vector<int> threads = {1, 2};
  bool engine = true;
  int shards = 16;
  uint32_t page_rows = 0;
};

// ---- memory ------------------------------------------------------------------------------

// Zeroed, 2 MiB-aligned memory with MADV_HUGEPAGE; never freed before exit.
void* MapHuge(size_t bytes) {
  bytes = (bytes + kHuge - 1) & ~(kHuge - 1);
  void* raw = mmap(nullptr, bytes + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                   -1, 0);
  if (raw == MAP_FAILED) {
    std::perror("mmap");
    std::exit(1);
  }
  auto p = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(raw) + kHuge - 1) & ~(kHuge - 1));
  madvise(p, bytes, MADV_HUGEPAGE);
  return p;
}

// ---- the reference table -----------------------------------------------------------------

class RefTable {
 public:
  struct Entry {
    int64_t key;
    uint32_t tag;  // 0: empty, else slot + 1
    uint32_t pad;
  };
  static_assert(sizeof(Entry) == 16);

  RefTable(size_t n, int dim)
      : dim_(dim),
        stride_(((static_cast<size_t>(dim) * 4 + 63) / 64) * 64),
        capacity_(n * 10 / 7 + 1),
        table_(static_cast<Entry*>(MapHuge(capacity_ * sizeof(Entry)))),
        rows_(static_cast<char*>(MapHuge(n * stride_))) {
    for (size_t k = 0; k < n; ++k) {
      const int64_t key = static_cast<int64_t>(k);
      size_t b = Home(KeyHash(key));
      while (table_[b].tag != 0) b = b + 1 == capacity_ ? 0 : b + 1;
      table_[b] = {key, static_cast<uint32_t>(k) + 1, 0};
      float* r = reinterpret_cast<float*>(rows_ + k * stride_);
      for (int c = 0; c < dim; ++c) r[c] = static_cast<float>(k % 1000) * 1e-3f + c;
    }
  }

  size_t Home(uint64_t h) const {
    return static_cast<size_t>((static_cast<unsigned __int128>(h) * capacity_) >> 64);
  }
  const char* Find(size_t b, int64_t key) const {
    for (;;) {
      const Entry& e = table_[b];
      if (e.tag == 0) return nullptr;
      if (e.key == key) return rows_ + static_cast<size_t>(e.tag - 1) * stride_;
      b = b + 1 == capacity_ ? 0 : b + 1;
    }
  }

  // lookup+copy of keys[0, n) into out, grouped prefetch over groups of G.
  template <size_t G>
  void Lookup(const int64_t* keys, size_t n, float* out) const {
    size_t home[2][G];
    const char* rows[2][G];
    const size_t row_bytes = static_cast<size_t>(dim_) * 4;
    const size_t lines = std::min<size_t>(stride_ / 64, 4);
    auto hash_group = [&](size_t start, size_t* hb) {
      const size_t m = start < n ? std::min(G, n - start) : 0;
      for (size_t j = 0; j < m; ++j) {
        hb[j] = Home(KeyHash(keys[start + j]));
        __builtin_prefetch(table_ + hb[j]);
      }
    };
    hash_group(0, home[0]);
    for (size_t gi = 0;; ++gi) {
      const size_t cur = gi & 1, start = gi * G;
      if (start >= n + G) break;
      hash_group(start + G, home[cur ^ 1]);
      const size_t m = start < n ? std::min(G, n - start) : 0;
      for (size_t j = 0; j < m; ++j) {
        const char* r = Find(home[cur][j], keys[start + j]);
        for (size_t l = 0; l < lines; ++l) __builtin_prefetch(r + 64 * l);
        rows[cur][j] = r;
      }
      if (gi == 0) continue;
      const size_t ps = start - G, pm = std::min(G, n - ps);
      for (size_t j = 0; j < pm; ++j) {
        std::memcpy(out + (ps + j) * dim_, rows[cur ^ 1][j], row_bytes);
      }
    }
  }

  // The contract's minimum SGD work for keys[0, n): de-duplicate (first-occurrence order),
  // sum duplicates in input order, probe with prefetch, one update per distinct key.
  // Scratch is preallocated by the caller (sized for kBatch keys).
  struct SgdScratch {
    std::vector<uint32_t> table = std::vector<uint32_t>(2 * kBatch);
    std::vector<int64_t> gkey = std::vector<int64_t>(kBatch);
    std::vector<uint32_t> gfirst = std::vector<uint32_t>(kBatch);
    std::vector<uint32_t> gacc = std::vector<uint32_t>(kBatch);
    std::vector<uint32_t> next = std::vector<uint32_t>(kBatch);  // next occurrence of a key
    std::vector<uint32_t> last = std::vector<uint32_t>(kBatch);
    std::vector<uint64_t> ghash = std::vector<uint64_t>(kBatch);
    std::vector<const char*> grow = std::vector<const char*>(kBatch);
    std::vector<float> acc;
  };
  // With parts == 2, only the keys whose hash parity is `part` (the other thread owns the
  // rest: no row is written by two threads).
  void Sgd(const int64_t* keys, size_t n, const float* grads, float lr, SgdScratch& s,
           uint64_t part, uint64_t parts) const {
    const size_t mask = s.table.size() - 1;
    std::fill(s.table.begin(), s.table.end(), 0xFFFFFFFFu);
    size_t ng = 0;
    for (size_t i = 0; i < n; ++i) {
      const uint64_t h = KeyHash(keys[i]);
      if ((h & (parts - 1)) != part) continue;
      for (size_t t = h & mask;; t = (t + 1) & mask) {
        const uint32_t g = s.table[t];
        if (g == 0xFFFFFFFFu) {
          s.table[t] = static_cast<uint32_t>(ng);
          s.gkey[ng] = keys[i];
          s.ghash[ng] = h;
          s.gfirst[ng] = static_cast<uint32_t>(i);
          s.last[ng] = static_cast<uint32_t>(i);
          s.next[i] = 0xFFFFFFFFu;
          ++ng;
          break;
        }
        if (s.gkey[g] == keys[i]) {
          s.next[s.last[g]] = static_cast<uint32_t>(i);
          s.last[g] = static_cast<uint32_t>(i);
          s.next[i] = 0xFFFFFFFFu;
          break;
        }
      }
    }
    constexpr size_t D = 16;
    for (size_t g = 0; g < std::min(ng, D); ++g) __builtin_prefetch(table_ + Home(s.ghash[g]));
    for (size_t g = 0; g < ng; ++g) {
      if (g + D < ng) __builtin_prefetch(table_ + Home(s.ghash[g + D]));
      const char* r = Find(Home(s.ghash[g]), s.gkey[g]);
      __builtin_prefetch(r, 1);
      if (stride_ > 64) __builtin_prefetch(r + 64, 1);
      s.grow[g] = r;
    }
    if (s.acc.size() < static_cast<size_t>(dim_)) s.acc.resize(dim_);
    float* a = s.acc.data();
    for (size_t g = 0; g < ng; ++g) {
      float* w = const_cast<float*>(reinterpret_cast<const float*>(s.grow[g]));
      uint32_t i = s.gfirst[g];
      const float* src = grads + static_cast<size_t>(i) * dim_;
      if (s.next[i] != 0xFFFFFFFFu) {
        std::memcpy(a, src, dim_ * 4);
        for (i = s.next[i]; i != 0xFFFFFFFFu; i = s.next[i]) {
          const float* gi = grads + static_cast<size_t>(i) * dim_;
          for (int c = 0; c < dim_; ++c) a[c] = a[c] + gi[c];
        }
        src = a;
      }
      for (int c = 0; c < dim_; ++c) w[c] = w[c] - src[c] * lr;
    }
  }

 private:
  const int dim_;
  const size_t stride_;
  const size_t capacity_;
  Entry* const table_;
  char* const rows_;
};

// ---- the best flat table found ---------------------------------------------------------

// The engine's read design on one flat table: 16-byte entries in 64-byte buckets of four,
// linear probing bucket by bucket (load <= 0.7), a whole bucket compared at once
// (KeyMap::MatchBucket), and a four-stage pipeline over groups of 16 keys: hash and prefetch
// the home bucket; match it (a hit prefetches the row, a full bucket without the key defers
// the key and prefetches the next bucket); finish deferred keys; copy.
class BucketTable {
 public:
  using Entry = bagpipe::store::KeyMap::Entry;
  using KeyMap = bagpipe::store::KeyMap;

  BucketTable(size_t n, int dim)
      : dim_(dim),
        stride_(((static_cast<size_t>(dim) * 4 + 63) / 64) * 64),
        buckets_((n * 10 / 7 + 1 + 3) / 4),
        table_(static_cast<Entry*>(MapHuge(buckets_ * 64))),
        rows_(static_cast<char*>(MapHuge(n * stride_))) {
    for (size_t k = 0; k < n; ++k) {
      const int64_t key = static_cast<int64_t>(k);
      for (size_t b = Home(KeyHash(key));; b = b + 1 == buckets_ ? 0 : b + 1) {
        Entry* e = table_ + b * 4;
        size_t j = 0;
        while (j < 4 && e[j].tag != 0) ++j;
        if (j == 4) continue;
        e[j] = {key, static_cast<uint32_t>(k) + 1, 0};
        break;
      }
      float* r = reinterpret_cast<float*>(rows_ + k * stride_);
      for (int c = 0; c < dim; ++c) r[c] = static_cast<float>(k % 1000) * 1e-3f + c;
    }
  }

  size_t Home(uint64_t h) const {
    return static_cast<size_t>((static_cast<unsigned __int128>(h) * buckets_) >> 64);
  }

  template <size_t kRowBytes>
  void Lookup(const int64_t* keys, size_t n, float* out) const {
    constexpr size_t G = 16;
    struct Stage {
      size_t bucket[G];
      const char* row[G];
      uint8_t deferred[G];
      size_t num_deferred;
    };
    Stage st[4];
    const size_t groups = (n + G - 1) / G;
    auto row_of = [&](uint32_t tag) {
      const char* r = rows_ + static_cast<size_t>(tag - 1) * stride_;
      __builtin_prefetch(r);
      if (stride_ > 64) __builtin_prefetch(r + 64);
      return r;
    };
    auto hash_stage = [&](size_t g) {
      if (g >= groups) return;
      Stage& s = st[g & 3];
      const size_t m = std::min(G, n - g * G);
      for (size_t j = 0; j < m; ++j) {
        s.bucket[j] = Home(KeyHash(keys[g * G + j]));
        __builtin_prefetch(table_ + s.bucket[j] * 4);
      }
    };
    auto match_stage = [&](size_t g) {
      if (g >= groups) return;
      Stage& s = st[g & 3];
      const size_t m = std::min(G, n - g * G);
      s.num_deferred = 0;
      for (size_t j = 0; j < m; ++j) {
        const Entry* e = table_ + s.bucket[j] * 4;
        const KeyMap::Match mt = KeyMap::MatchBucket(e, keys[g * G + j]);
        if (mt.hit != 0) {
          s.row[j] = row_of(e[KeyMap::EntryOf(__builtin_ctz(mt.hit))].tag);
        } else if (mt.empty != 0) {
          s.row[j] = nullptr;
        } else {
          s.bucket[j] = s.bucket[j] + 1 == buckets_ ? 0 : s.bucket[j] + 1;
          __builtin_prefetch(table_ + s.bucket[j] * 4);
          s.deferred[s.num_deferred++] = static_cast<uint8_t>(j);
        }
      }
    };
    auto finish_stage = [&](size_t g) {
      if (g >= groups) return;
      Stage& s = st[g & 3];
      for (size_t q = 0; q < s.num_deferred; ++q) {
        const size_t j = s.deferred[q];
        const int64_t key = keys[g * G + j];
        for (size_t b = s.bucket[j];; b = b + 1 == buckets_ ? 0 : b + 1) {
          const Entry* e = table_ + b * 4;
          const KeyMap::Match mt = KeyMap::MatchBucket(e, key);
          if (mt.hit != 0) {
            s.row[j] = row_of(e[KeyMap::EntryOf(__builtin_ctz(mt.hit))].tag);
            break;
          }
          if (mt.empty != 0) {
            s.row[j] = nullptr;
            break;
          }
        }
      }
    };
    auto copy_stage = [&](size_t g) {
      const Stage& s = st[g & 3];
      const size_t m = std::min(G, n - g * G);
      for (size_t j = 0; j < m; ++j) {
        float* dst = out + (g * G + j) * dim_;
        if (s.row[j] != nullptr) {
          std::memcpy(dst, s.row[j], kRowBytes);
        } else {
          std::memset(dst, 0, kRowBytes);
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

  void LookupAny(const int64_t* keys, size_t n, float* out) const {
    switch (dim_) {
      case 16: return Lookup<64>(keys, n, out);
      case 32: return Lookup<128>(keys, n, out);
      case 64: return Lookup<256>(keys, n, out);
      case 128: return Lookup<512>(keys, n, out);
      default:
        std::fprintf(stderr, "the bucketized reference supports dims 16, 32, 64, 128\n");
        std::exit(2);
    }
  }

 private:
  const int dim_;
  const size_t stride_;
  const size_t buckets_;
  Entry* const table_;
  char* const rows_;
};

// ---- two threads: a spinning hand-off ----------------------------------------------------

// One helper thread and the caller share a job of `n` tasks, claimed dynamically: if the
// helper is descheduled (a shared machine), the caller runs everything and waits only for a
// task the helper has started. The helper spins on a generation word between back-to-back
// jobs and sleeps on a futex after kSpinIters polls, leaving the core to the engine's passes.
class SpinPair {
 public:
  SpinPair() : helper_([this] { Loop(); }) {}
  ~SpinPair() {
    stop_.store(true);
    gen_.fetch_add(1);
    Wake();
    helper_.join();
  }
  // Sends the helper to sleep at once (the end of a timed pass: the engine's threads get
  // both cores for the next pass).
  void Park() { parked_.store(true, std::memory_order_release); }

  // Runs fn(0) ... fn(n-1) on both threads. REQUIRES: 1 <= n < 2^32.
  void Run(size_t n, const std::function<void(size_t)>& fn) {
    parked_.store(false, std::memory_order_relaxed);
    fn_ = &fn;
    n_ = n;
    finished_.store(0, std::memory_order_relaxed);
    const uint32_t g = gen_.load(std::memory_order_relaxed) + 1;
    claim_.store(uint64_t{g} << 32, std::memory_order_relaxed);
    gen_.store(g, std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_seq_cst)) Wake();
    Drain(g);
    while (finished_.load(std::memory_order_acquire) != n) __builtin_ia32_pause();
  }

 private:
  static constexpr int kSpinIters = 20000;  // about 50-100 us of pause instructions
  void Wake() {
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&gen_), FUTEX_WAKE_PRIVATE, 1, nullptr,
            nullptr, 0);
  }
  // Claims tasks of job generation g until none are left (a stale generation claims none).
  void Drain(uint32_t g) {
    for (;;) {
      uint64_t c = claim_.load(std::memory_order_acquire);
      if ((c >> 32) != g || (c & 0xFFFFFFFFu) >= n_) return;
      if (!claim_.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel)) continue;
      (*fn_)(c & 0xFFFFFFFFu);
      finished_.fetch_add(1, std::memory_order_release);
    }
  }
  void Loop() {
    uint32_t seen = 0;
    for (;;) {
      uint32_t g = gen_.load(std::memory_order_acquire);
      for (int i = 0; g == seen && i < kSpinIters && !parked_.load(std::memory_order_acquire); ++i) {
        __builtin_ia32_pause();
        g = gen_.load(std::memory_order_acquire);
      }
      if (g == seen) {
        sleeping_.store(true, std::memory_order_seq_cst);
        if (gen_.load(std::memory_order_seq_cst) == seen) {
          syscall(SYS_futex, reinterpret_cast<uint32_t*>(&gen_), FUTEX_WAIT_PRIVATE, seen,
                  nullptr, nullptr, 0);
        }
        sleeping_.store(false, std::memory_order_relaxed);
        continue;
      }
      seen = g;
      if (stop_.load()) return;
      Drain(g);
    }
  }
  const std::function<void(size_t)>* fn_ = nullptr;
  size_t n_ = 0;
  std::atomic<uint32_t> gen_{0};
  std::atomic<uint64_t> claim_{0};  // generation << 32 | next task
  std::atomic<size_t> finished_{0};
  std::atomic<bool> sleeping_{false};
  std::atomic<bool> parked_{false};
  std::atomic<bool> stop_{false};
  std::thread helper_;
};

// ---- workload ----------------------------------------------------------------------------

std::vector<int64_t> ZipfKeys(size_t num_keys, size_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<double> cdf(num_keys);
  double sum = 0;
  for (size_t r = 0; r < num_keys; ++r) cdf[r] = (sum += std::pow(static_cast<double>(r + 1), -kZipf));
  for (double& c : cdf) c /= sum;
  std::vector<int64_t> perm(num_keys);
  for (size_t i = 0; i < num_keys; ++i) perm[i] = static_cast<int64_t>(i);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<int64_t> keys(count);
  for (size_t i = 0; i < count; ++i) {
    size_t r = static_cast<size_t>(std::upper_bound(cdf.begin(), cdf.end(), u(rng)) - cdf.begin());
    keys[i] = perm[std::min(r, num_keys - 1)];
  }
  return keys;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double Seconds(const std::function<void()>& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Median seconds of a pass of each fn over the batches, passes interleaved; each timed pass
// follows an untimed warm-up over the first eighth of the batches.
std::vector<double> TimedPasses(const std::vector<std::function<void(size_t, size_t)>>& fns,
                                size_t batches, int repeats) {
  std::vector<std::vector<double>> t(fns.size());
  const size_t warm = std::max<size_t>(1, batches / 8);
  for (int r = 0; r < repeats; ++r) {
    for (size_t f = 0; f < fns.size(); ++f) {
      fns[f](0, warm);
      t[f].push_back(Seconds([&] { fns[f](0, batches); }));
    }
  }
  std::vector<double> med;
  for (auto& v : t) med.push_back(Median(v));
  return med;
}

void Emit(const char* metric, const char* impl, double value, const char* unit, int threads,
          const Args& a, double baseline, double distinct) {
  std::printf("{\"bench\": \"store_ceiling\", \"metric\": \"%s\", \"impl\": \"%s\", "
              "\"value\": %.2f, \"unit\": \"%s\"",
              metric, impl, value, unit);
  if (baseline > 0) {
    std::printf(", \"baseline\": %.2f, \"ratio\": %.3f", baseline, value / baseline);
  }
  std::printf(", \"threads\": %d, \"dim\": %d, \"keys\": %zu, \"batch\": %zu, \"zipf\": %.2f, "
              "\"group\": %zu, \"distinct_keys_per_batch\": %.1f}\n",
              threads, a.dim, a.keys, kBatch, kZipf, a.group, distinct);
  std::fflush(stdout);
}

Args Parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", f.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (f == "--keys") a.keys = std::stoull(val());
    else if (f == "--dim") a.dim = std::stoi(val());
    else if (f == "--batches") a.batches = std::stoull(val());
    else if (f == "--repeats") a.repeats = std::stoi(val());
    else if (f == "--group") a.group = std::stoull(val());
    else if (f == "--no-engine") a.engine = false;
    else if (f == "--shards") a.shards = std::stoi(val());
    else if (f == "--page-rows") a.page_rows = static_cast<uint32_t>(std::stoul(val()));
    else if (f == "--quick") { a.batches = 64; a.repeats = 3; }
    else if (f == "--threads") {
      a.threads.clear();
      std::string s = val();
      for (size_t p = 0; p < s.size();) {
        size_t q = s.find(',', p);
        if (q == std::string::npos) q = s.size();
        a.threads.push_back(std::stoi(s.substr(p, q - p)));
        p = q + 1;
      }
    } else {
      std::fprintf(stderr,
                   "usage: %s [--keys N] [--dim D] [--batches B] [--repeats R] [--group 16|32|64]"
                   " [--threads 1,2] [--no-engine] [--quick]\n",
                   argv[0]);
      std::exit(2);
    }
  }
  if (a.group != 16 && a.group != 32 && a.group != 64) {
    std::fprintf(stderr, "--group must be 16, 32 or 64\n");
    std::exit(2);
  }
  for (int t : a.threads) {
    if (t != 1 && t != 2) {
      std::fprintf(stderr, "--threads takes 1 and/or 2\n");
      std::exit(2);
    }
  }
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = Parse(argc, argv);
  const size_t dim = static_cast<size_t>(a.dim);
  const std::vector<int64_t> keys = ZipfKeys(a.keys, a.batches * kBatch, /*seed=*/a.dim);
  double distinct = 0;
  {
    std::vector<int64_t> b(kBatch);
    for (size_t i = 0; i < a.batches; ++i) {
      std::copy_n(keys.begin() + i * kBatch, kBatch, b.begin());
      std::sort(b.begin(), b.end());
      distinct += static_cast<double>(std::unique(b.begin(), b.end()) - b.begin());
    }
    distinct /= static_cast<double>(a.batches);
  }
  std::vector<float> out(kBatch * dim);
  std::vector<float> grads(kBatch * dim);
  for (size_t i = 0; i < grads.size(); ++i) grads[i] = static_cast<float>(i % 97) * 1e-3f;
  const float lr = 0.01f;

  RefTable ref(a.keys, a.dim);
  BucketTable best(a.keys, a.dim);
  for (int threads : a.threads) {
    std::unique_ptr<bagpipe::store::EmbeddingStore> store;
    if (a.engine) {
      bagpipe::store::StoreOptions o;
      o.dim = a.dim;
      o.num_threads = threads;
      o.num_shards = a.shards;
      o.page_rows = a.page_rows;
      o.init.bound = 0.01f;
      store = std::make_unique<bagpipe::store::EmbeddingStore>(o);
      store->Reserve(a.keys);
      constexpr size_t kChunk = size_t{1} << 20;  // as ps_store.py: every key, in order
      std::vector<int64_t> chunk(kChunk);
      std::vector<float> rows(kChunk * dim);
      for (size_t s = 0; s < a.keys; s += kChunk) {
        const size_t m = std::min(kChunk, a.keys - s);
        for (size_t j = 0; j < m; ++j) chunk[j] = static_cast<int64_t>(s + j);
        store->Lookup(chunk.data(), m, rows.data(), true);
      }
    }
    std::unique_ptr<SpinPair> pair;
    if (threads == 2) pair = std::make_unique<SpinPair>();
    std::vector<RefTable::SgdScratch> scratch(2);

    auto ref_lookup = [&](size_t b0, size_t b1) {
      for (size_t b = b0; b < b1; ++b) {
        const int64_t* k = keys.data() + b * kBatch;
        auto part = [&](size_t t) {
          const size_t lo = threads == 1 ? 0 : kBatch * t / kTasks;
          const size_t hi = threads == 1 ? kBatch : kBatch * (t + 1) / kTasks;
          float* o = out.data() + lo * dim;
          switch (a.group) {
            case 16: return ref.Lookup<16>(k + lo, hi - lo, o);
            case 64: return ref.Lookup<64>(k + lo, hi - lo, o);
            default: return ref.Lookup<32>(k + lo, hi - lo, o);
          }
        };
        if (threads == 1) part(0); else pair->Run(kTasks, part);
      }
      if (pair) pair->Park();
    };
    auto best_lookup = [&](size_t b0, size_t b1) {
      for (size_t b = b0; b < b1; ++b) {
        const int64_t* k = keys.data() + b * kBatch;
        auto part = [&](size_t t) {
          const size_t lo = threads == 1 ? 0 : kBatch * t / kTasks;
          const size_t hi = threads == 1 ? kBatch : kBatch * (t + 1) / kTasks;
          best.LookupAny(k + lo, hi - lo, out.data() + lo * dim);
        };
        if (threads == 1) part(0); else pair->Run(kTasks, part);
      }
      if (pair) pair->Park();
    };
    // The reference SGD on 2 threads: each thread takes the distinct keys of one hash parity.
    auto ref_sgd = [&](size_t b0, size_t b1) {
      for (size_t b = b0; b < b1; ++b) {
        const int64_t* k = keys.data() + b * kBatch;
        if (threads == 1) {
          ref.Sgd(k, kBatch, grads.data(), lr, scratch[0], 0, 1);
        } else {
          pair->Run(2, [&](size_t t) { ref.Sgd(k, kBatch, grads.data(), lr, scratch[t], t, 2); });
        }
      }
      if (pair) pair->Park();
    };
    auto eng_lookup = [&](size_t b0, size_t b1) {
      for (size_t b = b0; b < b1; ++b) store->Lookup(keys.data() + b * kBatch, kBatch, out.data(), true);
    };
    auto eng_sgd = [&](size_t b0, size_t b1) {
      for (size_t b = b0; b < b1; ++b) store->ApplySgd(keys.data() + b * kBatch, kBatch, grads.data(), lr, 1);
    };

    const double total = static_cast<double>(a.batches * kBatch) / 1e6;
    std::vector<std::function<void(size_t, size_t)>> fl = {ref_lookup, best_lookup};
    if (a.engine) fl.push_back(eng_lookup);
    std::vector<double> t = TimedPasses(fl, a.batches, a.repeats);
    Emit("lookup", "reference", total / t[0], "M keys/s", threads, a, 0, distinct);
    Emit("lookup", "bucketized", total / t[1], "M keys/s", threads, a, total / t[0], distinct);
    if (a.engine) Emit("lookup", "engine", total / t[2], "M keys/s", threads, a, total / t[0], distinct);

    std::vector<std::function<void(size_t, size_t)>> fs = {ref_sgd};
    if (a.engine) fs.push_back(eng_sgd);
    t = TimedPasses(fs, a.batches, a.repeats);
    Emit("apply_sgd", "reference", total / t[0], "M rows/s", threads, a, 0, distinct);
    if (a.engine) Emit("apply_sgd", "engine", total / t[1], "M rows/s", threads, a, total / t[0], distinct);
  }
  return 0;
}
