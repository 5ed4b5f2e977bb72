// KeyMap: int64 key -> uint32 slot, one per hash shard of an EmbeddingStore.
//
// Open addressing over 16-byte entries grouped into buckets of four (one 64-byte cache
// line), linear probing bucket by bucket, load factor <= 0.7, any capacity (the home bucket
// is a multiply-shift "fast range" of the key hash, so the table need not be a power of two
// and can be sized tightly by Reserve), deletion by backward shift (no tombstones, probe
// sequences stay short after many erases). A lookup compares a whole bucket at once (SIMD
// where the build allows) and, at load 0.7, resolves about 91% of present keys in its home
// line, so the read pipeline prefetches one line per key and defers the rest a stage.
//
// Thread safety: not synchronized. Any number of threads may call the const methods
// concurrently; a mutating method requires exclusive access (the store serializes batch
// operations and gives each shard to one thread).
//
// Invariants:
//   1. size() <= MaxSize(capacity()) = floor(0.7 * capacity()); capacity() is a multiple of
//      kBucketEntries (or 0).
//   2. A key stored in bucket p with home bucket h: every bucket from h up to, not
//      including, p (cyclically) is full.
//   3. An entry is empty iff its tag is 0, and then its key and reserved words are 0 too; a
//      stored entry has tag = slot + 1 and reserved = 0.
//   4. Each key appears at most once.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace bagpipe::store {

class KeyMap {
 public:
  struct alignas(16) Entry {
    int64_t key;
    uint32_t tag;       // 0: empty; otherwise slot + 1
    uint32_t reserved;  // 0; keeps entries 16-byte aligned so none straddles a cache line
  };
  static_assert(sizeof(Entry) == 16);
  static constexpr size_t kBucketEntries = 4;  // one 64-byte line (the table is page-aligned)

  static constexpr uint32_t kNotFound = 0xFFFFFFFFu;
  // A placeholder the store gives keys it inserts before their slot is chosen; no pending
  // entry survives a store operation.
  static constexpr uint32_t kPendingSlot = 0xFFFFFFFEu;
  static constexpr uint32_t kMaxSlot = 0xFFFFFFFDu;

  // Which entries of a bucket hold `key` and which are empty: bit 2*i stands for entry i
  // (EntryOf turns a bit index into the entry index).
  struct Match {
    unsigned hit;
    unsigned empty;
  };
  // The entry index of a Match bit index.
  static unsigned EntryOf(unsigned bit) { return bit >> 1; }
  // REQUIRES: bucket points at kBucketEntries entries, 64-byte aligned.
  static Match MatchBucket(const Entry* bucket, int64_t key) {
#if defined(__AVX512F__)
    // 64-bit lanes 2i are keys, lanes 2i+1 are tag and reserved words (zero iff empty,
    // invariant 3).
    const __m512i v = _mm512_load_si512(static_cast<const void*>(bucket));
    const unsigned keys = _mm512_mask_cmpeq_epi64_mask(0x55, v, _mm512_set1_epi64(key));
    const unsigned empty = _mm512_mask_cmpeq_epi64_mask(0xAA, v, _mm512_setzero_si512()) >> 1;
    return {keys & ~empty, empty};  // an empty entry's key word is 0: never a hit
#else
    return MatchBucketScalar(bucket, key);
#endif
  }
  // MatchBucket without AVX-512 (equal results). REQUIRES: as MatchBucket.
  static Match MatchBucketScalar(const Entry* bucket, int64_t key) {
    unsigned hit = 0, empty = 0;
    for (unsigned i = 0; i < kBucketEntries; ++i) {
      const bool e = bucket[i].tag == 0;
      empty |= static_cast<unsigned>(e) << (2 * i);
      hit |= static_cast<unsigned>(!e && bucket[i].key == key) << (2 * i);
    }
    return {hit, empty};
  }

  // shard_bits: how many top bits of the key hash chose this shard (they are constant
  // within the shard, so the bucket is taken from the remaining bits).
  // Empty; no table is mapped until the first Insert or Reserve.
  explicit KeyMap(int shard_bits);
  // Releases the table.
  ~KeyMap();
  KeyMap(const KeyMap&) = delete;
  KeyMap& operator=(const KeyMap&) = delete;

  // Keys stored; entries and buckets of the table (0 before it is mapped); its mapped bytes.
  size_t size() const { return size_; }
  size_t capacity() const { return num_buckets_ * kBucketEntries; }  // entries
  size_t num_buckets() const { return num_buckets_; }
  size_t bytes() const { return mapped_bytes_; }

  // The most keys a table of `capacity` entries may hold.
  static size_t MaxSize(size_t capacity) { return capacity * 7 / 10; }

  // Home bucket of a key hash (REQUIRES: capacity() > 0).
  size_t Home(uint64_t hash) const {
    return static_cast<size_t>(
        (static_cast<unsigned __int128>(hash << shard_bits_) * num_buckets_) >> 64);
  }
  // First entry of bucket b (REQUIRES: b < num_buckets()).
  const Entry* bucket(size_t b) const { return table_ + b * kBucketEntries; }

  // Slot of key, or kNotFound. REQUIRES: hash == KeyHash(key).
  uint32_t Find(int64_t key, uint64_t hash) const {
    return num_buckets_ == 0 ? kNotFound : view().Find(key, hash);
  }

  // Adds key -> slot and returns its entry index. REQUIRES: key absent, slot <= kMaxSlot or
  // kPendingSlot. Grows the table when the load would pass 0.7; on std::bad_alloc nothing
  // has changed. Inserting never moves other entries; only growth (a capacity change) does.
  size_t Insert(int64_t key, uint64_t hash, uint32_t slot);

  // Replaces the slot of the entry at index i. REQUIRES: entry i holds a key (e.g. returned
  // by Insert with no capacity change since), slot <= kMaxSlot.
  void SetSlotAt(size_t i, uint32_t slot) { table_[i].tag = slot + 1; }

  // Replaces the slot of a stored key. REQUIRES: key present, slot <= kMaxSlot.
  void SetSlot(int64_t key, uint64_t hash, uint32_t slot);

  // Removes key; returns its slot, or kNotFound when absent.
  uint32_t Erase(int64_t key, uint64_t hash);

  // Ensures `n` keys fit without growing. On std::bad_alloc nothing has changed.
  void Reserve(size_t n);

  // A read-only snapshot of the table for hot loops: valid until the next mutation. An
  // empty map yields a one-bucket empty table, so probing needs no capacity check.
  struct View {
    const Entry* table;
    uint64_t num_buckets;
    int shard_bits;
    // As KeyMap::Home, bucket and Find, on the snapshot; BucketOf is bucket's inverse, Next
    // the bucket probed after b (wrapping around). REQUIRES: b < num_buckets.
    size_t Home(uint64_t hash) const {
      return static_cast<size_t>(
          (static_cast<unsigned __int128>(hash << shard_bits) * num_buckets) >> 64);
    }
    const Entry* bucket(size_t b) const { return table + b * kBucketEntries; }
    size_t BucketOf(const Entry* bucket_start) const {
      return static_cast<size_t>(bucket_start - table) / kBucketEntries;
    }
    size_t Next(size_t b) const { return b + 1 == num_buckets ? 0 : b + 1; }
    uint32_t Find(int64_t key, uint64_t hash) const { return FindFrom(Home(hash), key); }
    // Probes from bucket b on. REQUIRES: b == Home(KeyHash(key)), or b follows it and every
    // bucket from the home up to b is full without holding key.
    uint32_t FindFrom(size_t b, int64_t key) const {
      for (;;) {
        const Entry* e = bucket(b);
        const Match m = MatchBucket(e, key);
        if (m.hit != 0) return e[EntryOf(__builtin_ctz(m.hit))].tag - 1;
        if (m.empty != 0) return kNotFound;
        b = Next(b);
      }
    }
  };
  // The snapshot (see View).
  View view() const {
    alignas(64) static const Entry kEmpty[kBucketEntries] = {};
    return num_buckets_ == 0 ? View{kEmpty, 1, shard_bits_}
                             : View{table_, num_buckets_, shard_bits_};
  }

  // Raw table for ordered iteration: capacity() entries; those with tag != 0 are stored.
  const Entry* entries() const { return table_; }

  // Removes every key and releases the table.
  void Clear();

 private:
  void Rehash(size_t new_num_buckets);
  // Entry index of the first empty entry at or after key's home (REQUIRES: capacity > 0).
  size_t FreeEntryFor(uint64_t hash) const;

  const int shard_bits_;
  Entry* table_ = nullptr;     // owned mapping of mapped_bytes_ bytes
  size_t num_buckets_ = 0;
  size_t mapped_bytes_ = 0;
  size_t size_ = 0;
};

}  // namespace bagpipe::store
